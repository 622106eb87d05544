"""Pooled connections that died with their server (a restart) cost nothing visible.

After a PostgreSQL restart every connection a Store had pooled is dead. The first use of each
used to fail ("terminating connection due to administrator command", or "server closed the
connection unexpectedly"), although nothing had run on it yet: the Store now throws such a
connection away and begins again on a fresh one, once, before any application code runs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest
from support.mapfiles import write_map
from sqlalchemy import select, text

from mdb.demo.models import User, UserBriefcase
from mdb.errors import ServerUnavailableError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.testing.postgres import PostgresServer

pytestmark = pytest.mark.postgres

POOLED = 4
"""Sessions held open at once, so the pool holds this many connections when the server restarts."""


def restarted_store(pg_server_factory: Callable[[], PostgresServer], tmp_path: Path) -> tuple[Store, PostgresServer]:
    server = pg_server_factory()
    central, users = server.create_database(), server.create_database()
    path = write_map(tmp_path, {"c": central, "u1": users}, central=["c"], partitions=[("0:0:0", ["u1"])])
    store = Store.from_yaml(path, types=[UserBriefcase])
    assert all(r.ok for r in apply_schema(store))
    with ExitStack() as stack:  # fill the pools: POOLED connections to each database at once
        for i in range(POOLED):
            gdid = GDID(0, 0, i + 1)
            session = stack.enter_context(store.briefcase(UserBriefcase, gdid))
            session.add(User(user_id=gdid, email=f"{i}@example.com", name=f"user {i}"))
            stack.enter_context(store.transaction("c"))
    assert store.engine("u1").pool.checkedin() == POOLED  # type: ignore[attr-defined]
    server.stop()
    server.start()
    return store, server


def test_briefcase_sessions_after_a_restart_run_on_fresh_connections(
    pg_server_factory: Callable[[], PostgresServer], tmp_path: Path
) -> None:
    store, _ = restarted_store(pg_server_factory, tmp_path)
    with store:
        for i in range(POOLED + 1):  # more than the pool held: every dead one is met or replaced
            gdid = GDID(0, 0, i % POOLED + 1)
            with store.briefcase(UserBriefcase, gdid) as session:
                assert session.get(User, gdid) is not None
            with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
                assert session.scalars(select(User.name)).one() == f"user {i % POOLED}"


def test_transactions_and_fan_out_after_a_restart_run_on_fresh_connections(
    pg_server_factory: Callable[[], PostgresServer], tmp_path: Path
) -> None:
    store, _ = restarted_store(pg_server_factory, tmp_path)
    with store:
        with store.transaction("c") as conn:
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
        assert len(store.fan_out("user", select(User.user_id)).rows) == POOLED


def test_a_server_that_stays_down_is_still_reported(pg_server_factory: Callable[[], PostgresServer], tmp_path: Path) -> None:
    """The retry is one fresh connection, not a loop: a server that is down fails as before."""
    store, server = restarted_store(pg_server_factory, tmp_path)
    server.stop()
    with store, pytest.raises(ServerUnavailableError, match="'u1' is unavailable"):
        with store.briefcase(UserBriefcase, GDID(0, 0, 1)):
            pass


def test_a_refresh_after_a_restart_runs_on_fresh_connections(
    pg_server_factory: Callable[[], PostgresServer], tmp_path: Path
) -> None:
    """A refresh (after a stale route, or a new map) reads CENTRAL first: its pool is dead too."""
    store, _ = restarted_store(pg_server_factory, tmp_path)
    with store:
        store.refresh()
        with store.briefcase(UserBriefcase, GDID(0, 0, 1)) as session:
            assert session.get(User, GDID(0, 0, 1)) is not None
