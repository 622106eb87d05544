"""Briefcase sessions through a transaction-mode PgBouncer with a pool of 3 (issue 14).

Under transaction pooling each transaction may run on another server session, so nothing a
session prepared (SQL ``PREPARE``, psycopg's automatic prepare) survives to the next one. The
measured failure before ``pooler: transaction``: 364 of 1,600 sessions failed with
``DuplicatePreparedStatement`` / "prepared statement mdb_ownership_read does not exist".
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.pgbouncer import pooled_servers, tools_store, write_pooled_map
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from support.briefcase import eight_exclusive_writers_lose_nothing, RoundTripCounter, _proxied, child_id

from mdb.aio import AsyncStore
from mdb.demo.models import Order, User, UserBriefcase
from mdb.errors import SchemaError, StaleRouteError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.system_tables import briefcase_state
from mdb.testing.pgbouncer import PgBouncer

THREADS = 8
SESSIONS_PER_THREAD = 1000
BRIEFCASES = [GDID(0, 0, n) for n in range(1, 41)]  # 40 users over 2 shards


@pytest.fixture
def pooled(pg_databases: Callable[[int], list[str]], pgbouncer: Callable[..., PgBouncer], tmp_path: Path) -> Iterator[tuple[Path, PgBouncer]]:
    """CENTRAL and two user shards as three databases of one PostgreSQL behind one PgBouncer
    (pool of 3 server connections per database), schema applied through the direct URLs."""
    direct = {"central": pg_databases(1)[0], "u1": pg_databases(1)[0], "u2": pg_databases(1)[0]}
    bouncer, pooled_urls = pooled_servers(pgbouncer, direct)
    path = write_pooled_map(tmp_path, pooled_urls, direct, central=["central"], partitions=[("0:0:0", ["u1", "u2"])])
    with tools_store(lambda: Store.from_yaml(path, types=[UserBriefcase])) as tools:
        reports = apply_schema(tools)
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    yield path, bouncer


@pytest.mark.slow  # 44 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_8_threads_x_1000_sessions_through_a_pool_of_3_all_succeed(pooled: tuple[Path, PgBouncer]) -> None:
    path, bouncer = pooled
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        for gdid in BRIEFCASES:
            with store.briefcase(UserBriefcase, gdid) as session:
                session.add(User(user_id=gdid, email=f"{gdid}@example.com", name=str(gdid)))
        failures: Counter[str] = Counter()
        writes: Counter[GDID] = Counter()
        lock = threading.Lock()
        start = threading.Barrier(THREADS)

        def worker(index: int) -> None:
            start.wait()
            for n in range(SESSIONS_PER_THREAD):
                gdid = BRIEFCASES[(index * 7 + n) % len(BRIEFCASES)]
                readonly = n % 2 == 0
                try:
                    with store.briefcase(UserBriefcase, gdid, readonly=readonly) as session:
                        user = session.get(User, gdid)
                        assert user is not None and user.name == str(gdid)
                        if not readonly:
                            session.add(Order(order_id=child_id(), total_cents=n))
                    if not readonly:
                        with lock:
                            writes[gdid] += 1
                except Exception as exc:  # counted, and every kind is reported by the assertion below
                    with lock:
                        failures[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert failures == Counter(), f"{sum(failures.values())} of {THREADS * SESSIONS_PER_THREAD} sessions failed: {failures}"
        assert sum(writes.values()) == THREADS * SESSIONS_PER_THREAD // 2
        for gdid in BRIEFCASES:  # every committed write is there, exactly once
            with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
                assert session.scalar(select(func.count()).select_from(Order)) == writes[gdid]
    # The pool really was shared: never more than 3 server connections per database.
    for pool in bouncer.show("POOLS"):
        if pool["database"] != "pgbouncer":
            assert int(str(pool["sv_active"])) + int(str(pool["sv_idle"])) + int(str(pool["sv_used"])) <= 3, pool


def test_a_pooled_engine_prepares_nothing_on_the_server(pooled: tuple[Path, PgBouncer]) -> None:
    """No SQL PREPARE and no psycopg auto-prepare: after many sessions, many repeats of one
    query on one client connection and many warm fan-outs (mdb.scatter prepares its statement
    on a direct connection), no server session holds a prepared statement."""
    path, _ = pooled
    gdid = BRIEFCASES[0]
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        with store.briefcase(UserBriefcase, gdid) as session:
            session.add(User(user_id=gdid, email="a@example.com", name="a"))
        for _ in range(20):  # psycopg auto-prepares a query from its 5th run on a connection
            assert store.fan_out("user", select(func.count()).select_from(User), aggregate=True).rows == [(1,)]
            with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
                session.get(User, gdid)
                for _ in range(6):
                    session.execute(select(User.name).where(User.user_id == gdid)).all()
                held = session.execute(text("SELECT name FROM pg_prepared_statements")).scalars().all()
                assert held == [], f"prepared statements on a pooled server session: {held}"

        async def through_the_loop() -> list[str]:  # the async fan-out sends warm shards the same way
            async with AsyncStore(store) as aio:
                for _ in range(20):
                    assert (await aio.fan_out("user", select(func.count()).select_from(User), aggregate=True)).rows == [(1,)]
                async with aio.transaction(store.router.locate("user", gdid).server) as conn:
                    return list((await conn.execute(text("SELECT name FROM pg_prepared_statements"))).scalars().all())

        held = asyncio.run(through_the_loop())
        assert held == [], f"prepared statements on a pooled server session: {held}"


def test_a_fence_still_turns_a_pooled_session_away(pooled: tuple[Path, PgBouncer]) -> None:
    """The inlined check is the same check: a fence on the shard refuses the session."""
    path, _ = pooled
    gdid = BRIEFCASES[0]
    with Store.from_yaml(path, types=[UserBriefcase], max_stale_retries=0) as store:
        with store.briefcase(UserBriefcase, gdid) as session:
            session.add(User(user_id=gdid, email="a@example.com", name="a"))
        server = store.router.locate("user", gdid).server
        with store.transaction(server) as conn:
            conn.execute(briefcase_state.insert().values(area="user", gdid=gdid, state="gone", peer="elsewhere", move_id="m"))
        for readonly in (True, False):
            with pytest.raises(StaleRouteError, match="fenced"), store.briefcase(UserBriefcase, gdid, readonly=readonly):
                pass


def test_a_shard_without_the_check_functions_asks_for_schema_apply(pooled: tuple[Path, PgBouncer]) -> None:
    """Behind a pooler the check is a call of a function ``mdb schema apply`` creates; a shard
    set up by an older mdb lacks it: the session says what to run, and after it, works."""
    path, _ = pooled
    gdid = BRIEFCASES[0]
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        with store.briefcase(UserBriefcase, gdid) as session:
            session.add(User(user_id=gdid, email="a@example.com", name="a"))
        server = store.router.locate("user", gdid).server
        with store.transaction(server) as conn:
            conn.execute(text("DROP FUNCTION mdb_check_read, mdb_check_write"))
        for readonly in (True, False):
            with pytest.raises(SchemaError, match="mdb_check_.* does not exist.*`mdb schema apply MAP` creates it"):
                with store.briefcase(UserBriefcase, gdid, readonly=readonly):
                    pass
    with tools_store(lambda: Store.from_yaml(path, types=[UserBriefcase])) as tools:
        assert all(r.ok for r in apply_schema(tools))
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        for readonly in (True, False):
            with store.briefcase(UserBriefcase, gdid, readonly=readonly) as session:
                assert session.get(User, gdid) is not None


def test_the_pooled_check_costs_no_extra_round_trip(
    pg_databases: Callable[[int], list[str]], pgbouncer: Callable[..., PgBouncer], tmp_path: Path
) -> None:
    """Invariant 2 behind PgBouncer: a pooled briefcase read costs BEGIN(+check), SELECT, COMMIT,
    the 3 round trips of a plain Session on the same engine; one extra SELECT 1 shows as a 4th.
    Counted by test_briefcase_pg's ReadyForQuery proxy between the client and PgBouncer."""
    direct = dict(zip(["central", "u1"], pg_databases(2), strict=True))
    bouncer, pooled_urls = pooled_servers(pgbouncer, direct)
    shard = make_url(pooled_urls["u1"])
    proxy = RoundTripCounter(shard.host or "127.0.0.1", shard.port or 6432)
    try:
        path = write_pooled_map(
            tmp_path, {"central": pooled_urls["central"], "u1": _proxied(pooled_urls["u1"], proxy.port)}, direct,
            central=["central"], partitions=[("0:0:0", ["u1"])],
        )
        with tools_store(lambda: Store.from_yaml(path, types=[UserBriefcase])) as tools:
            assert all(r.ok for r in apply_schema(tools))
        with Store.from_yaml(path, types=[UserBriefcase]) as store:
            gdid = GDID(0, 0, 70)
            with store.briefcase(UserBriefcase, gdid) as session:
                session.add(User(user_id=gdid, email="a@example.com", name="a"))
            assert store.engines.pooled("u1")
            engine = store.engine("u1")

            def briefcase_read(readonly: bool) -> None:
                with store.briefcase(UserBriefcase, gdid, readonly=readonly) as session:
                    assert session.scalars(select(User).where(User.user_id == gdid)).one().user_id == gdid
                    session.expunge_all()

            def plain_read(extra: bool = False) -> None:
                with Session(engine) as session, session.begin():
                    if extra:
                        session.execute(text("SELECT 1"))
                    assert session.scalars(select(User).where(User.user_id == gdid)).one().user_id == gdid

            def settle() -> None:
                # A readonly session's COMMIT is sent unwaited (dev/0023): its ReadyForQuery may
                # still be on its way when the session returns. A checkout reads it (the pool's
                # reuse hook), so the proxy has counted it before the count is read.
                for readonly in (False, True):
                    store.engine("u1", readonly).raw_connection().close()

            def trips(fn: Callable[[], None]) -> int:
                for _ in range(7):  # past psycopg's prepare_threshold, were it on
                    fn()
                settle()
                before = proxy.ready_for_query
                for _ in range(3):
                    fn()
                settle()
                total = proxy.ready_for_query - before
                assert total % 3 == 0, total
                return total // 3

            plain = trips(plain_read)
            assert plain == 3  # BEGIN, SELECT, COMMIT
            assert trips(lambda: plain_read(extra=True)) == plain + 1
            assert trips(lambda: briefcase_read(True)) == plain
            assert trips(lambda: briefcase_read(False)) == plain
    finally:
        proxy.close()


def test_exclusive_sessions_serialize_writers_through_the_pooler(pooled: tuple[Path, PgBouncer]) -> None:
    """The exclusive lock travels as its own check function (mdb_check_write_x) behind a pooler:
    the same 8 read-modify-write writers as on a direct connection lose nothing."""
    path, _bouncer = pooled
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        eight_exclusive_writers_lose_nothing(store)
