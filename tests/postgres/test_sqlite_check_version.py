"""SQLite's kept check rows: the ownership check read again only when the shard's check version changed.

Triggers change ``mdb_check_version``'s token with every change to the tables the check reads;
a session reads the token in its own transaction and takes the rows kept for it
(:func:`mdb.ownership.install_sqlite_check_version`, docs/briefcases.md "What a session costs").
These tests pin what makes that safe: every kind of write changes the token, whoever writes;
kept rows always equal what the check reads now; a move by another process is seen at the next
session; a database without the version (or missing one trigger) runs the whole check.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, event, select
from support.stale import (  # noqa: F401  (the fixture)
    Cluster, count_refusals, create_user, move_by_hand, stale_sqlite_cluster,
)

import mdb.ownership
from mdb.demo.models import User, UserBriefcase
from mdb.engines import set_prelude, take_result
from mdb.gdid import GDID
from mdb.errors import StaleRouteError
from mdb.ownership import FREEZE_GDID, OwnershipCheck, check_ownership, install_sqlite_check_version, ownership_prelude
from mdb.schema import apply_schema, check_schema
from mdb.store import Store
from mdb.system_tables import CHECK_VERSION_TABLE

CHECK_TEXT = "FROM (SELECT 1 AS one) AS x"
"""A fragment of the whole check's text (both kinds), to count its runs in a trace."""


def _path(cluster: Cluster, server: str) -> str:
    return cluster.urls[server].removeprefix("sqlite:///")


@contextmanager
def _outside(cluster: Cluster, server: str) -> Iterator[sqlite3.Connection]:
    """A connection of another program (plain sqlite3, autocommit): writes that no mdb code makes."""
    with closing(sqlite3.connect(_path(cluster, server), isolation_level=None)) as conn:
        yield conn


def _token(conn: sqlite3.Connection) -> int:
    (token,) = conn.execute(f"SELECT token FROM {CHECK_VERSION_TABLE}").fetchone()
    return int(token)


def _traced(engine: Engine) -> list[str]:
    """Every statement sqlite3 runs on ``engine``'s connections from now on (preludes included,
    which bypass SQLAlchemy's events)."""
    statements: list[str] = []

    def trace(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
        dbapi_connection.set_trace_callback(statements.append)

    event.listen(engine, "checkout", trace)
    return statements


def _checks(statements: list[str]) -> int:
    return sum(CHECK_TEXT in s for s in statements)


def _read(store: Store, gdid: GDID) -> str:
    with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
        assert session.scalars(select(User.user_id)).all() == [gdid]
        return session.placement.server


STATE = "INSERT INTO mdb_briefcase_state (area, gdid, state, peer, move_id) VALUES ('user', ?, ?, NULL, 'm')"
WRITES = [
    ("a state row inserted", STATE, (bytes(GDID(0, 0, 2)), "incoming")),
    ("updated", "UPDATE mdb_briefcase_state SET state = 'gone', peer = 'u2'", ()),
    ("replaced (INSERT OR REPLACE)", STATE.replace("INSERT", "INSERT OR REPLACE"), (bytes(GDID(0, 0, 2)), "resident")),
    ("upserted", STATE + " ON CONFLICT (area, gdid) DO UPDATE SET state = excluded.state", (bytes(GDID(0, 0, 2)), "gone")),
    ("deleted by key", "DELETE FROM mdb_briefcase_state WHERE gdid = ?", (bytes(GDID(0, 0, 2)),)),
    ("a freeze marker inserted", STATE.replace("NULL", "'0:0:0'"), (bytes(FREEZE_GDID), "frozen")),
    ("every state row deleted (no WHERE)", "DELETE FROM mdb_briefcase_state", ()),
    ("the layout restamped", "UPDATE mdb_shard_layout SET shard_count = 3 WHERE area = 'user'", ()),
    ("a layout row inserted", "INSERT INTO mdb_shard_layout (area, partition_start, shard_index, shard_count, map_version) "
     "SELECT 'other', partition_start, 0, 1, 1 FROM mdb_shard_layout WHERE area = 'user'", ()),
    ("a layout row deleted", "DELETE FROM mdb_shard_layout WHERE area = 'other'", ()),
]


def test_every_change_to_the_tables_the_check_reads_changes_the_token(stale_sqlite_cluster: Cluster) -> None:
    with _outside(stale_sqlite_cluster, "u1") as conn:
        for what, sql, params in WRITES:
            before = _token(conn)
            assert conn.execute(sql, params).rowcount > 0, what
            assert _token(conn) != before, what
        # Other tables, and a change that is rolled back, leave it as it was.
        before = _token(conn)
        conn.execute("INSERT INTO users (user_id, email, name, created_at) VALUES (?, 'a@b', 'a', '2026-01-01')",
                     (bytes(GDID(0, 0, 4)),))
        conn.execute("BEGIN")
        conn.execute(STATE, (bytes(GDID(0, 0, 6)), "gone"))
        conn.execute("ROLLBACK")
        assert _token(conn) == before


def test_a_fence_written_by_another_process_is_seen_by_the_next_session(
    stale_sqlite_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale Store whose check rows were kept: the move's fence changed the token, so its next
    session reads the whole check, is refused, and is retried on the briefcase's new shard."""
    store = stale_sqlite_cluster.store()
    gdid = GDID(0, 0, 8)  # u1
    assert create_user(store, gdid) == "u1"
    statements = _traced(store.engine("u1", True))
    for _ in range(3):
        assert _read(store, gdid) == "u1"
    assert _checks(statements) == 1  # the later two took the kept rows
    mover = stale_sqlite_cluster.store()  # another process's engines and caches
    move_by_hand(mover, gdid, "u1", "u2")
    refusals = count_refusals(monkeypatch)
    assert _read(store, gdid) == "u2"
    assert refusals == ["u1"] and _checks(statements) == 2


def test_a_database_without_the_whole_version_runs_the_whole_check(stale_sqlite_cluster: Cluster) -> None:
    """One trigger missing (dropped by hand, or a shard that ``mdb schema apply`` has not seen since
    an upgrade): a token that a fence does not change must not be trusted, so nothing is kept."""
    with _outside(stale_sqlite_cluster, "u1") as conn:
        conn.execute(f"DROP TRIGGER {CHECK_VERSION_TABLE}_state_insert")
    store = stale_sqlite_cluster.store()
    gdid = GDID(0, 0, 10)
    assert create_user(store, gdid) == "u1"
    statements = _traced(store.engine("u1", True))
    for _ in range(3):
        assert _read(store, gdid) == "u1"
    assert _checks(statements) == 3
    with _outside(stale_sqlite_cluster, "u1") as conn:  # a fence the token does not see
        before = _token(conn)
        conn.execute(STATE.replace("NULL", "'u2'"), (bytes(gdid), "gone"))
        assert _token(conn) == before
    placement = store.router.locate("user", gdid)
    with store.engine("u1", True).connect() as conn:  # the check of those sessions, by hand: no retry to follow
        set_prelude(conn, OwnershipCheck(placement, lock=False))
        conn.begin()
        with pytest.raises(StaleRouteError, match="fenced, it moved to server 'u2'"):
            check_ownership(take_result(conn), placement, store.router.version, write=False)
    assert _checks(statements) == 4
    # `mdb schema apply` puts back what is missing, and only that; the version is no extra table.
    admin = stale_sqlite_cluster.store()
    with admin.transaction("u1") as conn:
        assert install_sqlite_check_version(conn) == [f"{CHECK_VERSION_TABLE}_state_insert"]
        assert install_sqlite_check_version(conn) == []
    assert all(r.ok for r in apply_schema(admin))
    assert all(r.ok and not r.differences for r in check_schema(admin)), [r.differences for r in check_schema(admin)]


def test_an_engine_keeps_a_bounded_number_of_checks(stale_sqlite_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mdb.ownership, "KEPT_CHECKS", 3)
    store = stale_sqlite_cluster.store()
    kept = store.engine("u1", True).dialect.mdb_known_rows  # type: ignore[attr-defined]
    sizes = []
    for n in range(2, 22, 2):
        gdid = GDID(0, 0, n)
        assert create_user(store, gdid) == "u1"
        assert _read(store, gdid) == "u1"
        sizes.append(len(kept))
    assert max(sizes) == 3 and min(sizes[3:]) >= 1


# -- kept rows are the rows the check reads now -----------------------------------------------

BRIEFCASES = [GDID(0, 0, n) for n in (2, 4)]  # on u1 (even) under version 1; few, so that checks repeat
_changes = st.one_of(
    st.tuples(st.just("state"), st.sampled_from(BRIEFCASES), st.sampled_from([None, "gone", "incoming", "resident"])),
    st.tuples(st.just("freeze"), st.sampled_from([None, "reshard-1", "reshard-1@2:0", "reshard-1@3:-1"])),
    st.tuples(st.just("stamp"), st.sampled_from([2, 3])),
)
_steps = st.lists(st.one_of(st.tuples(st.just("check"), st.sampled_from(BRIEFCASES), st.booleans()), _changes), max_size=25)


def _change(conn: sqlite3.Connection, step: tuple[Any, ...]) -> None:
    kind = step[0]
    if kind == "state":
        _, gdid, state = step
        conn.execute("DELETE FROM mdb_briefcase_state WHERE gdid = ?", (bytes(gdid),))
        if state is not None:
            conn.execute(STATE.replace("NULL", "'u2'"), (bytes(gdid), state))
    elif kind == "freeze":
        conn.execute("DELETE FROM mdb_briefcase_state WHERE gdid = ?", (bytes(FREEZE_GDID),))
        if step[1] is not None:
            conn.execute("INSERT INTO mdb_briefcase_state (area, gdid, state, peer, move_id) VALUES ('user', ?, 'frozen', '0:0:0', ?)",
                         (bytes(FREEZE_GDID), step[1]))
    else:
        conn.execute("UPDATE mdb_shard_layout SET shard_count = ? WHERE area = 'user'", (step[1],))


def test_kept_check_rows_are_the_rows_the_check_reads_now(stale_sqlite_cluster: Cluster) -> None:
    """Any interleaving of checks (read and write sessions) and changes made by another program:
    the rows a session's check returns are those the whole check reads in that transaction."""
    store = stale_sqlite_cluster.store()
    traces = {lock: _traced(store.engine("u1", not lock)) for lock in (False, True)}
    kept = 0

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_steps)
    @example([("check", BRIEFCASES[0], False), ("stamp", 3), ("check", BRIEFCASES[0], False)])
    @example([("check", BRIEFCASES[1], True), ("state", BRIEFCASES[1], "gone"), ("state", BRIEFCASES[1], "resident"),
              ("check", BRIEFCASES[1], True)])
    @example([("state", BRIEFCASES[0], "gone"), ("check", BRIEFCASES[0], False), ("state", BRIEFCASES[0], None),
              ("check", BRIEFCASES[0], False)])
    def run(steps: list[tuple[Any, ...]]) -> None:
        nonlocal kept
        with _outside(stale_sqlite_cluster, "u1") as outside:
            try:
                for step in steps:
                    if step[0] != "check":
                        _change(outside, step)
                        continue
                    _, gdid, lock = step
                    placement = store.router.locate("user", gdid)
                    engine = store.engine("u1", not lock)
                    statements = traces[lock]
                    statements.clear()
                    with engine.connect() as conn:
                        set_prelude(conn, OwnershipCheck(placement, lock=lock))
                        conn.begin()
                        rows = take_result(conn)
                        whole = ownership_prelude("sqlite", placement, lock)
                        assert rows == conn.exec_driver_sql(whole.statements[-1], whole.params).all()
                        kept += _checks(statements) == 1  # (the comparison above ran it once more)
                        conn.rollback()
            finally:
                outside.execute("DELETE FROM mdb_briefcase_state")
                outside.execute("UPDATE mdb_shard_layout SET shard_count = 2 WHERE area = 'user'")

    run()
    assert kept > 0  # the property was tested on kept rows, not only on checks read again


class _CutOff:
    """A prelude that stops after the first row of a read with more (what an interrupt or a failing
    row conversion leaves behind): the statement is still open on the BEGIN's cursor."""

    def begin_sqlite(self, cursor: Any, begin: str, known: Any) -> None:
        cursor.execute(begin)
        cursor.execute("SELECT area FROM mdb_shard_layout UNION ALL SELECT area FROM mdb_shard_layout")
        cursor.fetchone()
        raise KeyboardInterrupt

    def begin_postgresql(self, connection: Any, prepared: Any) -> None:
        raise AssertionError("SQLite only")

    begin_postgresql_pooled = begin_postgresql
    read_only = True


def test_a_begin_cut_off_half_way_holds_no_snapshot(stale_sqlite_cluster: Cluster) -> None:
    """Each connection keeps the cursor its BEGIN sends on. A BEGIN that fails half-way closes it:
    a read left open on it would hold its snapshot, and a checkpoint would wait for it, for as
    long as the connection sits in the pool."""
    store = stale_sqlite_cluster.store()
    gdid = GDID(0, 0, 12)
    assert create_user(store, gdid) == "u1"
    engine = store.engine("u1", True)
    with engine.connect() as conn:
        set_prelude(conn, _CutOff())  # type: ignore[arg-type]  # the protocol's SQLite part is what runs
        with pytest.raises(KeyboardInterrupt):
            conn.begin()
        with _outside(stale_sqlite_cluster, "u1") as other:
            other.execute("UPDATE mdb_shard_layout SET map_version = map_version")
            busy, _log, _done = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            assert busy == 0
    for _ in range(2):  # the pooled connection's next sessions: a new cursor, the check as before
        assert _read(store, gdid) == "u1"
