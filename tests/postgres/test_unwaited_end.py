"""A readonly briefcase session's end is sent without waiting for the answer, and read before the next use.

A readonly session's transaction is ``READ ONLY`` on PostgreSQL (its BEGIN says so), so its
COMMIT cannot change anything: the engine sends it and hands the connection back at once
(:func:`mdb.engines.commit_unwaited`), one round trip fewer per readonly session (issue 34). The
answer stays in flight until the connection's next use reads it: the pool before it hands the
connection out again (:attr:`mdb.budget.BudgetPool.reuse`), or the next BEGIN on it. These tests
pin both halves: the end is really not waited for, and nothing that comes after trips over it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq
from sqlalchemy import select, text
from support.mapfiles import write_map

from mdb.aio import AsyncStore
from mdb.budget import BudgetPool
from mdb.demo.models import User, UserBriefcase
from mdb.engines import _PENDING_END, finish_pending_end, set_prelude, take_result
from mdb.errors import MdbError
from mdb.gdid import GDID
from mdb.ownership import OwnershipCheck
from mdb.schema import apply_schema
from mdb.store import Store

pytestmark = pytest.mark.postgres

GDIDS = [GDID(0, 0, i) for i in range(1, 4)]


@pytest.fixture
def store(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Iterator[Store]:
    central, users = pg_databases(2)
    path = write_map(tmp_path, {"c": central, "u1": users}, central=["c"], partitions=[("0:0:0", ["u1"])])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
        for g in GDIDS:
            with store.briefcase(UserBriefcase, g) as session:
                session.add(User(user_id=g, email=f"{g.counter}@example.com", name=f"user {g.counter}"))
        yield store


def _idle(store: Store, readonly: bool = True) -> list[Any]:
    """The driver connections idle in the pool of ``u1``'s engine."""
    pool = store.engine("u1", readonly).pool
    assert isinstance(pool, BudgetPool)
    return [record.driver_connection for record, _ in pool._idle]


def test_a_readonly_sessions_end_is_not_waited_for(store: Store) -> None:
    with store.briefcase(UserBriefcase, GDIDS[0], readonly=True) as session:
        assert session.get(User, GDIDS[0]) is not None
    (connection,) = _idle(store)
    # libpq reports a command in progress until its answer is read: the COMMIT was sent, not waited for.
    assert connection.pgconn.transaction_status == pq.TransactionStatus.ACTIVE
    with store.briefcase(UserBriefcase, GDIDS[1], readonly=True) as session:  # the same connection again
        assert session.get(User, GDIDS[1]).name == "user 2"  # type: ignore[union-attr]
    assert _idle(store) == [connection]


def test_write_sessions_and_plain_transactions_still_wait_for_their_end(store: Store) -> None:
    with store.briefcase(UserBriefcase, GDIDS[0]) as session:
        session.get(User, GDIDS[0]).name = "renamed"  # type: ignore[union-attr]
    with store.transaction("u1", readonly=True) as conn:
        conn.execute(text("SELECT 1"))
    for readonly in (False, True):
        (connection,) = _idle(store, readonly)
        assert connection.pgconn.transaction_status == pq.TransactionStatus.IDLE


def test_a_readonly_session_cannot_write_even_through_text(store: Store) -> None:
    """What makes an unwaited end safe: the server refuses a write in the session, so there is none to lose."""
    with pytest.raises(MdbError, match="read-only transaction"):
        with store.briefcase(UserBriefcase, GDIDS[0], readonly=True) as session:
            session.execute(text("UPDATE users SET name = 'written' WHERE user_id = :g"), {"g": bytes(GDIDS[0])})
    with store.briefcase(UserBriefcase, GDIDS[0], readonly=True) as session:
        assert session.get(User, GDIDS[0]).name == "user 1"  # type: ignore[union-attr]


def test_every_later_use_of_the_connection_reads_the_pending_end_first(store: Store) -> None:
    """A transaction, a raw checkout, a fan-out and a write session after a readonly session on one pool."""
    def readonly_session() -> Any:
        with store.briefcase(UserBriefcase, GDIDS[0], readonly=True) as session:
            session.get(User, GDIDS[0])
        (connection,) = _idle(store)
        assert connection.pgconn.transaction_status == pq.TransactionStatus.ACTIVE
        return connection

    readonly_session()
    with store.transaction("u1", readonly=True) as conn:
        assert conn.execute(text("SELECT count(*) FROM users")).scalar() == len(GDIDS)
    connection = readonly_session()
    raw = store.engine("u1", readonly=True).raw_connection()  # the pool read the answer before handing it out
    try:
        assert raw.driver_connection is connection
        assert connection.pgconn.transaction_status == pq.TransactionStatus.IDLE
        assert connection.execute("SELECT 1").fetchone() == (1,)
    finally:
        raw.close()
    readonly_session()
    result = store.fan_out("user", select(User.user_id).order_by(User.user_id), readonly=True)
    assert [row.user_id for row in result.rows] == GDIDS
    readonly_session()
    with store.connect("u1", readonly=True) as conn:  # a Connection whose BEGIN reads it (the pool did here)
        assert conn.execute(text("SELECT 2")).scalar() == 2


def test_a_connection_whose_server_session_died_after_the_end_is_replaced(store: Store) -> None:
    with store.briefcase(UserBriefcase, GDIDS[0], readonly=True) as session:
        pid = session.execute(text("SELECT pg_backend_pid()")).scalar()
    admin_url = store.engine("u1").url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin_url, autocommit=True) as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        deadline = time.monotonic() + 10
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, "the terminated backend did not exit"
            time.sleep(0.02)
    with store.briefcase(UserBriefcase, GDIDS[1], readonly=True) as session:
        assert session.execute(text("SELECT pg_backend_pid()")).scalar() != pid
        assert session.get(User, GDIDS[1]) is not None


def test_an_async_readonly_sessions_end_is_not_waited_for(store: Store) -> None:
    async def main() -> None:
        async with AsyncStore(store) as aio:
            for g in GDIDS * 2:
                async with aio.briefcase(UserBriefcase, g, readonly=True) as session:
                    assert (await session.get(User, g)) is not None
                pool = aio.engines.engine("u1", readonly=True).sync_engine.pool
                assert isinstance(pool, BudgetPool)
                (record,) = [record for record, _ in pool._idle]
                connection = record.driver_connection
                assert connection.pgconn.transaction_status == pq.TransactionStatus.ACTIVE
            # A fan-out takes its connections from the pool as they are (no BEGIN): the pool read the end.
            result = await aio.fan_out("user", select(User.user_id).order_by(User.user_id), readonly=True)
            assert [row.user_id for row in result.rows] == GDIDS
            assert [r.driver_connection for r, _ in pool._idle] == [connection]  # reused, not replaced
            async with aio.briefcase(UserBriefcase, GDIDS[0]) as session:  # a write session on the other engine
                (await session.get(User, GDIDS[0])).name = "async"  # type: ignore[union-attr]
            async with aio.briefcase(UserBriefcase, GDIDS[0], readonly=True) as session:
                assert (await session.get(User, GDIDS[0])).name == "async"  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_connection_that_begins_again_on_the_same_checkout_reads_the_end_first(store: Store) -> None:
    """Not every next use goes through the pool: a Connection may begin again after its commit."""
    placement = store.router.default_placement("user", GDIDS[0])
    with store.connect("u1", readonly=True) as conn:
        set_prelude(conn, OwnershipCheck(placement, lock=False))
        conn.begin()
        assert take_result(conn) is not None
        assert conn.execute(text("SELECT count(*) FROM users")).scalar() == len(GDIDS)
        conn.commit()
        driver = conn.connection.driver_connection
        assert driver.pgconn.transaction_status == pq.TransactionStatus.ACTIVE  # the READ ONLY end, unwaited
        assert conn.execute(text("SELECT 3")).scalar() == 3  # autobegin: its BEGIN read the answer first
        conn.commit()
        assert driver.pgconn.transaction_status == pq.TransactionStatus.IDLE


@pytest.mark.parametrize("arrived", [True, False], ids=["answer-arrived", "answer-on-its-way"])
def test_reading_a_pending_end_waits_only_when_it_must_and_raises_its_error(pg_url: str, arrived: bool) -> None:
    """:func:`mdb.engines.finish_pending_end` takes an answer that arrived without waiting, waits
    for one still on its way, and raises an error answer as psycopg's error class."""
    url = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as connection:
        info: dict[Any, Any] = {_PENDING_END: True}
        connection.pgconn.send_query(b"SELECT 1" if arrived else b"SELECT pg_sleep(0.3)")
        connection.pgconn.flush()
        if arrived:
            time.sleep(0.2)
        started = time.monotonic()
        finish_pending_end(connection, info)
        assert _PENDING_END not in info
        assert connection.pgconn.transaction_status == pq.TransactionStatus.IDLE
        if not arrived:  # it waited for the answer (the query sleeps 0.3 s), not returned with it unread
            assert time.monotonic() - started > 0.1
        connection.pgconn.send_query(b"SELECT 1/0")
        connection.pgconn.flush()
        with pytest.raises(psycopg.errors.DivisionByZero):
            finish_pending_end(connection, {_PENDING_END: True})
        assert connection.execute("SELECT 2").fetchone() == (2,)  # the connection is usable after the error
