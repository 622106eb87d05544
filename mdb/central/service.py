"""``store.central``: look keys up (cached), list a GDID's keys, add, remove, rename, create.

Every entry is a row of ``mdb_central_index`` on the CENTRAL shard that
``router.locate_central(normalized key)`` names. An entry is either ``live`` (trusted) or
``pending`` (a creation or rename in flight, or one that crashed). A pending entry is only
believed after the briefcase root confirms it; a reader that finds it confirmed finishes it
(marks it live), one that finds it unconfirmed and older than the grace period deletes it. That
rule, with the write order of :mod:`mdb.central.creation`, is what keeps docs/design.md invariant 5.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import delete, insert, inspect as sa_inspect, select, update

from mdb import telemetry
from mdb.briefcase import BriefcaseType
from mdb.cluster import Cluster
from mdb.central.creation import create_entity
from mdb.central.cache import CacheStats, CentralCache
from mdb.central.indexes import (
    STATE_LIVE,
    STATE_PENDING,
    CentralIndex,
    IndexRef,
    IndexRow,
    RootProbe,
    central_index,
    index_by_name,
)
from mdb.errors import DuplicateKeyError, DuplicateRowError, RoutingError, SchemaError
from mdb.gdid import GDID
from mdb.idgen import Ids

__all__ = ["Central", "IndexRow", "RootProbe"]

def _from_own_sequences(ids: Ids) -> Callable[[type[BriefcaseType]], GDID]:
    """Root GDIDs from each type's own sequence, for a Central made without a Store's id source."""

    def new_gdid(btype: type[BriefcaseType]) -> GDID:
        return ids.of(btype).next()

    return new_gdid


class Central:
    """The CENTRAL index API of one Store; see the module docstring for the entry states.

    ``ttl`` bounds how long another process's write may go unseen by :meth:`lookup`;
    ``grace`` is how old an unconfirmed pending entry must be before it counts as dangling (it
    must exceed the longest creation plus clock skew between processes).
    """

    def __init__(
        self,
        cluster: Cluster,
        *,
        new_gdid: Callable[[type[BriefcaseType]], GDID] | None = None,
        cache_size: int = 100_000,
        ttl: float = 30.0,
        grace: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        if new_gdid is None:
            new_gdid = _from_own_sequences(Ids(cluster))
        self._new_gdid = new_gdid
        """Root GDIDs for :meth:`create` (the Store passes ``store.new_gdid``; alone, the type's own sequence)."""
        self.cache = CentralCache(cache_size, ttl, clock)
        self.grace = grace

    @property
    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    # -- helpers -----------------------------------------------------------------------------

    def index(self, ref: IndexRef) -> type[CentralIndex]:
        if isinstance(ref, str):
            return index_by_name(ref, self.cluster.registry)
        if isinstance(ref, type) and issubclass(ref, CentralIndex):
            return ref
        raise SchemaError(f"not a CENTRAL index: {ref!r}")

    def briefcase_type(self, index: type[CentralIndex]) -> type[BriefcaseType]:
        """The briefcase type an index points at: declared, or the one type of its area here."""
        if index.briefcase is not None:
            return index.briefcase
        types = self.cluster.types_of(index.area)
        if index.root_column is not None:
            types = [t for t in types if index.root_column in t.tables[0].c]
        if len(types) != 1:
            raise SchemaError(
                f"CENTRAL index {index.name!r}: cannot tell which briefcase type of area {index.area!r} it points at "
                f"({', '.join(t.__name__ for t in types) or 'none registered with this Store'}); set briefcase = ..."
            )
        return types[0]

    def server_of(self, normalized_key: str) -> str:
        return self.cluster.router.locate_central(normalized_key).server

    def _row(self, index: type[CentralIndex], nkey: str, slot: GDID | None = None) -> list[IndexRow]:
        c = central_index.c
        stmt = select(c.index_name, c.key, c.slot, c.gdid, c.state, c.created_at).where(
            c.index_name == index.name, c.key == nkey
        )
        if slot is not None:
            stmt = stmt.where(c.slot == slot)
        with self.cluster.transaction(self.server_of(nkey)) as conn:
            return [IndexRow(*r) for r in conn.execute(stmt)]

    def probe_root(self, index: type[CentralIndex], gdid: GDID, *, readonly: bool = False) -> RootProbe:
        """Does the briefcase exist, and which (normalized) key does its root column carry?"""
        btype = self.briefcase_type(index)
        table = btype.tables[0]
        key_col = table.c[btype.key]
        column = table.c[index.root_column] if index.root_column is not None else key_col
        with self.cluster.briefcase(btype, gdid, readonly=readonly) as session:
            row = session.execute(select(column).where(key_col == gdid)).first()
        if row is None:
            return RootProbe(False, None)
        if index.root_column is None or row[0] is None:
            return RootProbe(True, None)
        try:
            return RootProbe(True, index.key_of(row[0]))
        except ValueError:
            return RootProbe(True, None)

    def confirms(self, index: type[CentralIndex], probe: RootProbe, nkey: str) -> bool:
        return probe.exists and (index.root_column is None or probe.key == nkey)

    def set_state(self, row: IndexRow, state: str) -> int:
        """Set exactly this entry's state (same GDID); 0 when a reader deleted it as dangling meanwhile."""
        c = central_index.c
        with self.cluster.transaction(self.server_of(row.key)) as conn:
            return conn.execute(
                update(central_index)
                .where(c.index_name == row.index_name, c.key == row.key, c.slot == row.slot, c.gdid == row.gdid)
                .values(state=state)
            ).rowcount

    def delete_entry(self, row: IndexRow, *, only_if_created_at: bool = False) -> int:
        """Delete exactly this entry (same GDID; with ``only_if_created_at``, same reservation too)."""
        c = central_index.c
        stmt = delete(central_index).where(
            c.index_name == row.index_name, c.key == row.key, c.slot == row.slot, c.gdid == row.gdid
        )
        if only_if_created_at:
            stmt = stmt.where(c.state == STATE_PENDING, c.created_at == row.created_at)
        with self.cluster.transaction(self.server_of(row.key)) as conn:
            count = conn.execute(stmt).rowcount
        self.cache.invalidate((row.index_name, row.key))
        return count

    def _insert(self, index: type[CentralIndex], nkey: str, gdid: GDID, state: str) -> IndexRow:
        row = IndexRow(index.name, nkey, index.slot(gdid), gdid, state, time.time())
        with self.cluster.transaction(self.server_of(nkey)) as conn:
            conn.execute(insert(central_index).values(**row._asdict()))
        self.cache.invalidate((index.name, nkey))
        return row

    def resolve(self, index: type[CentralIndex], row: IndexRow) -> GDID | None:
        """Settle one entry as a reader: the GDID it validly points at, or None.

        A live entry is trusted. A pending one is confirmed on the briefcase root: confirmed ->
        finished (marked live); unconfirmed and older than the grace period -> deleted as
        dangling; unconfirmed and younger -> a creation in flight, reported as absent.
        """
        if row.state == STATE_LIVE:
            return row.gdid
        if self.confirms(index, self.probe_root(index, row.gdid), row.key):
            self.set_state(row, STATE_LIVE)
            return row.gdid
        if time.time() - row.created_at > self.grace:
            self.delete_entry(row, only_if_created_at=True)
        return None

    # -- reads -------------------------------------------------------------------------------

    def lookup(self, index: IndexRef, key: str, *, verify: bool = True) -> GDID | None:
        """The GDID a unique index maps ``key`` to, or None.

        Cached (positive and negative). With ``verify`` (the default) a positive cache hit is
        confirmed on the briefcase root when the index names a ``root_column``; a contradicted
        hit is dropped and re-read from CENTRAL. ``verify=False`` accepts up to ``ttl`` seconds
        of staleness for the speed of a dictionary lookup.
        """
        idx = self.index(index)
        if not idx.unique:
            raise SchemaError(f"CENTRAL index {idx.name!r} is not unique: use lookup_all")
        nkey = idx.key_of(key)
        ck = (idx.name, nkey)
        found, value = self.cache.get(ck)
        if found:
            if value is None or not verify or idx.root_column is None:
                telemetry.central_lookup(idx.name, "hit")
                return value
            if self.confirms(idx, self.probe_root(idx, value, readonly=True), nkey):
                telemetry.central_lookup(idx.name, "verified_hit")
                return value
            self.cache.note_stale(ck)
        telemetry.central_lookup(idx.name, "stale" if found else "miss")
        return self._read_unique(idx, nkey)

    def _read_unique(self, idx: type[CentralIndex], nkey: str) -> GDID | None:
        rows = self._row(idx, nkey, GDID.ZERO)
        if not rows:
            self.cache.put((idx.name, nkey), None)
            return None
        row = rows[0]
        if row.state == STATE_LIVE:
            self.cache.put((idx.name, nkey), row.gdid)
            return row.gdid
        gdid = self.resolve(idx, row)
        if gdid is not None:
            self.cache.put((idx.name, nkey), gdid)
        return gdid  # an in-flight pending entry is not cached: its outcome is near

    def lookup_all(self, index: IndexRef, key: str) -> list[GDID]:
        """Every GDID the key points at (any index; not cached), in GDID order."""
        idx = self.index(index)
        nkey = idx.key_of(key)
        out = [g for row in self._row(idx, nkey) if (g := self.resolve(idx, row)) is not None]
        return sorted(out)

    def keys_of(self, index: IndexRef, gdid: GDID | str) -> list[str]:
        """The normalized keys pointing at ``gdid``: one indexed query on EVERY CENTRAL shard.

        Keys are sharded by their own hash, so nothing tells which shard holds a GDID's keys;
        the fan-out costs one round trip per CENTRAL shard (an index scan on
        ``(index_name, gdid)`` each). No reverse entry is kept because it would be a second
        CENTRAL write per key on another shard with its own crash window.
        """
        idx = self.index(index)
        gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
        c = central_index.c
        stmt = select(c.index_name, c.key, c.slot, c.gdid, c.state, c.created_at).where(
            c.index_name == idx.name, c.gdid == gid
        )
        rows: list[IndexRow] = []
        for server in self.cluster.router.central_servers():
            with self.cluster.transaction(server) as conn:
                rows.extend(IndexRow(*r) for r in conn.execute(stmt))
        return sorted(row.key for row in rows if self.resolve(idx, row) is not None)

    # -- writes ------------------------------------------------------------------------------

    def add(self, index: IndexRef, key: str, gdid: GDID | str) -> None:
        """Point ``key`` at ``gdid`` (live at once). Idempotent; a taken unique key raises DuplicateKeyError.

        For an index with a ``root_column`` the root must already carry the key (else
        ``mdb central check`` reports the entry as stale); :meth:`rename` and :meth:`create`
        keep both in step.
        """
        idx = self.index(index)
        gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
        nkey = idx.key_of(key)
        for _ in range(3):
            try:
                self._insert(idx, nkey, gid, STATE_LIVE)
                return
            except DuplicateRowError:  # the entry's primary key is taken (mdb.dberrors)
                rows = self._row(idx, nkey, idx.slot(gid))
                if not rows:
                    continue  # deleted in between: try again
                if rows[0].gdid == gid:
                    if rows[0].state != STATE_LIVE:
                        self.set_state(rows[0], STATE_LIVE)
                    return
                holder = self.resolve(idx, rows[0])
                if holder is None and not self._row(idx, nkey, idx.slot(gid)):
                    continue  # it was dangling and is gone now
                raise DuplicateKeyError(idx.name, nkey, holder or rows[0].gdid) from None
        raise DuplicateKeyError(idx.name, nkey)

    def remove(self, index: IndexRef, key: str, gdid: GDID | str | None = None) -> bool:
        """Delete the key's entry (only the one pointing at ``gdid`` when given); True if one was."""
        idx = self.index(index)
        nkey = idx.key_of(key)
        c = central_index.c
        stmt = delete(central_index).where(c.index_name == idx.name, c.key == nkey)
        if gdid is not None:
            stmt = stmt.where(c.gdid == (gdid if isinstance(gdid, GDID) else GDID.parse(gdid)))
        with self.cluster.transaction(self.server_of(nkey)) as conn:
            count = conn.execute(stmt).rowcount
        self.cache.invalidate((idx.name, nkey))
        return count > 0

    def rename(self, index: IndexRef, old_key: str, new_key: str) -> GDID:
        """Move a unique key to a new value, updating the root column when the index has one.

        Order (each step its own commit, so a crash anywhere is settled by readers or repair):
        1. mark the old entry pending, 2. reserve the new key pending, 3. update the root
        column, 4. delete the old entry and mark the new one live. Whichever key the root
        carries after a crash is the one the pending rule confirms.
        """
        idx = self.index(index)
        if not idx.unique:
            raise SchemaError(f"CENTRAL index {idx.name!r} is not unique: use add and remove")
        old, new = idx.key_of(old_key), idx.key_of(new_key)
        rows = self._row(idx, old, GDID.ZERO)
        gdid = self.resolve(idx, rows[0]) if rows else None
        if gdid is None:
            raise RoutingError(f"CENTRAL index {idx.name!r} has no key {old!r}")
        if new == old:
            if idx.root_column is not None:
                self._set_root(idx, gdid, new_key)
            return gdid
        old_row = rows[0]
        if idx.root_column is not None:
            self.set_state(old_row, STATE_PENDING)
        try:
            new_row = self.reserve(idx, new, gdid)
        except DuplicateKeyError:
            if idx.root_column is not None:
                self.set_state(old_row, STATE_LIVE)
            raise
        if idx.root_column is not None:
            self._set_root(idx, gdid, new_key)
        self.delete_entry(old_row)
        self.set_state(new_row, STATE_LIVE)
        self.cache.invalidate((idx.name, new))
        return gdid

    def _set_root(self, idx: type[CentralIndex], gdid: GDID, raw_key: str) -> None:
        btype = self.briefcase_type(idx)
        model = btype.root
        mapper = sa_inspect(model)
        attr = mapper.get_property_by_column(mapper.local_table.c[idx.root_column]).key
        with self.cluster.briefcase(btype, gdid) as session:
            obj = session.get(model, gdid)
            if obj is None:
                raise RoutingError(f"briefcase {btype.area}/{gdid} has no root row")
            setattr(obj, attr, raw_key)

    def reserve(self, idx: type[CentralIndex], nkey: str, gdid: GDID) -> IndexRow:
        """Insert a pending entry; the primary key decides between concurrent reservations.

        A conflicting entry that turns out dangling (unconfirmed, older than the grace period)
        is deleted by :meth:`resolve` and the reservation is tried again.
        """
        for _ in range(3):
            try:
                return self._insert(idx, nkey, gdid, STATE_PENDING)
            except DuplicateRowError:  # the entry's primary key is taken (mdb.dberrors)
                rows = self._row(idx, nkey, idx.slot(gdid))
                if not rows:
                    continue
                holder = self.resolve(idx, rows[0])
                if holder is None and not self._row(idx, nkey, idx.slot(gdid)):
                    continue  # it was dangling and is gone now
                raise DuplicateKeyError(idx.name, nkey, holder or rows[0].gdid) from None
        raise DuplicateKeyError(idx.name, nkey)

    # -- creation ----------------------------------------------------------------------------

    def next_gdid(self, btype: type[BriefcaseType]) -> GDID:
        """A new GDID for a briefcase of ``btype``: the type's root sequence (``store.new_gdid``)."""
        return self._new_gdid(btype)

    def create(
        self,
        btype: type[BriefcaseType],
        factory: Callable[[GDID], Any | Sequence[Any]],
        keys: Mapping[IndexRef, str] | Iterable[IndexRef] = (),
        *,
        gdid: GDID | str | None = None,
    ) -> GDID:
        """Create a briefcase and its unique keys atomically (see :mod:`mdb.central.creation`)."""
        return create_entity(self, btype, factory, keys, gdid=gdid)
