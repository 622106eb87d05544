"""Moving one briefcase online (docs/design.md invariant 3).

Order of a move, each step journaled before it is taken (``mdb.moves.journal``):

1. prechecks: both servers' tables match the models (mdb.schema_diff), target holds no row
   of the briefcase and no state row other than an old fence (a move back), source holds it;
2. optional pre-copy of a large briefcase outside the lock (committed on the target together
   with an ``incoming`` state row that keeps sessions away from it);
3. source transaction: the briefcase's EXCLUSIVE lock (PostgreSQL advisory lock on
   :func:`mdb.ownership.lock_key_sql`, which every session takes SHARED; SQLite: BEGIN
   IMMEDIATE). New sessions of the briefcase wait from here: the only pause;
4. copy (or re-sync after a pre-copy) to the target, committed there with the ``incoming`` row;
5. verify: counts and checksums per table computed separately on both sides, each by a query
   of its own on that server (never from the copy's stream). Between PostgreSQL servers the
   source's run on a second source connection while the copy runs (the lock keeps the
   briefcase still there), the target's after its commit;
6. commit point: in the locked source transaction, write the fence and delete the rows (behind
   a savepoint, while the target computes its checksums), then commit only if the checksums
   match and the delete removed exactly the verified number of rows per table; otherwise, or
   when the lock was held longer than ``max_pause``, it is rolled back;
7. finalize: relocation directory in CENTRAL, then the target's ``incoming`` row becomes
   ``resident`` (or disappears on the briefcase's default server), journal ``done``.

A crash before 6 leaves the source authoritative (resume discards the target copy); after 6
the fence proves the move happened and resume finishes 7.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from psycopg import errors as pg_errors
from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError

from mdb import dberrors, telemetry
from mdb.dberrors import translated
from mdb.errors import MdbError, MoveAbortedError, RoutingError, SchemaError
from mdb.gdid import GDID
from mdb.moves import verify
from mdb.moves.copy import AreaTable, copy_rows, delete_briefcase, delete_keys, delete_rows, measure, select_keys
from mdb.moves.faults import fault_point
from mdb.moves.journal import ABORTED, DONE, RUNNING, Journal, JournalEntry, new_move_id
from mdb.moves.lease import describe_liveness, hold
from mdb.ownership import lock_key_sql
from mdb.relocations import clear_relocation, set_relocation
from mdb.schema_diff import compare_tables, format_differences
from mdb.system_tables import STATE_GONE, STATE_INCOMING, STATE_RESIDENT, briefcase_state, load_system_tables
from mdb.urls import mask_secrets

__all__ = [
    "MoveResult",
    "area_tables",
    "check_max_pause",
    "check_target_schema",
    "discard_target",
    "finalize",
    "locked_source",
    "move_briefcase",
    "precheck",
]

log = logging.getLogger("mdb.moves")

DEFAULT_MAX_PAUSE = 5.0
DEFAULT_LOCK_WAIT = 30.0
PRECOPY_ROWS = int(os.environ.get("MDB_PRECOPY_ROWS", "20000"))
"""Briefcases with at least this many rows are pre-copied outside the lock, then re-synced under it."""
VERIFY_WAYS = 2
"""Connections per side that compute a move's checksums at once (large tables in key ranges)."""


@dataclass
class MoveResult:
    move_id: str | None
    area: str
    gdid: GDID
    source: str
    target: str
    status: str  # done | dry-run | already-there
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)
    """table -> (rows, bytes)."""
    pause_seconds: float = 0.0
    precopied: bool = False

    @property
    def rows(self) -> int:
        return sum(r for r, _ in self.tables.values())

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.tables.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "move_id": self.move_id, "area": self.area, "gdid": str(self.gdid), "source": self.source,
            "target": self.target, "status": self.status, "rows": self.rows, "bytes": self.bytes,
            "tables": {k: {"rows": r, "bytes": b} for k, (r, b) in self.tables.items()},
            "pause_seconds": self.pause_seconds, "precopied": self.precopied,
        }


# -- helpers shared by move, resume and reshard -------------------------------------------------


def area_tables(store: Any, area: str) -> list[AreaTable]:
    """Every table of every briefcase type of ``area``, parents before children (FK order)."""
    out: list[AreaTable] = []
    for btype in store.types_of(area):
        mine = set(btype.tables)
        for table in btype.tables[0].metadata.sorted_tables:
            if table in mine:
                out.append(AreaTable(table, btype.key))
    if not out:
        raise RoutingError(f"no briefcase type of area {area!r} is registered (list its module under models: in the map)")
    return out


def _state(conn: Connection, area: str, gdid: GDID) -> dict[str, Any] | None:
    row = conn.execute(
        select(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == gdid)
    ).mappings().first()
    return None if row is None else dict(row)


def _set_state(conn: Connection, area: str, gdid: GDID, state: str, peer: str | None, move_id: str | None) -> None:
    conn.execute(delete(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == gdid))
    conn.execute(insert(briefcase_state).values(area=area, gdid=gdid, state=state, peer=peer, move_id=move_id))


def _root_exists(conn: Connection, tables: list[AreaTable], gdid: GDID) -> bool:
    roots = [at for at in tables if at.pk == [at.key]]
    return any(
        conn.execute(select(func.count()).select_from(at.table).where(at.table.c[at.key] == gdid)).scalar_one()
        for at in roots
    )


@contextmanager
def locked_source(store: Any, server: str, area: str, gdid: GDID, *, lock_wait: float, max_pause: float) -> Iterator[tuple[Connection, float]]:
    """A source transaction holding the briefcase's exclusive lock; yields (conn, lock start time).

    PostgreSQL: ``pg_try_advisory_xact_lock`` polled for ``lock_wait`` seconds (no queue forms,
    so sessions are not held up while we wait for a gap), then one blocking attempt bounded by
    ``max_pause`` via ``lock_timeout``. SQLite: BEGIN IMMEDIATE is the lock. The caller commits;
    leaving the block without commit rolls back.
    """
    conn = store.connect(server)
    try:
        with translated(server):
            if conn.dialect.name != "postgresql":
                started = time.monotonic()
                conn.begin()
                yield conn, started
                return
            key = lock_key_sql(area, gdid)
            deadline = time.monotonic() + lock_wait
            delay = 0.002
            while True:
                conn.begin()
                started = time.monotonic()
                if conn.exec_driver_sql(f"SELECT pg_try_advisory_xact_lock({key})").scalar_one():
                    break
                conn.rollback()
                if time.monotonic() + delay >= deadline:
                    conn.begin()
                    started = time.monotonic()
                    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, int(max_pause * 1000))}ms'")
                    try:
                        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({key})")
                    except OperationalError as exc:
                        raise MoveAbortedError(
                            f"briefcase {area}/{gdid}: could not take its write lock on {server!r} within "
                            f"{lock_wait:.1f}s + {max_pause:.1f}s (sessions kept it busy): {dberrors.describe(exc)}"
                        ) from None
                    conn.exec_driver_sql("SET LOCAL lock_timeout = 0")
                    break
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
            yield conn, started
    finally:
        if conn.in_transaction():
            conn.rollback()
        conn.close()


def check_target_schema(conn: Connection, target: str, tables: list[AreaTable], what: str) -> None:
    """``target`` (either side of a move) has the area's tables and mdb's shard tables as the models say.

    Any difference (:mod:`mdb.schema_diff`) refuses the move before anything is written: a copy
    between tables that differ fails half-way on a column one side lacks, or loses one.
    """
    shard_md, _ = load_system_tables()
    differences = compare_tables(conn, [at.table for at in tables] + list(shard_md.sorted_tables))
    if differences:
        raise SchemaError(
            f"{what}: the tables on {target!r} differ from the models ({len(differences)} difference(s): "
            f"{format_differences(differences)}); nothing moved (run `mdb schema check MAP`)"
        )


def check_schemas(store: Any, servers: Iterable[str], tables: list[AreaTable], what: str) -> None:
    """:func:`check_target_schema` on each server, once, before anything reads the briefcase's rows.

    Measuring a briefcase selects the models' columns, so on a drifted table it fails with the
    driver's "no such column" on whichever table the statement names first; compared first,
    the refusal lists every difference, like a reshard's prechecks.
    """
    for server in dict.fromkeys(servers):
        with store.transaction(server) as conn:
            check_target_schema(conn, server, tables, what)


def precheck(store: Any, area: str, gdid: GDID, source: str, target: str, tables: list[AreaTable], move_id: str) -> dict[str, Any] | None:
    """Refuse, with the reason, a move that cannot be done safely; returns the target's old state row.

    The old state row (a fence left by an earlier move away) is restored if this move is rolled back.
    """
    what = f"move of {area}/{gdid} from {source!r} to {target!r}"
    if target not in store.map.servers:
        raise RoutingError(f"{what}: unknown server {target!r} (known: {', '.join(store.map.servers)})")
    with store.transaction(target) as conn:
        check_target_schema(conn, target, tables, what)
        state = _state(conn, area, gdid)
        if state is not None and state["state"] != STATE_GONE:
            if state["state"] == STATE_INCOMING:
                raise MdbError(f"{what}: move {state['move_id']!r} into {target!r} is unfinished (run `mdb moves resume MAP`)")
            raise MdbError(f"{what}: server {target!r} already records the briefcase as {state['state']!r}")
        for name, (n, _) in measure(conn, tables, gdid, with_bytes=False).items():
            if n:
                raise MdbError(f"{what}: server {target!r} already holds {n} row(s) of the briefcase in {name!r}; nothing moved")
    with store.transaction(source, readonly=False) as conn:
        check_target_schema(conn, source, tables, what)
        src_state = _state(conn, area, gdid)
        if src_state is not None and src_state["state"] in (STATE_GONE, STATE_INCOMING):
            raise MdbError(f"{what}: the source records the briefcase as {src_state['state']!r}; run `mdb where` / `mdb moves resume`")
        if not _root_exists(conn, tables, gdid):
            raise MdbError(f"{what}: server {source!r} does not hold the briefcase (no root row)")
    return state


def discard_target(store: Any, target: str, area: str, gdid: GDID, tables: list[AreaTable], move_id: str, previous: dict[str, Any] | None) -> int:
    """Delete this move's copy on the target and restore the state row it replaced; idempotent."""
    with store.transaction(target) as conn:
        state = _state(conn, area, gdid)
        if state is None or state["state"] != STATE_INCOMING or state["move_id"] != move_id:
            return 0  # the copy was never committed (copy and incoming row commit together)
        deleted = delete_briefcase(conn, tables, gdid)
        conn.execute(delete(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == gdid))
        if previous is not None:
            conn.execute(insert(briefcase_state).values(
                area=area, gdid=gdid, state=previous["state"], peer=previous["peer"], move_id=previous["move_id"]
            ))
        return deleted


def finalize(store: Any, journal: Journal, entry: JournalEntry) -> None:
    """After the commit point: relocation directory, then the target's state row, then 'done'. Idempotent."""
    assert entry.gdid is not None and entry.target is not None
    area, gdid, target = entry.area, entry.gdid, entry.target
    router = store.router
    default = router.default_placement(area, gdid).server
    central = router.locate_central(gdid).server
    journal.step(entry.move_id, "relocation")
    with store.transaction(central) as conn:
        if target == default:
            clear_relocation(conn, area, gdid)
        else:
            set_relocation(conn, area, gdid, target)
    fault_point("move.after_relocation")
    journal.step(entry.move_id, "target_state")
    with store.transaction(target) as conn:
        state = _state(conn, area, gdid)
        if state is not None and state["state"] == STATE_INCOMING and state["move_id"] == entry.move_id:
            if target == default:
                conn.execute(delete(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == gdid))
            else:
                _set_state(conn, area, gdid, STATE_RESIDENT, entry.source, entry.move_id)
    fault_point("move.after_target_state")
    journal.finish(entry.move_id, DONE, briefcases_done=1)


def _resync(src: Connection, dst: Connection, tables: list[AreaTable], gdid: GDID, method: verify.Method) -> dict[str, int]:
    """Bring a pre-copied target up to date: only rows that differ are deleted and copied again.

    Python method: every row's digest from both sides. SQL method: see :func:`_resync_sql`.
    """
    diffs = []
    for at in tables:
        only_src, only_dst, different = verify.differing_keys(
            verify.row_digests(src, at, gdid, method), verify.row_digests(dst, at, gdid, method)
        )
        diffs.append((at, only_src + different, only_dst + different))
    return _apply_diffs(src, dst, gdid, diffs)


def _apply_diffs(
    src: Connection, dst: Connection, gdid: GDID, diffs: list[tuple[AreaTable, list[tuple[Any, ...]], list[tuple[Any, ...]]]],
) -> dict[str, int]:
    """(table, keys to copy, keys to delete), parents first: deletes children first, then copies parents first."""
    changed = {at.name: 0 for at, _, _ in diffs}
    for at, add, remove in diffs:
        changed[at.name] += len(set(add) | set(remove))
    for at, _, remove in reversed(diffs):
        delete_keys(dst, at, gdid, remove)
    for at, add, _ in diffs:
        select_keys(src, dst, at, gdid, add)
    return changed


RESYNC_BLOCK = 20_000
"""A re-sync compares key ranges of about this many rows (at most 64 per table) before rows.

Smaller ranges narrow down where rows changed but cost more: each range is an index scan and
an aggregate of its own (measured: 5,000-row ranges make summing 200k rows 1.7x slower).
"""


def _resync_blocks(src: Connection, tables: list[AreaTable], gdid: GDID, rows: dict[str, int]) -> list[verify.Part]:
    """Key ranges of about RESYNC_BLOCK rows (at most 64 per table) for a re-sync, bounds read on ``src``."""
    parts: list[verify.Part] = []
    for at in tables:
        block = max(RESYNC_BLOCK, -(-rows.get(at.name, 0) // 64))
        parts += verify.plan_parts(src, [at], gdid, rows, 1, block=block)
    return parts


def _resync_sql(
    src: Connection, dst: Connection, gdid: GDID, parts: list[verify.Part], target_sums: list[verify.TableSum],
) -> tuple[dict[str, int], list[verify.TableSum]]:
    """Re-sync between PostgreSQL servers, by key ranges: (changed rows per table, source sums of ``parts``).

    ``target_sums`` are the target's sums of ``parts`` taken right after the pre-copy committed
    (outside the lock: nothing changes a copy behind an ``incoming`` row). Under the lock only
    the source is summed again, and row digests are fetched only of the ranges that differ:
    the work under the lock follows what changed since the pre-copy, not the briefcase's size.
    Were the target changed all the same, the verification after the re-sync (which sums the
    target again) would catch it. The source sums, taken under the lock before anything is
    copied, are the source side of that verification.
    """
    src_sums = verify.part_sums(src, parts, gdid)
    order = list(dict.fromkeys(part.table.name for part in parts))
    diffs: dict[str, tuple[AreaTable, list[tuple[Any, ...]], list[tuple[Any, ...]]]] = {}
    for part in parts:
        diffs.setdefault(part.table.name, (part.table, [], []))
    for part, mine, theirs in zip(parts, src_sums, target_sums, strict=True):
        if mine != theirs:
            at, add, remove = diffs[part.table.name]
            only_src, only_dst, different = verify.differing_keys(
                verify.row_digests(src, at, gdid, "sql", part), verify.row_digests(dst, at, gdid, "sql", part)
            )
            add += only_src + different
            remove += only_dst + different
    return _apply_diffs(src, dst, gdid, [diffs[name] for name in order]), src_sums


def _table_sums_on(store: Any, server: str, tables: list[AreaTable], gdid: GDID, method: verify.Method) -> dict[str, verify.TableSum]:
    """Checksums of the briefcase on ``server``'s primary, in a read transaction of their own."""
    with store.transaction(server) as conn:
        return verify.table_sums(conn, tables, gdid, method)


SourceSide = tuple[list[verify.Part], list[verify.TableSum], dict[str, int]]


def _bound_statements(conn: Connection, deadline: float) -> None:
    """PostgreSQL: cancel any later statement of this transaction that runs past ``deadline``
    (``time.monotonic()``) with ``statement_timeout``, set to the time left.

    This is what makes ``--max-pause`` bound the pause instead of only refusing, at the
    commit point, a cutover that already took too long: every statement run under the lock
    (copy, checksums on their own connections, fence and delete) is given the time left when
    its phase starts, and a cancelled one aborts the move (source authoritative). SQLite has
    no statement timeout; there the checks between phases and at the commit point remain.
    """
    if conn.dialect.name == "postgresql":
        left_ms = min(max(1, int((deadline - time.monotonic()) * 1000)), 2**31 - 1)  # the setting is an int4 of ms
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {left_ms}")


def _cancelled(exc: BaseException) -> bool:
    """Was this a statement PostgreSQL cancelled (``statement_timeout``, or an operator's cancel)?"""
    return isinstance(getattr(exc, "orig", exc), pg_errors.QueryCanceled)


def _source_side(store: Any, source: str, tables: list[AreaTable], gdid: GDID, deadline: float, *, checksums: bool = True) -> SourceSide:
    """The locked source's checksum parts, their sums and the bytes per table (SQL method).

    On a connection of its own, beside the copy. Large tables are cut into VERIFY_WAYS key
    ranges so that the target can sum them on as many connections at once. Without
    ``checksums`` only the bytes (a re-sync has taken the source's sums already).
    """
    with store.transaction(source) as conn:
        _bound_statements(conn, deadline)
        sizes = measure(conn, tables, gdid)
        nbytes = {name: b for name, (_, b) in sizes.items()}
        if not checksums:
            return [], [], nbytes
        parts = verify.plan_parts(conn, tables, gdid, {name: rows for name, (rows, _) in sizes.items()}, VERIFY_WAYS)
        return parts, verify.part_sums(conn, parts, gdid), nbytes


def _part_sums_on(store: Any, server: str, parts: list[verify.Part], gdid: GDID, deadline: float | None = None) -> list[verify.TableSum]:
    with store.transaction(server) as conn:
        if deadline is not None:
            _bound_statements(conn, deadline)
        return verify.part_sums(conn, parts, gdid)


def _mismatches(
    store: Any, src: Connection, target: str, tables: list[AreaTable], gdid: GDID, method: verify.Method,
    bad: list[str], src_sums: dict[str, verify.TableSum], dst_sums: dict[str, verify.TableSum],
) -> list[str]:
    """Every differing key of every table whose checksums differ (for the abort message)."""
    out: list[str] = []
    with store.transaction(target) as dst:
        for name in bad:
            at = next(t for t in tables if t.name == name)
            only_src, only_dst, different = verify.differing_keys(
                verify.row_digests(src, at, gdid, method), verify.row_digests(dst, at, gdid, method)
            )
            src_rows = src_sums[name].rows if name in src_sums else 0
            dst_rows = dst_sums[name].rows if name in dst_sums else 0
            out.append(
                f"{name}: source {src_rows} rows, target {dst_rows} rows; "
                f"missing on target: {[verify.describe_key(k) for k in only_src]}; "
                f"extra on target: {[verify.describe_key(k) for k in only_dst]}; "
                f"different: {[verify.describe_key(k) for k in different]}"
            )
    return out


# -- the move ------------------------------------------------------------------------------------


def check_max_pause(max_pause: float) -> None:
    """A negative bound is a typo, not "no pause allowed" (that is 0: every cutover aborts)."""
    if not max_pause >= 0:  # also refuses NaN
        raise MdbError(f"max pause must be at least 0 seconds, got {max_pause!r}")


def _refuse_if_busy(store: Any, journal: Journal, area: str, gdid: GDID) -> None:
    """Refuse a move of a briefcase that an unfinished move or reshard may still touch.

    An interrupted move leaves a copy on its target and a journal row that resume acts on; a
    second move started beside it would leave resume reasoning about the wrong source. A
    reshard plans its partition's briefcases up front; a move of one of them would race it.
    """
    partition = store.router.default_placement(area, gdid).partition_start
    busy = [
        f"{e.move_id}: {describe_liveness(journal, e)}" for e in journal.entries(unfinished=True)
        if e.area == area and (e.gdid == gdid or (e.kind == "reshard" and e.params.get("partition_start") == str(partition)))
    ]
    if busy:
        raise MdbError(
            f"briefcase {area}/{gdid} has unfinished moves or a reshard of its partition ({', '.join(busy)}): "
            "let a running one finish, or run `mdb moves resume MAP` for an interrupted one"
        )


def move_briefcase(
    store: Any,
    area: str,
    gdid: GDID,
    target: str,
    *,
    max_pause: float = DEFAULT_MAX_PAUSE,
    lock_wait: float = DEFAULT_LOCK_WAIT,
    dry_run: bool = False,
    reshard_id: str | None = None,
    precopy_rows: int = PRECOPY_ROWS,
    journal: Journal | None = None,
    on_table: Callable[[str, int], None] | None = None,
    on_sizes: Callable[[dict[str, tuple[int, int]]], None] | None = None,
    refresh: bool = True,
    source: str | None = None,
    reverse_of: str | None = None,
) -> MoveResult:
    """Move one briefcase (every table of every type of ``area``) to server ``target``, online.

    Raises :class:`MoveAbortedError` (source still authoritative, target copy removed) when
    verification fails or the pause would exceed ``max_pause``. ``reverse_of`` names the move of
    a cancelled reshard this one undoes (journaled, so it is not counted as the reshard's progress).
    ``on_sizes`` gets the briefcase's rows per table once the schemas compared equal, before it
    moves (the CLI sizes its progress bar with it instead of measuring a drifted table itself).
    """
    check_max_pause(max_pause)
    if refresh:
        store.refresh()
    tables = area_tables(store, area)
    if source is None:  # a reshard passes the source it found the briefcase on; precheck confirms it
        source = store.router.locate(area, gdid).server
    if source == target:
        return MoveResult(None, area, gdid, source, target, "already-there")
    store.engines.spec(target)  # unknown server -> RoutingError naming the known ones
    journal = journal or Journal(store)
    if reshard_id is None:
        _refuse_if_busy(store, journal, area, gdid)
        # A reshard compared every source and target before its first move (its prechecks).
        check_schemas(store, [target, source], tables, f"move of {area}/{gdid} from {source!r} to {target!r}")
    with store.transaction(source) as conn:
        sizes = measure(conn, tables, gdid, with_bytes=dry_run)  # a move measures bytes under the lock
    if on_sizes is not None:
        on_sizes(sizes)
    if dry_run:
        precheck(store, area, gdid, source, target, tables, "dry-run")
        return MoveResult(None, area, gdid, source, target, "dry-run", sizes)
    move_id = new_move_id("move")
    total = sum(r for r, _ in sizes.values())
    journal.start(JournalEntry(
        move_id=move_id, kind="move", area=area, step="precheck", status=RUNNING, gdid=gdid, source=source,
        target=target, reshard_id=reshard_id, params={"max_pause": max_pause, "reverse_of": reverse_of},
        tables={name: [rows, 0] for name, (rows, _) in sizes.items()}, briefcases_total=1, rows_total=total,
    ))
    fault_point("move.after_journal_start")
    # A single move is driven under its own lease (a reshard's moves under the reshard's), so
    # a resume started beside it leaves it alone and `mdb moves status` names its process.
    with hold(journal, move_id) if reshard_id is None else nullcontext():
        try:
            previous = precheck(store, area, gdid, source, target, tables, move_id)
        except MdbError as exc:
            journal.finish(move_id, ABORTED, f"precheck: {exc}")
            raise
        params = {"max_pause": max_pause, "reverse_of": reverse_of, "previous_target_state": None if previous is None else {
            "state": previous["state"], "peer": previous["peer"], "move_id": previous["move_id"]}}
        fault_point("move.after_precheck")
        precopied = total >= precopy_rows
        precopy_sums: tuple[list[verify.Part], list[verify.TableSum]] | None = None
        if precopied:
            journal.step(move_id, "precopy", params=params)
            with store.transaction(source) as src, store.transaction(target) as dst:
                _set_state(dst, area, gdid, STATE_INCOMING, source, move_id)
                copy_rows(src, dst, tables, gdid, on_table=on_table)
                blocks = _resync_blocks(src, tables, gdid, {name: r for name, (r, _) in sizes.items()}) \
                    if verify.method_for(src, dst) == "sql" else None
            fault_point("move.after_precopy")
            if blocks is not None:  # the committed pre-copy, kept still by its 'incoming' row
                precopy_sums = (blocks, _part_sums_on(store, target, blocks, gdid))
            journal.step(move_id, "lock")
        else:
            journal.step(move_id, "lock", params=params)

        def abort(reason: str, mismatches: list[str] | None = None) -> MoveAbortedError:
            discard_target(store, target, area, gdid, tables, move_id, previous)
            detail = reason if not mismatches else reason + ": " + "; ".join(mismatches)
            journal.finish(move_id, ABORTED, detail)
            telemetry.move_aborted(area, reshard_id)
            return MoveAbortedError(f"move {move_id} of {area}/{gdid} aborted, {source!r} is still authoritative: {detail}", move_id, mismatches)

        try:
            with locked_source(store, source, area, gdid, lock_wait=lock_wait, max_pause=max_pause) as (src, locked_at), \
                    ThreadPoolExecutor(max_workers=VERIFY_WAYS, thread_name_prefix="mdb-move-verify") as pool:
                fault_point("move.after_lock")
                deadline = locked_at + max_pause
                _bound_statements(src, deadline)
                src_state = _state(src, area, gdid)
                if (src_state is not None and src_state["state"] in (STATE_GONE, STATE_INCOMING)) or not _root_exists(src, tables, gdid):
                    raise abort("under the lock the source no longer holds the briefcase (another move?)")
                journal.step(move_id, "copy")
                src_job: Future[SourceSide] | None = None
                resynced: tuple[list[verify.Part], list[verify.TableSum]] | None = None

                def start_source_side(checksums: bool = True) -> None:
                    # From the lock on, no session can change the briefcase on the source, so its
                    # checksums (a query of their own, not the copy's stream) are computed on a
                    # second connection while the copy runs. For a large briefcase, started when
                    # the source has sent its largest table: the target is then busy for a while
                    # with that table's inserts and foreign-key checks while the source and this
                    # process are idle. SQL method only: the Python method is CPU-bound in this
                    # process, and SQLite wants one connection.
                    nonlocal src_job
                    if src_job is None and method == "sql":
                        src_job = pool.submit(_source_side, store, source, tables, gdid, deadline, checksums=checksums)

                largest = max(sizes, key=lambda name: sizes[name][0])
                with store.transaction(target) as dst:
                    _bound_statements(dst, deadline)
                    method = verify.method_for(src, dst)
                    if precopied or sizes[largest][0] < verify.SPLIT_ROWS:
                        start_source_side(checksums=precopy_sums is None)  # a re-sync by ranges sums the source
                    if precopied:
                        state = _state(dst, area, gdid)
                        if state is None or state["move_id"] != move_id:
                            raise abort("the pre-copy on the target vanished")
                        if precopy_sums is not None and method == "sql":
                            changed, src_part_sums = _resync_sql(src, dst, gdid, *precopy_sums)
                            resynced = (precopy_sums[0], src_part_sums)
                        else:
                            changed = _resync(src, dst, tables, gdid, method)
                        log.info("move %s: re-synced %d changed row(s) under the lock", move_id, sum(changed.values()))
                    else:
                        _set_state(dst, area, gdid, STATE_INCOMING, source, move_id)
                        first = [True]

                        def table_done(name: str, rows: int) -> None:
                            if first[0]:
                                first[0] = False
                                fault_point("move.during_copy")
                            if on_table is not None:
                                on_table(name, rows)

                        copy_rows(src, dst, tables, gdid, on_table=table_done,
                                  on_streamed=lambda name: start_source_side() if name == largest else None)
                        start_source_side()
                fault_point("move.after_copy_commit")
                if time.monotonic() > deadline:  # no use verifying a cutover that may not commit
                    src.rollback()
                    fault_point("move.pause_abort.after_source_rollback")
                    raise abort(f"the copy alone held the write lock {time.monotonic() - locked_at:.2f}s, over --max-pause {max_pause:.2f}s")
                journal.step(move_id, "verify")
                if src_job is None:
                    src_sums = verify.table_sums(src, tables, gdid, method)
                    nbytes = {name: b for name, (_, b) in measure(src, tables, gdid).items()}
                    dst_sums = _table_sums_on(store, target, tables, gdid, method)
                else:
                    parts, src_part_sums, nbytes = src_job.result()  # done before the copy, as a rule
                    if resynced is not None:
                        parts, src_part_sums = resynced  # taken under the lock before the re-sync copied
                    src_sums = verify.combine(parts, src_part_sums)
                    groups = verify.spread(parts, VERIFY_WAYS)
                    dst_jobs = [pool.submit(_part_sums_on, store, target, [parts[i] for i in group], gdid, deadline) for group in groups]
                # While the target computes its checksums, the locked source transaction writes the
                # fence and deletes the rows behind a savepoint: none of it is visible to anyone, and
                # it is rolled back unless verification passes (the commit below is the commit point).
                _bound_statements(src, deadline)  # the time left, for the fence and the delete
                cut = src.begin_nested()
                _set_state(src, area, gdid, STATE_GONE, target, move_id)
                deleted = delete_rows(src, tables, gdid)
                if src_job is not None:
                    dst_part_sums: dict[int, verify.TableSum] = {}
                    for group, job in zip(groups, dst_jobs, strict=True):
                        dst_part_sums.update(zip(group, job.result(), strict=True))
                    dst_sums = verify.combine(parts, [dst_part_sums[i] for i in range(len(parts))])
                bad = verify.compare(src_sums, dst_sums)
                # The delete must remove exactly the rows that were verified; anything else means
                # something wrote to the briefcase past its lock, and deleting would lose that write.
                wrong = [f"{name}: the commit point would delete {n} row(s), {src_sums[name].rows if name in src_sums else 'none'} were verified"
                         for name, n in deleted.items() if name not in src_sums or n != src_sums[name].rows]
                wrong += [f"{at.name}: not verified on the target" for at in tables if at.name not in dst_sums]
                if bad or wrong:
                    cut.rollback()  # the source rows are back (still under the lock) for the report
                    if src.dialect.name == "postgresql":
                        src.exec_driver_sql("SET LOCAL statement_timeout = 0")  # the report may take its time
                    telemetry.move_verification_failed(area)
                    raise abort("verification failed", _mismatches(store, src, target, tables, gdid, method, bad, src_sums, dst_sums) + wrong)
                fault_point("move.after_verify")
                held = time.monotonic() - locked_at
                if held > max_pause:
                    src.rollback()
                    fault_point("move.pause_abort.after_source_rollback")
                    raise abort(f"the write lock was held {held:.2f}s, over --max-pause {max_pause:.2f}s")
                moved = {name: s.rows for name, s in src_sums.items()}
                journal.step(move_id, "commit_point", tables={n: [r, r] for n, r in moved.items()}, rows_done=sum(moved.values()))
                cut.commit()
                fault_point("move.before_commit_point")
                src.commit()
                pause = time.monotonic() - locked_at
        except MoveAbortedError:
            raise
        except BaseException as exc:
            if _cancelled(exc):
                # A statement under the lock ran past --max-pause (or an operator cancelled it): the
                # source transaction was rolled back when the lock was let go, so abort like any
                # cutover over its pause (the committed target copy, if any, is discarded).
                fault_point("move.pause_abort.after_source_rollback")
                raise abort(f"a statement under the write lock was cancelled at --max-pause {max_pause:.2f}s ({dberrors.describe(exc)})") from None
            # Anything else (a server going away, a bug): the source transaction was rolled back by
            # locked_source, so the source is authoritative; resume discards the target copy. The
            # error itself propagates (the CLI prints it; a bug keeps its traceback there), so this
            # line only adds what to do next.
            log.error("move %s of %s/%s failed before its commit point (%s: %s); the source is authoritative, "
                      "run `mdb moves resume` to discard the partial copy", move_id, area, gdid, type(exc).__name__, mask_secrets(str(exc)))
            raise
        fault_point("move.after_commit_point")
        entry = journal.get(move_id)
        assert entry is not None
        finalize(store, journal, entry)
        if refresh:
            store.refresh()
        telemetry.move_done(area, reshard_id, sum(moved.values()), pause)
        return MoveResult(move_id, area, gdid, source, target, DONE, {n: (r, nbytes.get(n, 0)) for n, r in moved.items()}, pause, precopied)
