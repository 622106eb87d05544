"""Atomic entity creation by ordered writes (docs/design.md invariant 5).

The briefcase and its CENTRAL entries live on different servers, so no single transaction
covers both. Creation therefore writes in an order where every crash point leaves a state the
read rule (see :mod:`mdb.central.service`) and ``mdb central repair`` settle correctly:

1. ``reserved``: each key's entry is inserted as ``pending`` with the new GDID, one commit per
   key, in (index, key) order. The entry's primary key decides between concurrent creators:
   exactly one insert wins, the others get :class:`~mdb.errors.DuplicateKeyError`.
2. ``written``: the briefcase is written in one briefcase session (root column = the key).
3. ``live``: the entries are marked live.

A crash after 1 leaves a pending entry whose briefcase does not exist: readers see no key,
and once older than the grace period it is deleted (by a reader, a competing creator or
repair). A crash after 2 leaves a pending entry the root confirms: readers finish it. No step
can leave a briefcase without its entry, because the entry is written first and only a
pending entry that the root does NOT confirm is ever deleted.

Why not two-phase commit: PREPARE TRANSACTION exists only on PostgreSQL (the demo runs on
SQLite), needs a coordinator log to resolve in-doubt transactions after a crash, and holds
locks until resolved; ordered writes need nothing but the confirmation read, which the cache
already does on its hits.

Crash points for tests, in the one registry (:mod:`mdb.faults`) as ``central.create.<step>``
for the steps ``start``, ``reserved``, ``writing`` (flushed, not committed), ``written``,
``live``: ``MDB_FAULT_POINT=central.create.written`` SIGKILLs a process the test harness armed
(:mod:`mdb.faults`) there, and ``mdb.faults.hook`` is called with each point's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

from sqlalchemy import delete, inspect as sa_inspect

from mdb.briefcase import BriefcaseType
from mdb.central.cache import CentralCache
from mdb.central.indexes import STATE_LIVE, CentralIndex, IndexRef, IndexRow
from mdb.cluster import Cluster
from mdb.errors import DuplicateKeyError, SchemaError
from mdb.faults import fault_point, register
from mdb.gdid import GDID

__all__ = ["FAULT_POINTS", "STEPS", "create_entity"]

STEPS: Final = ("start", "reserved", "writing", "written", "live")
FAULT_POINTS: Final = register(*(f"central.create.{step}" for step in STEPS))


def _step(name: str) -> None:
    """Pass the crash point of creation step ``name``."""
    fault_point(f"central.create.{name}")


class Central(Protocol):
    """What creation needs of :class:`mdb.central.service.Central` (which calls it, so cannot be imported here)."""

    cluster: Cluster
    cache: CentralCache

    def index(self, ref: IndexRef) -> type[CentralIndex]: ...
    def briefcase_type(self, index: type[CentralIndex]) -> type[BriefcaseType]: ...
    def next_gdid(self, btype: type[BriefcaseType]) -> GDID: ...
    def reserve(self, idx: type[CentralIndex], nkey: str, gdid: GDID) -> IndexRow: ...
    def set_state(self, row: IndexRow, state: str) -> int: ...
    def delete_entry(self, row: IndexRow, *, only_if_created_at: bool = False) -> int: ...
    def add(self, index: IndexRef, key: str, gdid: GDID | str) -> None: ...


def _objects(result: Any | Sequence[Any]) -> list[Any]:
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


def _root_value(btype: type[BriefcaseType], root: Any, column: str) -> Any:
    mapper = sa_inspect(btype.root)
    return getattr(root, mapper.get_property_by_column(mapper.local_table.c[column]).key)


def _resolve_keys(
    central: Central, btype: type[BriefcaseType], root: Any, keys: Mapping[IndexRef, str] | Iterable[IndexRef]
) -> list[tuple[type[CentralIndex], str]]:
    """(index, normalized key) pairs; a bare index takes its key from the root column."""
    pairs: list[tuple[type[CentralIndex], str]] = []
    items = keys.items() if isinstance(keys, Mapping) else ((ref, None) for ref in keys)
    for ref, raw in items:
        idx = central.index(ref)
        if central.briefcase_type(idx) is not btype:
            raise SchemaError(f"CENTRAL index {idx.name!r} points at {central.briefcase_type(idx).__name__}, not {btype.__name__}")
        carried = _root_value(btype, root, idx.root_column) if idx.root_column is not None else None
        if raw is None:
            if idx.root_column is None:
                raise SchemaError(f"CENTRAL index {idx.name!r} has no root_column: pass its key explicitly")
            if carried is None:
                # a ValueError like key_of's for a bad key (it got this None before), naming the empty column
                raise ValueError(
                    f"the new {btype.__name__} root has no {idx.root_column} for index {idx.name!r}: set it or pass the key explicitly"
                )
            raw = carried
        nkey = idx.key_of(raw)
        if idx.root_column is not None and (carried is None or idx.key_of(carried) != nkey):
            raise SchemaError(
                f"the new {btype.__name__} root carries {idx.root_column}={carried!r} but key {raw!r} was given "
                f"for index {idx.name!r}: the root column must carry the key"
            )
        pairs.append((idx, nkey))
    return sorted(set(pairs), key=lambda p: (p[0].name, p[1]))


def create_entity(
    central: Central,
    btype: type[BriefcaseType],
    factory: Callable[[GDID], Any | Sequence[Any]],
    keys: Mapping[IndexRef, str] | Iterable[IndexRef],
    *,
    gdid: GDID | str | None = None,
) -> GDID:
    """Create a briefcase of ``btype`` whose rows ``factory(gdid)`` builds, with its unique keys.

    ``factory`` returns the root object or a list of objects (root first or anywhere). Raises
    :class:`~mdb.errors.DuplicateKeyError` when a key is taken; nothing of this creation
    remains then.
    """
    _step("start")
    # GDID text is accepted as everywhere else (``store.briefcase``, GDID columns); kept as a str
    # it never equalled the root's parsed key, and the refusal read "0:0:7, not 0:0:7".
    gid = central.next_gdid(btype) if gdid is None else gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
    objects = _objects(factory(gid))
    roots = [o for o in objects if isinstance(o, btype.root)]
    if len(roots) != 1:
        raise SchemaError(f"the factory for {btype.__name__} must return exactly one {btype.root.__name__} root object")
    key_attr = sa_inspect(btype.root).get_property_by_column(btype.tables[0].c[btype.key]).key
    if getattr(roots[0], key_attr) is None:
        setattr(roots[0], key_attr, gid)
    elif getattr(roots[0], key_attr) != gid:
        raise SchemaError(f"the factory's root carries {btype.key}={getattr(roots[0], key_attr)}, not the new GDID {gid}")
    pairs = _resolve_keys(central, btype, roots[0], keys)

    reserved: list[IndexRow] = []
    try:
        for idx, nkey in pairs:
            reserved.append(central.reserve(idx, nkey, gid))
        _step("reserved")
        with central.cluster.briefcase(btype, gid) as session:
            session.add_all(objects)
            session.flush()
            _step("writing")
        _step("written")
    except BaseException as exc:
        _release(central, reserved, exc)
        raise
    for row in reserved:
        if not central.set_state(row, STATE_LIVE):
            # A reader took the entry for dangling (this creation outlived the grace period):
            # put it back; if someone else holds the key now, the key is theirs.
            try:
                central.add(row.index_name, row.key, gid)
            except DuplicateKeyError:
                _delete_briefcase(central, btype, gid)
                raise
        central.cache.invalidate((row.index_name, row.key))
    _step("live")
    return gid


def _delete_briefcase(central: Central, btype: type[BriefcaseType], gid: GDID) -> None:
    """Remove a briefcase that lost its key to another creator (children first)."""
    with central.cluster.briefcase(btype, gid) as session:
        for table in reversed(btype.tables):
            session.execute(delete(table).where(btype.key_column(table) == gid))


def _release(central: Central, reserved: list[IndexRow], exc: BaseException) -> None:
    """Undo this creation's reservations after a failure before the briefcase committed."""
    for row in reserved:
        try:
            central.delete_entry(row, only_if_created_at=True)
        except Exception as cleanup:  # the entry stays pending and unconfirmed: repair deletes it
            exc.add_note(f"could not release CENTRAL entry {row.index_name}/{row.key!r}: {cleanup}")
