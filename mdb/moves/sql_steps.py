"""The SQL side of a briefcase's move state: its tables, its lock, its state rows, prechecks.

Shared by the batch engine (:mod:`mdb.moves.batch`, a single move's too), :mod:`mdb.moves.cutover`
(finalize, discard, resume), reshard, status and the fleet tools
(fsck takes :func:`locked_source` to read a briefcase still). The state row of a briefcase on
a shard (``mdb_briefcase_state``: ``incoming`` copy, ``resident`` away from home, ``gone``
fence) is what a move's steps write and what resume reads to decide.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from psycopg import errors as pg_errors
from sqlalchemy.exc import OperationalError

from mdb import dberrors
from mdb.backoff import BackoffPolicy
from mdb.cluster import Cluster
from mdb.dberrors import translated
from mdb.errors import BriefcaseGoneError, MdbError, MoveAbortedError, RoutingError, SchemaError
from mdb.gdid import GDID
from mdb.moves.collector import collection_deferred
from mdb.moves.copy import AreaTable, measure
from mdb.moves.fencing import fence_check
from mdb.migrations.revisions import current_revision, lock_out_migrations, require_one_revision
from mdb.ownership import lock_keys_sql
from mdb.schema_diff import compare_tables, format_differences
from mdb.system_tables import STATE_GONE, STATE_INCOMING, briefcase_state, load_system_tables

__all__ = [
    "area_tables",
    "bound_statements",
    "check_schemas",
    "check_target_schema",
    "locked_briefcases",
    "locked_source",
    "precheck",
    "root_exists",
    "set_state",
    "set_states",
    "state_row",
    "states",
    "statement_cancelled",
    "time_left_ms",
]

def area_tables(store: Cluster, area: str) -> list[AreaTable]:
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


def states(conn: Connection, area: str, gdids: Sequence[GDID]) -> dict[GDID, dict[str, Any]]:
    """The state rows of ``gdids`` on this server (briefcases without one are absent): one statement."""
    rows = conn.execute(
        select(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid.in_(list(gdids)))
    ).mappings()
    return {r["gdid"]: dict(r) for r in rows}


def state_row(conn: Connection, area: str, gdid: GDID) -> dict[str, Any] | None:
    return states(conn, area, [gdid]).get(gdid)


def set_states(conn: Connection, area: str, gdids: Sequence[GDID], state: str, peer: str | None, move_id: str | None) -> None:
    """Every briefcase's state row on this server, replacing any it had: one upsert statement."""
    upsert = (pg_insert if conn.dialect.name == "postgresql" else sqlite_insert)(briefcase_state)
    conn.execute(
        upsert.on_conflict_do_update(
            index_elements=[briefcase_state.c.area, briefcase_state.c.gdid],
            set_={"state": upsert.excluded.state, "peer": upsert.excluded.peer, "move_id": upsert.excluded.move_id,
                  "changed_at": func.current_timestamp()},
        ),
        [{"area": area, "gdid": g, "state": state, "peer": peer, "move_id": move_id} for g in gdids],
    )


def set_state(conn: Connection, area: str, gdid: GDID, state: str, peer: str | None, move_id: str | None) -> None:
    set_states(conn, area, [gdid], state, peer, move_id)


def root_exists(conn: Connection, tables: list[AreaTable], gdid: GDID) -> bool:
    roots = [at for at in tables if at.pk == [at.key]]
    return any(
        conn.execute(select(func.count()).select_from(at.table).where(at.table.c[at.key] == gdid)).scalar_one()
        for at in roots
    )


@contextmanager
def locked_source(store: Cluster, server: str, area: str, gdid: GDID, *, lock_wait: float, max_pause: float) -> Iterator[tuple[Connection, float]]:
    """A source transaction holding the briefcase's exclusive lock and the schema lock shared; yields (conn, lock start).

    :func:`locked_briefcases` for one briefcase, with migrations locked out for the transaction.
    """
    with locked_briefcases(store, server, area, [gdid], lock_wait=lock_wait, max_pause=max_pause) as (conn, started):
        lock_out_migrations(conn, server)  # no migration changes the tables while they are copied
        yield conn, started


LOCK_POLL = BackoffPolicy(first=0.002, cap=0.05)
"""How a move polls for its briefcases' locks before its one blocking attempt."""


@contextmanager
def locked_briefcases(
    store: Cluster, server: str, area: str, gdids: Sequence[GDID], *, lock_wait: float, max_pause: float,
) -> Iterator[tuple[Connection, float]]:
    """A source transaction holding every briefcase's exclusive lock; yields (conn, lock start time).

    PostgreSQL: ``pg_try_advisory_xact_lock`` on every key in one statement, polled for
    ``lock_wait`` seconds (no queue forms, so sessions are not held up while we wait for a gap;
    a failed try lets go of the keys it got, they are transaction locks), then one blocking
    attempt bounded by ``max_pause`` via ``lock_timeout``, the keys in GDID order. SQLite:
    BEGIN IMMEDIATE is the lock. The caller commits; leaving the block without commit rolls back.
    While the locks are held, Python's garbage collector waits (:mod:`mdb.moves.collector`).
    """
    conn = store.connect(server)
    try:
        with translated(server):
            if conn.dialect.name != "postgresql":
                with collection_deferred():
                    conn.begin()
                    fence_check(store, conn, server)
                    started = time.monotonic()
                    yield conn, started
                return
            keys = lock_keys_sql(area, gdids)
            backoff = LOCK_POLL.within(lock_wait)
            with ExitStack() as deferred:  # from each attempt that may take the locks on
                while True:
                    conn.begin()
                    fence_check(store, conn, server)  # a driver paused past its lease stops here (mdb.moves.fencing)
                    deferred.enter_context(collection_deferred())
                    started = time.monotonic()
                    if conn.exec_driver_sql(f"SELECT bool_and(pg_try_advisory_xact_lock(k)) FROM unnest({keys}) AS k").scalar_one():
                        break
                    conn.rollback()
                    deferred.close()
                    delay = backoff.next_delay()
                    if delay is None:
                        conn.begin()
                        fence_check(store, conn, server)
                        deferred.enter_context(collection_deferred())
                        started = time.monotonic()
                        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, int(max_pause * 1000))}ms'")
                        try:
                            conn.exec_driver_sql(f"SELECT count(pg_advisory_xact_lock(k)) FROM unnest({keys}) AS k")
                        except OperationalError as exc:
                            what = f"briefcase {area}/{gdids[0]}" if len(gdids) == 1 else f"{len(gdids)} briefcases of {area!r}"
                            raise MoveAbortedError(
                                f"{what}: could not take the write lock on {server!r} within "
                                f"{lock_wait:.1f}s + {max_pause:.1f}s (sessions kept it busy): {dberrors.describe(exc)}"
                            ) from None
                        conn.exec_driver_sql("SET LOCAL lock_timeout = 0")
                        break
                    time.sleep(delay)
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


def check_schemas(store: Cluster, area: str, servers: Iterable[str], tables: list[AreaTable], what: str) -> None:
    """Every server a move or reshard touches is at one migration revision of ``area`` and matches the models.

    Checked once per server, before anything reads the briefcase's rows. Revisions first
    (:func:`mdb.migrations.revisions.require_one_revision`): between servers at different
    revisions the refusal names the revisions and ``mdb migrate up``, not the columns that
    differ. Then the tables: measuring a briefcase selects the models' columns, so on a
    drifted table it fails with the driver's "no such column" on whichever table the statement
    names first; compared first, the refusal lists every difference.
    """
    servers = list(dict.fromkeys(servers))
    revisions: dict[str, str | None] = {}
    for server in servers:
        with store.transaction(server) as conn:
            revisions[server] = current_revision(conn, area)
    require_one_revision(area, revisions)
    for server in servers:
        with store.transaction(server) as conn:
            check_target_schema(conn, server, tables, what)


def precheck(store: Cluster, area: str, gdid: GDID, source: str, target: str, tables: list[AreaTable]) -> dict[str, Any] | None:
    """Refuse, with the reason, a single move that cannot be done safely; returns the target's old state row.

    Worded for the move (the batch's own precheck only says a briefcase cannot be batched). The
    schemas were compared by :func:`mdb.moves.batch.hold_schemas`. The old state row (a fence
    left by an earlier move away) is restored if the move is rolled back.
    """
    what = f"move of {area}/{gdid} from {source!r} to {target!r}"
    if target not in store.map.servers:
        raise RoutingError(f"{what}: unknown server {target!r} (known: {', '.join(store.map.servers)})")
    with store.transaction(target) as conn:
        state = state_row(conn, area, gdid)
        if state is not None and state["state"] != STATE_GONE:
            if state["state"] == STATE_INCOMING:
                raise MdbError(f"{what}: move {state['move_id']!r} into {target!r} is unfinished (run `mdb moves resume MAP`)")
            raise MdbError(f"{what}: server {target!r} already records the briefcase as {state['state']!r}")
        for name, (n, _) in measure(conn, tables, gdid, with_bytes=False).items():
            if n:
                raise MdbError(f"{what}: server {target!r} already holds {n} row(s) of the briefcase in {name!r}; nothing moved")
    with store.transaction(source, readonly=False) as conn:
        src_state = state_row(conn, area, gdid)
        if src_state is not None and src_state["state"] in (STATE_GONE, STATE_INCOMING):
            raise MdbError(f"{what}: the source records the briefcase as {src_state['state']!r}; run `mdb where` / `mdb moves resume`")
        if not root_exists(conn, tables, gdid):
            raise BriefcaseGoneError(f"{what}: server {source!r} does not hold the briefcase (no root row: deleted?)")
    return state


def bound_statements(conn: Connection, deadline: float, also: str = "") -> None:
    """PostgreSQL: cancel any later statement of this transaction that runs past ``deadline``
    (``time.monotonic()``) with ``statement_timeout``, set to the time left.

    This is what makes ``--max-pause`` bound the pause instead of only refusing, at the
    commit point, a cutover that already took too long: every statement run under the lock
    (copy, checksums on their own connections, fence and delete) is given the time left when
    its phase starts, and a cancelled one aborts the move (source authoritative). SQLite has
    no statement timeout; there the checks between phases and at the commit point remain.
    ``also``: more ``SET LOCAL`` statements sent in the same round trip.
    """
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {time_left_ms(deadline)}" + (f"; {also}" if also else ""))


def time_left_ms(deadline: float) -> int:
    """Milliseconds until ``deadline`` (``time.monotonic()``) as a ``statement_timeout``: at least 1 (0 would mean none), at most an int4."""
    return min(max(1, int((deadline - time.monotonic()) * 1000)), 2**31 - 1)


def statement_cancelled(exc: BaseException) -> bool:
    """Was this a statement PostgreSQL cancelled (``statement_timeout``, or an operator's cancel)?"""
    return isinstance(getattr(exc, "orig", exc), pg_errors.QueryCanceled)
