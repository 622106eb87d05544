"""Block-allocating GDID generator: never auto-increment.

Auto-increment keys are per server: they collide as soon as a briefcase moves to another server,
and they make the database the bottleneck of every insert. GDIDs instead come from a *sequence*
in CENTRAL: one row per (scope, sequence) holding the next free (era, counter). A process
reserves a *block* of counters with ONE atomic statement (an upsert with RETURNING) and hands
them out in-process under a lock; the next block is prefetched in a background thread when the
current one runs low, so callers almost never wait on the database.

Guarantees:
- a counter is reserved by exactly one reservation (the row update is atomic), so GDIDs are
  unique across threads, processes and restarts; the unused tail of a block is lost, never reused;
- counters start at 1, so ``0:0:0`` is never issued;
- blocks are consumed in the order they were reserved, and the sequence only moves forward, so
  the GDIDs one generator hands out strictly increase;
- when a block would pass 2^60-1 it ends at 2^60-1 and the sequence moves to era+1, counter 1.

The row lives on the CENTRAL shard that ``router.locate_central(f"{scope}/{sequence}")`` names.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from sqlalchemy import BigInteger, Column, ColumnElement, DateTime, String, Table, and_, case, func, or_, select, update
from sqlalchemy.engine import Connection

from mdb import telemetry
from mdb.dialects import sql_dialect
from mdb.errors import GDIDError
from mdb.gdid import (
    COUNTER_BITS,
    MAX_AUTHORITY,
    MAX_COUNTER,
    MAX_ERA,
    GDID,
    _new_object,
    _set_era,
    _set_raw,
    _trusted,
    _trusted_run,
    check_sequence_name,
    sequence_key,
)
from mdb.briefcase import BriefcaseType
from mdb.cluster import Cluster
from mdb.router import Router
from mdb.system_tables import central_metadata


__all__ = [
    "AUTHORITY_ENV",
    "DEFAULT_BLOCK_SIZE",
    "Block",
    "GdidGenerator",
    "advance_sequence",
    "authority_from_env",
    "generator_for",
    "read_sequence",
    "reserve_block",
    "sequence_key",
    "sequences",
    "start_above",
]

log = logging.getLogger("mdb.idgen")

DEFAULT_BLOCK_SIZE: Final = 1024
MAX_BLOCK_SIZE: Final = 2**40
"""Upper bound of one reservation; keeps ``next_counter + size`` far inside a signed 64-bit int."""
AUTHORITY_ENV: Final = "MDB_AUTHORITY"
LOW_WATER: Final = 0.25
"""Prefetch the next block when less than this share of the current block is left."""
GROWTH_LIMIT: Final = 64
"""By default a block may grow to 64 times the configured size (see ``max_block_size``)."""


sequences = Table(
    "mdb_gdid_sequences",
    central_metadata,
    Column("scope", String(63), primary_key=True),
    Column("sequence", String(63), primary_key=True),
    # The next free position: never issued yet. Only ever moves forward.
    Column("era", BigInteger, nullable=False),
    Column("next_counter", BigInteger, nullable=False),
    # The block the last reservation took; RETURNING reads it, because across an era roll-over
    # the new (era, next_counter) no longer tells where the block started.
    Column("block_era", BigInteger, nullable=False),
    Column("block_start", BigInteger, nullable=False),
    Column("block_end", BigInteger, nullable=False),
    Column("reserved_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)


@dataclass(frozen=True, slots=True)
class Block:
    """Counters ``start..end`` (inclusive) of ``era``, reserved for one generator."""

    era: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start + 1


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A sequence row: the next free position and the last block reserved."""

    scope: str
    sequence: str
    era: int
    next_counter: int
    last_block: Block


def _check_block_size(size: int) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_BLOCK_SIZE:
        raise GDIDError(f"invalid GDID block size {size!r}: must be an int in 1..{MAX_BLOCK_SIZE}")
    return size


def _check_authority(authority: int, source: str) -> int:
    if not isinstance(authority, int) or isinstance(authority, bool) or not 0 <= authority <= MAX_AUTHORITY:
        raise GDIDError(f"invalid GDID authority {authority!r} from {source}: must be an int in 0..{MAX_AUTHORITY}")
    return authority


def authority_from_env() -> int:
    """The authority nibble from ``MDB_AUTHORITY`` (0 when unset)."""
    text = os.environ.get(AUTHORITY_ENV)
    if text is None or not text.strip():
        return 0
    if not (text.strip().isascii() and text.strip().isdigit()):
        raise GDIDError(f"invalid GDID authority {text!r} from ${AUTHORITY_ENV}: must be a number in 0..{MAX_AUTHORITY}")
    return _check_authority(int(text.strip()), f"${AUTHORITY_ENV}")


# -- the sequence table -------------------------------------------------------------------------


def reserve_block(conn: Connection, scope: str, sequence: str, size: int) -> Block:
    """Reserve ``size`` counters with ONE statement; ``conn`` must be in a transaction.

    A new sequence starts at era 0, counter 1. A block that would pass 2^60-1 is cut at 2^60-1
    (it may be shorter than ``size``) and the sequence moves on to era+1, counter 1.
    """
    sequence_key(scope, sequence)
    _check_block_size(size)
    t = sequences
    fits = t.c.next_counter + size <= MAX_COUNTER  # the position after the block is a valid counter
    insert_new = sql_dialect(conn).insert(t).values(
        scope=scope,
        sequence=sequence,
        era=0,
        next_counter=1 + size,
        block_era=0,
        block_start=1,
        block_end=size,
    )
    stmt = insert_new.on_conflict_do_update(
        index_elements=[t.c.scope, t.c.sequence],
        set_={
            # Every right-hand side reads the row as it was before this statement.
            "block_era": t.c.era,
            "block_start": t.c.next_counter,
            "block_end": case((fits, t.c.next_counter + (size - 1)), else_=MAX_COUNTER),
            "era": case((fits, t.c.era), else_=t.c.era + 1),
            "next_counter": case((fits, t.c.next_counter + size), else_=1),
            "reserved_at": func.current_timestamp(),
        },
    ).returning(t.c.block_era, t.c.block_start, t.c.block_end)
    era, start, end = conn.execute(stmt).one()
    if era > MAX_ERA:
        raise GDIDError(f"GDID sequence {scope}/{sequence} is exhausted: every era up to {MAX_ERA} is used")
    telemetry.gdid_block(scope)
    return Block(era, start, end)


def read_sequence(conn: Connection, scope: str, sequence: str) -> SequenceState | None:
    """The sequence row, or None when nothing was ever reserved from it."""
    sequence_key(scope, sequence)
    t = sequences
    row = conn.execute(
        select(t.c.era, t.c.next_counter, t.c.block_era, t.c.block_start, t.c.block_end).where(
            t.c.scope == scope, t.c.sequence == sequence
        )
    ).one_or_none()
    if row is None:
        return None
    return SequenceState(scope, sequence, row.era, row.next_counter, Block(row.block_era, row.block_start, row.block_end))


def advance_sequence(conn: Connection, scope: str, sequence: str, era: int, next_counter: int) -> SequenceState:
    """Move the next free position forward to (era, next_counter); never backward.

    For starting a sequence above ids that already exist (an import, a migration). A position
    at or below the current one leaves the row unchanged, so this can never cause a reissue.
    """
    sequence_key(scope, sequence)
    if not isinstance(era, int) or not 0 <= era <= MAX_ERA:
        raise GDIDError(f"invalid GDID sequence era {era!r}: must be in 0..{MAX_ERA}")
    if not isinstance(next_counter, int) or not 1 <= next_counter <= MAX_COUNTER:
        raise GDIDError(f"invalid GDID sequence counter {next_counter!r}: must be in 1..{MAX_COUNTER}")
    t = sequences
    conn.execute(
        sql_dialect(conn).insert(t)
        .values(scope=scope, sequence=sequence, era=0, next_counter=1, block_era=0, block_start=0, block_end=0)
        .on_conflict_do_nothing(index_elements=[t.c.scope, t.c.sequence])
    )
    conn.execute(
        update(t)
        .where(
            t.c.scope == scope,
            t.c.sequence == sequence,
            or_(t.c.era < era, and_(t.c.era == era, t.c.next_counter < next_counter)),
        )
        .values(era=era, next_counter=next_counter)
    )
    state = read_sequence(conn, scope, sequence)
    assert state is not None  # the upsert above created it in this transaction
    return state


ROW_SCOPE_SUFFIX: Final = ":rows"
"""Child-row ids come from scope ``{scope}:rows``: ``:`` cannot occur in an area name (the map's
name rule), so such a sequence is never counted in an area's high-water mark."""


def row_scope(scope: str) -> str:
    """The scope of child-row id sequences of ``scope`` (an area or a repository's scope)."""
    check_sequence_name("scope", scope)
    return scope + ROW_SCOPE_SUFFIX


def start_above(
    store: Cluster, scope: str, sequence: str, *, scopes: Iterable[str] = (), older: Iterable[tuple[str, str]] = ()
) -> SequenceState | None:
    """Move sequence (scope, sequence) past every id that the given sequences issued (never back).

    ``scopes``: every sequence of these scopes; ``older``: these (scope, sequence) pairs. They
    may live on any CENTRAL shard, so each is asked. This is the upgrade step that lets a new
    sequence take over from older ones without re-issuing their ids; it is idempotent and cheap
    (one query per CENTRAL shard, one update). Returns the target's state after, or None when no
    source sequence exists (nothing to start above).
    """
    sequence_key(scope, sequence)
    scope_list, pairs = list(scopes), list(older)
    t = sequences
    conditions: list[ColumnElement[bool]] = [t.c.scope.in_(scope_list)] if scope_list else []
    conditions += [and_(t.c.scope == s, t.c.sequence == q) for s, q in pairs]
    if not conditions:
        return None
    best: tuple[int, int] | None = None
    router = Router(store.map)
    for server in router.central_servers():
        with store.transaction(server) as conn:
            for era, next_counter in conn.execute(select(t.c.era, t.c.next_counter).where(or_(*conditions))):
                best = max(best or (0, 1), (int(era), int(next_counter)))
    if best is None:
        return None
    target = router.locate_central(sequence_key(scope, sequence)).server
    with store.transaction(target) as conn:
        return advance_sequence(conn, scope, sequence, *best)


# -- the generator ------------------------------------------------------------------------------

Reserver = Callable[[int], Block]
"""Reserves a block of at least one and at most the given number of counters."""


class GdidGenerator:
    """Hands out GDIDs of one sequence from reserved blocks; thread-safe.

    ``reserve`` does the database work (see :meth:`for_store`). The hot path is a counter and a
    limit under a lock; ids are built outside it without validation (they are known valid).
    """

    def __init__(
        self,
        reserve: Reserver,
        *,
        authority: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_block_size: int | None = None,
        name: str = "gdid",
        prefetch: bool = True,
    ) -> None:
        self.authority = authority_from_env() if authority is None else _check_authority(authority, "the authority argument")
        self.block_size = _check_block_size(block_size)
        self.max_block_size = _check_block_size(
            min(block_size * GROWTH_LIMIT, MAX_BLOCK_SIZE) if max_block_size is None else max_block_size
        )
        if self.max_block_size < self.block_size:
            raise GDIDError(f"invalid GDID max block size {self.max_block_size}: below the block size {self.block_size}")
        self.current_block_size = self.block_size
        """What the next reservation asks for: doubles each time a caller had to wait for a block."""
        self.name = name
        self.prefetch = prefetch
        self._reserve = reserve
        self._base = self.authority << COUNTER_BITS
        # The hot paths take the plain lock (Condition.__enter__ is a Python-level call); waits
        # and notifications go through the condition built on the same lock.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Current block as raw ids (authority << 60 | counter): next to hand out, last inclusive.
        self._era = 0
        self._next = 1
        self._last = 0
        self._low_mark = _NEVER
        self._queue: deque[Block] = deque()
        self._fetching = False
        self.last_prefetch_error: BaseException | None = None
        """Why the last background prefetch failed (None after a success); also logged."""
        self.blocks_reserved = 0
        self._grown_at = 0

    @classmethod
    def for_store(
        cls,
        store: Cluster,
        scope: str,
        sequence: str,
        *,
        authority: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_block_size: int | None = None,
        prefetch: bool = True,
    ) -> GdidGenerator:
        """A generator whose blocks come from the sequence row on its CENTRAL shard."""
        key = sequence_key(scope, sequence)
        # The CENTRAL shard list can never change (map edit safety), so locating once is final.
        server = Router(store.map).locate_central(key).server

        def reserve(size: int) -> Block:
            with store.transaction(server) as conn:
                return reserve_block(conn, scope, sequence, size)

        return cls(
            reserve, authority=authority, block_size=block_size, max_block_size=max_block_size, name=key, prefetch=prefetch
        )

    def __repr__(self) -> str:
        return f"GdidGenerator({self.name!r}, authority={self.authority}, block_size={self.block_size})"

    # -- handing out --------------------------------------------------------------------------

    def next(self) -> GDID:
        """One new GDID."""
        with self._lock:
            raw = self._next
            if raw > self._last:
                self._install_locked(1)
                raw = self._next
            self._next = raw + 1
            if raw >= self._low_mark:
                self._start_prefetch_locked()
            era = self._era
        g = _new_object(GDID)  # _trusted(era, raw), inlined: a call costs as much as the rest
        _set_era(g, era)
        _set_raw(g, raw)
        return g

    def try_next(self) -> GDID | None:
        """One new GDID if a block already reserved has one, else None; never waits on the database.

        Why: an event loop (``mdb.aio.AsyncGdids``) hands ids out inline while a block is ready
        and sends only a refill to a worker thread, without reading the generator's internals.
        A None also starts the prefetch, as running out in :meth:`next` does.
        """
        with self._lock:
            raw = self._next
            if raw > self._last:
                if not self._queue:
                    self._start_prefetch_locked()
                    return None
                self._install_locked(1)  # a queued block: installed, never reserved here
                raw = self._next
            self._next = raw + 1
            if raw >= self._low_mark:
                self._start_prefetch_locked()
            era = self._era
        return _trusted(era, raw)

    def take(self, n: int) -> list[GDID]:
        """``n`` new GDIDs in increasing order (for bulk inserts)."""
        _check_count(n)
        with self._lock:
            runs = self._take_locked(n)
        return _from_runs(runs)

    def try_take(self, n: int) -> list[GDID] | None:
        """``n`` new GDIDs if the blocks already reserved hold them all, else None (none taken); never waits."""
        _check_count(n)
        with self._lock:
            if self._last - self._next + 1 + sum(len(block) for block in self._queue) < n:
                self._start_prefetch_locked()
                return None
            runs = self._take_locked(n)
        return _from_runs(runs)

    def _take_locked(self, n: int) -> list[tuple[int, int, int]]:
        """Take ``n`` ids as (era, first raw id, count) runs; reserves a block when those reserved run out."""
        runs: list[tuple[int, int, int]] = []
        while n > 0:
            available = self._last - self._next + 1
            if available <= 0:
                self._install_locked(n)
                continue
            k = available if available < n else n
            runs.append((self._era, self._next, k))
            self._next += k
            n -= k
        if self._next > self._low_mark:
            self._start_prefetch_locked()
        return runs

    def __iter__(self) -> GdidGenerator:
        return self

    def __next__(self) -> GDID:
        return self.next()

    # -- blocks -------------------------------------------------------------------------------

    def _install_locked(self, need: int) -> None:
        """Make the next reserved block current (the current one is used up); may reserve.

        The lock is released while reserving or waiting, so another caller may have installed
        a block meanwhile: the loop re-checks the current block before replacing it, or a
        partly used block would be dropped (a gap, and with a queued block, disorder).
        """
        if not self._queue and self.blocks_reserved != self._grown_at and self.current_block_size < self.max_block_size:
            # A caller waits on the database: blocks are used faster than prefetch refills them,
            # so ask for more at a time. Once per block (many threads may stall on one), and the
            # first block, always a wait, does not count.
            self._grown_at = self.blocks_reserved
            self.current_block_size = min(self.current_block_size * 2, self.max_block_size)
        while self._next > self._last:
            if self._queue:
                block = self._queue.popleft()
                self._era = block.era
                self._next = self._base | block.start
                self._last = self._base | block.end
                if self.prefetch and not self._queue:
                    self._low_mark = self._last - int(len(block) * LOW_WATER)
                else:
                    self._low_mark = _NEVER
                return
            if self._fetching:
                self._cond.wait()  # a reservation (prefetch or another caller) is in flight
                continue
            # A bulk take() reserves what it needs in one statement rather than in many blocks.
            size = min(max(self.current_block_size, need), MAX_BLOCK_SIZE)
            self._fetching = True
            self._cond.release()
            try:
                block = self._reserve(size)
            finally:
                self._cond.acquire()
                self._fetching = False
                self._cond.notify_all()
            self._queue.append(block)
            self.blocks_reserved += 1

    def _start_prefetch_locked(self) -> None:
        self._low_mark = _NEVER
        if not self.prefetch or self._fetching or self._queue:
            return
        self._fetching = True
        threading.Thread(target=self._prefetch, name=f"mdb-gdid-prefetch {self.name}", daemon=True).start()

    def _prefetch(self) -> None:
        try:
            block = self._reserve(self.current_block_size)
        except BaseException as exc:
            # The caller that runs out next reserves in the foreground and gets the error itself.
            log.warning("prefetching a GDID block for %s failed: %s", self.name, exc)
            with self._cond:
                self.last_prefetch_error = exc
                self._fetching = False
                self._cond.notify_all()
            return
        with self._cond:
            self._queue.append(block)
            self.blocks_reserved += 1
            self.last_prefetch_error = None
            self._fetching = False
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no reservation is in flight (tests, orderly shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._fetching, timeout)


def _check_count(n: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise GDIDError(f"invalid GDID count {n!r}: must be an int >= 0")


def _from_runs(runs: list[tuple[int, int, int]]) -> list[GDID]:
    if len(runs) == 1:
        return _trusted_run(*runs[0])
    out: list[GDID] = []
    for run in runs:
        out.extend(_trusted_run(*run))
    return out


_NEVER: Final = 1 << 200
"""A low-water mark no raw id reaches: no prefetch is due."""

_registry: weakref.WeakKeyDictionary[Cluster, dict[tuple[str, str], GdidGenerator]] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def generator_for(
    store: Cluster,
    scope: str,
    sequence: str,
    *,
    authority: int | None = None,
    block_size: int | None = None,
) -> GdidGenerator:
    """The Store's one generator of a sequence (created on first use, then cached).

    One generator per sequence per Store keeps the ids a process hands out increasing. Asking
    again with a different authority or block size is refused rather than silently ignored.
    """
    key = (scope, sequence)
    with _registry_lock:
        cache = _registry.setdefault(store, {})
        gen = cache.get(key)
        if gen is None:
            gen = GdidGenerator.for_store(
                store, scope, sequence, authority=authority, block_size=block_size or DEFAULT_BLOCK_SIZE
            )
            cache[key] = gen
            return gen
    if authority is not None and authority != gen.authority:
        raise GDIDError(f"GDID generator {scope}/{sequence} already uses authority {gen.authority}, not {authority}")
    if block_size is not None and block_size != gen.block_size:
        raise GDIDError(f"GDID generator {scope}/{sequence} already uses block size {gen.block_size}, not {block_size}")
    return gen


class Ids:
    """The GDID sequences of one cluster as application code draws them (``store.ids``, ``store.new_gdid``).

    Root ids come from one sequence per briefcase type and child-row ids from ``{scope}:rows/...``;
    on first use per cluster each sequence is moved past the older sequences that issued the same
    kind of id (:func:`start_above`), so upgrading mdb never re-issues an id.
    """

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._taken_over: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def sequence(
        self, scope: str, sequence: str, *, authority: int | None = None, block_size: int | None = None
    ) -> GdidGenerator:
        """The cached generator of exactly this CENTRAL sequence (:func:`generator_for`)."""
        return generator_for(self._cluster, scope, sequence, authority=authority, block_size=block_size)

    def of(self, btype: type[BriefcaseType]) -> GdidGenerator:
        """``btype``'s root-id generator: sequence ``{area}/{btype.id_sequence}``, past every older ``{area}/*``."""
        return self._taken_over_generator(btype.area, btype.id_sequence, scopes=[btype.area])

    def rows(self, scope: str | type[BriefcaseType], sequence: str) -> GdidGenerator:
        """The child-row id generator ``{scope}:rows/{sequence}``, past the older ``{scope}/{sequence}``."""
        name = scope if isinstance(scope, str) else scope.area
        return self._taken_over_generator(row_scope(name), sequence, older=[(name, sequence)])

    def _taken_over_generator(
        self, scope: str, sequence: str, *, scopes: Sequence[str] = (), older: Sequence[tuple[str, str]] = ()
    ) -> GdidGenerator:
        key = (scope, sequence)
        if key not in self._taken_over:
            with self._lock:
                if key not in self._taken_over:
                    start_above(self._cluster, scope, sequence, scopes=scopes, older=older)
                    self._taken_over.add(key)
        return self.sequence(scope, sequence)
