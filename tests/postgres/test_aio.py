"""AsyncStore on real PostgreSQL (and SQLite through aiosqlite): the sync guarantees, from async tasks.

Every placement claim is checked by reading every shard directly with the sync Store, never by
asking the router again. Tests drive the loop with plain ``asyncio.run`` (no pytest plugin).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.mapfiles import write_map
from sqlalchemy import Select, func, select, text

from mdb.aio import AsyncStore
from mdb.demo.models import LEDGER, LEDGER_TABLES, Address, User, UserBriefcase
from mdb.demo.repositories import EmailIndex
from mdb.errors import CrossBriefcaseError, DuplicateKeyError, MdbError, StaleRouteError
from mdb.fanout import fan_out
from mdb.gdid import GDID
from mdb.router import Router, ShardLayout
from mdb.schema import apply_schema, stamp_layout
from mdb.store import Store

SHARDS = ["u1", "u2", "u3", "u4"]
NAMES = ["central", *SHARDS]


def make_store(tmp_path: Path, urls: list[str]) -> Store:
    path = write_map(tmp_path, dict(zip(NAMES, urls)), central=["central"], partitions=[("0:0:0", SHARDS)])
    data = yaml.safe_load(path.read_text())
    data["models"] = ["mdb.demo.models", "mdb.demo.repositories"]  # EmailIndex: its CENTRAL index table
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    store = Store.from_yaml(path, types=[UserBriefcase])
    reports = apply_schema(store)
    assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    return store


@pytest.fixture
def pg_store(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Iterator[Store]:
    # Five databases over two PostgreSQL servers: shards really are on different servers.
    with make_store(tmp_path, pg_databases(3) + pg_databases(2)) as store:
        yield store


@pytest.fixture
def sqlite_store(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> Iterator[Store]:
    with make_store(tmp_path, tmp_sqlite_urls(len(NAMES))) as store:
        yield store


@pytest.fixture(params=["postgresql", "sqlite"])
def store(request: pytest.FixtureRequest) -> Store:
    store: Store = request.getfixturevalue("pg_store" if request.param == "postgresql" else "sqlite_store")
    return store


def users_on_every_shard(store: Store) -> dict[str, list[GDID]]:
    """server -> user ids stored there, read directly (no session, no routing)."""
    out = {}
    for server in SHARDS:
        with store.transaction(server) as conn:
            out[server] = list(conn.execute(select(User.user_id).order_by(User.user_id)).scalars())
    return out


def new_user(gdid: GDID, tag: str = "") -> list[Any]:
    return [
        User(user_id=gdid, email=f"{gdid}{tag}@example.com", name=f"user {gdid}"),
        Address(address_id=GDID(0, 1, gdid.counter), line1="1 Main St", city="Springfield", country="US"),
    ]


def test_an_async_session_is_confined_like_the_sync_one(store: Store) -> None:
    a, b = GDID(0, 0, 10), GDID(0, 0, 11)

    async def main() -> None:
        async with AsyncStore(store) as aio:
            for gdid in (a, b):
                async with aio.briefcase(UserBriefcase, gdid) as session:
                    user, address = new_user(gdid)
                    address.user_id = None  # the session fills the key in
                    session.add_all([user, address])
            async with aio.briefcase(UserBriefcase, a, readonly=True) as session:
                assert session.gdid == a and session.placement.server == Router(store.map).locate("user", a).server
                # Reads are filtered: the shard may hold b too, the session sees a only.
                assert (await session.scalars(select(Address.user_id))).all() == [a]
                assert (await session.scalars(select(User.user_id))).all() == [a]
            with pytest.raises(CrossBriefcaseError):
                async with aio.briefcase(UserBriefcase, a) as session:
                    session.add(User(user_id=b, email="x@example.com", name="x"))
            with pytest.raises(MdbError, match="readonly"):
                async with aio.briefcase(UserBriefcase, a, readonly=True) as session:
                    session.add(Address(address_id=GDID(0, 1, 99), line1="l", city="c", country="US"))
            with pytest.raises(ZeroDivisionError):  # an error in the block rolls back
                async with aio.briefcase(UserBriefcase, a) as session:
                    (await session.scalars(select(User))).one().name = "changed"
                    1 / 0
            async with aio.briefcase(UserBriefcase, a, readonly=True) as session:
                assert (await session.scalars(select(User.name))).one() == f"user {a}"

    asyncio.run(main())
    on = users_on_every_shard(store)
    assert sorted(g for ids in on.values() for g in ids) == [a, b]
    for gdid in (a, b):
        assert gdid in on[Router(store.map).locate("user", gdid).server]


def test_the_check_rides_on_begin_and_refuses_a_restamped_shard(pg_store: Store) -> None:
    """One BEGIN round trip carries the check: the session's first statement is the app's own."""
    gdid = GDID(0, 0, 4)  # 4 % 4 = 0 -> u1
    with pg_store.transaction("u1") as conn:
        assert stamp_layout(conn, ShardLayout("user", GDID.ZERO, None, 0, 5), 1, replace=True) is None

    async def main() -> None:
        async with AsyncStore(pg_store) as aio:
            with pytest.raises(StaleRouteError, match=r"stamped partition \[0:0:0, open\) shard 0 of 5"):
                async with aio.briefcase(UserBriefcase, gdid) as session:
                    session.add_all(new_user(gdid))
            # u2 is untouched: a session there sees its own transaction started by the prelude.
            async with aio.briefcase(UserBriefcase, GDID(0, 0, 5)) as session:
                assert session.placement.server == "u2"
                xact = (await session.execute(text("SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'mdb_ownership%'"))).scalar_one()
                assert xact >= 2  # the check's statements were prepared on this connection
                session.add_all(new_user(GDID(0, 0, 5)))

    asyncio.run(main())
    assert users_on_every_shard(pg_store) == {"u1": [], "u2": [GDID(0, 0, 5)], "u3": [], "u4": []}


@pytest.mark.slow  # 53 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_a_thousand_concurrent_tasks_write_once_on_the_right_shard_and_leak_no_connection(pg_store: Store) -> None:
    n = 1000
    gdids = [GDID(0, 0, 100 + i) for i in range(n)]

    async def main() -> tuple[list[GDID], list[tuple[int, int]]]:
        async with AsyncStore(pg_store) as aio:
            await aio.router()
            acknowledged: list[GDID] = []

            async def write(gdid: GDID) -> None:
                async with aio.briefcase(UserBriefcase, gdid) as session:
                    session.add_all(new_user(gdid))
                    await asyncio.sleep(0)  # let other tasks interleave inside open sessions
                acknowledged.append(gdid)

            results = await asyncio.gather(*(write(g) for g in gdids), return_exceptions=True)
            assert [r for r in results if r is not None] == []
            assert all(gate.in_use == 0 for gate in aio.engines.gates())
            pools = [e.sync_engine.pool for e in aio.engines.all()]
            return acknowledged, [(p.checkedout(), p.checkedin()) for p in pools]  # type: ignore[attr-defined]

    acknowledged, pools = asyncio.run(main())
    assert sorted(acknowledged) == gdids
    assert len(pools) == len(SHARDS)  # one engine per shard (CENTRAL was not needed)
    assert all(out == 0 for out, _ in pools), pools  # every connection is back in its pool
    assert all(0 < idle <= 10 for _, idle in pools), pools  # at most pool_size kept idle
    router = Router(pg_store.map)
    on = users_on_every_shard(pg_store)
    assert sorted(g for ids in on.values() for g in ids) == gdids  # each once
    for server, ids in on.items():
        assert all(router.locate("user", g).server == server for g in ids)
        assert len(ids) == n // len(SHARDS)


@pytest.mark.slow  # 43 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_no_briefcase_context_crosses_tasks(store: Store) -> None:
    """Many tasks interleave inside their sessions; each sees only its own briefcase, always."""
    gdids = [GDID(0, 0, 500 + i) for i in range(60)]

    async def main() -> None:
        async with AsyncStore(store) as aio:
            for gdid in gdids:
                async with aio.briefcase(UserBriefcase, gdid) as session:
                    session.add_all(new_user(gdid))
            threads: set[int] = set()

            async def read(gdid: GDID) -> None:
                async with aio.briefcase(UserBriefcase, gdid, readonly=True) as session:
                    for _ in range(5):
                        await asyncio.sleep(0)
                        threads.add(threading.get_ident())
                        assert session.gdid == gdid
                        assert (await session.scalars(select(User.user_id))).all() == [gdid]
                        assert (await session.scalars(select(Address.user_id))).all() == [gdid]

            await asyncio.gather(*(read(g) for g in gdids * 3))
            assert threads == {threading.get_ident()}  # sessions ran on the loop's thread

    asyncio.run(main())


def test_a_stale_async_store_writes_after_a_move_land_on_the_new_shard_only(pg_store: Store, tmp_path: Path) -> None:
    """A Store with the old map and relocation cache writes, from many tasks, after a move."""
    from support.stale import move_by_hand  # the same simulated move as the sync tests

    gdid = GDID(0, 0, 8)  # u1
    with pg_store.briefcase(UserBriefcase, gdid) as session:
        session.add_all(new_user(gdid))
    stale = Store.from_yaml(pg_store.map_path, types=[UserBriefcase])  # type: ignore[arg-type]
    stale.router  # noqa: B018 - the relocation cache is loaded now, before the move
    move_by_hand(pg_store, gdid, "u1", "u3")
    refreshes: list[int] = []
    original = stale.refresh

    def counted() -> None:
        refreshes.append(1)
        original()

    stale.refresh = counted  # type: ignore[method-assign]

    async def main() -> list[str]:
        async with AsyncStore(stale, owns_store=True) as aio:
            await aio.router()

            async def write(i: int) -> str:
                async with aio.briefcase(UserBriefcase, gdid) as session:
                    session.add(Address(address_id=GDID(0, 2, i), line1=f"{i}", city="c", country="US"))
                    return session.placement.server

            return await asyncio.gather(*(write(i) for i in range(50)))

    servers = asyncio.run(main())
    assert set(servers) == {"u3"}
    assert len(refreshes) == 0  # fifty refused tasks follow the fence (it names u3): no refresh at all
    for server in SHARDS:
        with pg_store.transaction(server) as conn:
            count = conn.execute(select(func.count()).select_from(Address.__table__).where(Address.user_id == gdid)).scalar_one()
        assert count == (51 if server == "u3" else 0), server


def test_fan_out_runs_every_shard_concurrently_and_merges_like_the_sync_one(store: Store) -> None:
    gdids = [GDID(0, 0, 700 + i) for i in range(20)]
    for gdid in gdids:
        with store.briefcase(UserBriefcase, gdid) as session:
            session.add_all(new_user(gdid))
    ordered: Select[Any] = select(User.user_id, User.email).order_by(User.email.desc()).limit(7).offset(2)  # type: ignore[assignment]
    counted = select(func.count(User.user_id))

    async def main() -> tuple[Any, Any, Any]:
        async with AsyncStore(store) as aio:
            rows = await aio.fan_out("user", ordered)
            entities = await aio.fan_out("user", select(User).order_by(User.user_id))
            total = await aio.fan_out("user", counted, aggregate=True)
            return rows, entities, total

    rows, entities, total = asyncio.run(main())
    assert [tuple(r) for r in rows] == [tuple(r) for r in fan_out(store, "user", ordered)]
    assert [u.user_id for u in entities.scalars()] == gdids
    assert total.scalars() == [20] and rows.complete


def test_async_ids_and_central_creation_under_concurrency(store: Store) -> None:
    """GDIDs from many tasks are unique; concurrent creations of one key have exactly one winner."""

    async def main() -> tuple[list[GDID], list[GDID | BaseException]]:
        async with AsyncStore(store) as aio:
            ids = await aio.ids(UserBriefcase)
            drawn = await asyncio.gather(*(ids.next() for _ in range(3000)))

            async def register(i: int) -> GDID:
                return await aio.central.create(
                    UserBriefcase, lambda g: User(user_id=g, email=" Same@Example.com", name=f"t{i}"), [EmailIndex]
                )

            created = await asyncio.gather(*(register(i) for i in range(8)), return_exceptions=True)
            winner = [c for c in created if isinstance(c, GDID)]
            assert len(winner) == 1
            assert await aio.central.lookup(EmailIndex, "same@example.com") == winner[0]
            return list(drawn), list(created)

    drawn, created = asyncio.run(main())
    assert len(set(drawn)) == len(drawn)
    assert all(isinstance(c, (GDID, DuplicateKeyError)) for c in created), created


def test_hot_data_patterns_run_on_the_confined_sync_session(store: Store) -> None:
    """The event log (a hot-data pattern) from async code: ``run_sync`` on the briefcase session."""
    gdid = GDID(0, 0, 900)

    async def main() -> int:
        async with AsyncStore(store) as aio:
            async with aio.briefcase(UserBriefcase, gdid) as session:
                session.add_all(new_user(gdid))
                await session.flush()
                for n in range(3):
                    assert await session.run_confined(LEDGER.append, "ledger", GDID(0, 5, n), "transaction", {"amount_cents": -100})
            async with aio.briefcase(UserBriefcase, gdid) as session:
                return (await session.run_confined(LEDGER.snapshot, "ledger")).folded

    assert asyncio.run(main()) == 3
    server = Router(store.map).locate("user", gdid).server
    with store.transaction(server) as conn:
        assert conn.execute(select(func.count()).select_from(LEDGER_TABLES.events).where(LEDGER_TABLES.events.c.user_id == gdid)).scalar_one() == 3


def test_the_async_check_costs_no_extra_round_trip(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """tests/postgres/test_briefcase_pg.py's round-trip count, for async sessions on the async engine.

    A plain AsyncSession on the same async engine costs BEGIN, SELECT, COMMIT; the routed
    session's BEGIN also carries the locks and the check in the same string, so it costs the same.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import AsyncSession
    from support.briefcase import RoundTripCounter, _proxied

    central, shard = pg_databases(2)
    parsed = make_url(shard)
    proxy = RoundTripCounter(parsed.host or "127.0.0.1", parsed.port or 5432)
    try:
        path = write_map(tmp_path, {"central": central, "u1": _proxied(shard, proxy.port)}, central=["central"],
                         partitions=[("0:0:0", ["u1"])])
        with Store.from_yaml(path, types=[UserBriefcase]) as store:
            assert all(r.ok for r in apply_schema(store))
            gdid = GDID(0, 0, 70)

            async def main() -> tuple[int, int, int, int]:
                async with AsyncStore(store) as aio:
                    async with aio.briefcase(UserBriefcase, gdid) as session:
                        session.add_all(new_user(gdid))
                    engine = aio.engines.engine("u1")

                    async def routed(exclusive: bool = False, readonly: bool = False) -> None:
                        async with aio.briefcase(UserBriefcase, gdid, exclusive=exclusive, readonly=readonly) as session:
                            assert (await session.scalars(select(User.user_id))).one() == gdid

                    async def plain(extra: bool = False) -> None:
                        async with AsyncSession(engine) as session, session.begin():
                            if extra:
                                await session.execute(text("SELECT 1"))
                            assert (await session.scalars(select(User.user_id).where(User.user_id == gdid))).one() == gdid

                    async def trips(fn: Callable[[], Any]) -> int:
                        for _ in range(7):  # past psycopg's prepare_threshold, as the sync test
                            await fn()
                        before = proxy.ready_for_query
                        for _ in range(3):
                            await fn()
                        total = proxy.ready_for_query - before
                        assert total % 3 == 0, total
                        return total // 3

                    return (await trips(plain), await trips(lambda: plain(extra=True)), await trips(routed),
                            await trips(lambda: routed(exclusive=True)))

            plain, control, routed, exclusive = asyncio.run(main())
            assert plain == 3  # BEGIN, SELECT, COMMIT
            assert control == plain + 1  # the counter sees one more
            assert routed == plain and exclusive == plain  # the check rode along with BEGIN
    finally:
        proxy.close()


def test_cancelled_tasks_roll_back_and_return_their_connections(pg_store: Store) -> None:
    """An ASGI server cancels the request's task when the client goes away: nothing is written, nothing leaks."""
    gdids = [GDID(0, 0, 3000 + i) for i in range(100)]

    async def main() -> list[tuple[int, int]]:
        async with AsyncStore(pg_store) as aio:
            await aio.router()
            started = 0

            async def write(gdid: GDID) -> None:
                nonlocal started
                async with aio.briefcase(UserBriefcase, gdid) as session:
                    session.add_all(new_user(gdid))
                    await session.flush()
                    started += 1
                    await asyncio.sleep(30)

            tasks = [asyncio.create_task(write(g)) for g in gdids]
            while started < 40:
                await asyncio.sleep(0.01)
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results)
            return [(e.sync_engine.pool.checkedout(), e.sync_engine.pool.checkedin()) for e in aio.engines.all()]  # type: ignore[attr-defined]

    pools = asyncio.run(main())
    assert all(out == 0 for out, _ in pools), pools
    assert users_on_every_shard(pg_store) == {s: [] for s in SHARDS}


def test_the_gate_serves_waiters_in_order_passes_on_slots_and_times_out_as_capacity() -> None:
    from mdb.aio.engines import FairGate
    from mdb.errors import CapacityError

    async def main() -> None:
        gate = FairGate(2, timeout=30.0)  # a pool_size of 2; the waiters never time out, however slow the machine
        await gate.acquire("s")
        await gate.acquire("s")
        order: list[int] = []

        async def wait(i: int) -> None:
            await gate.acquire("s")
            order.append(i)

        waiters = [asyncio.create_task(wait(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        waiters[1].cancel()  # a cancelled waiter gives up its place, not a slot
        gate.release()
        gate.release()
        await asyncio.sleep(0.01)
        assert order == [0, 2]  # first come, first served
        gate.release()  # a freed slot goes straight to the oldest waiter
        await asyncio.sleep(0.01)
        assert order == [0, 2, 3] and gate.in_use == 2
        gate.timeout = 0.2  # read at each wait: only this waiter times out
        with pytest.raises(CapacityError, match="all 2 async connections stayed in use for 0.2 s"):
            await gate.acquire("s")
        gate.release()
        gate.release()
        assert gate.in_use == 0
        await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(main())


def test_an_async_sqlite_commit_that_fails_leaves_no_transaction_in_the_pool(tmp_path: Path) -> None:
    # As the sync dialect (tests/postgres/test_engines.py): a deferred foreign key fails the
    # COMMIT, SQLite would keep that transaction open and the pool hand it to the next BEGIN.
    from sqlalchemy.exc import IntegrityError

    from mdb.aio.engines import create_async

    async def main() -> None:
        engine = create_async(f"sqlite:///{tmp_path / 'a.db'}", readonly=False)
        try:
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE parent (id INTEGER PRIMARY KEY)"))
                await conn.execute(text("CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER "
                                        "REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)"))
            async with engine.connect() as conn:
                await conn.begin()
                await conn.execute(text("INSERT INTO child VALUES (1, 42)"))  # no parent 42: refused at COMMIT
                with pytest.raises(IntegrityError, match="FOREIGN KEY constraint failed"):
                    await conn.commit()
                assert not (await conn.get_raw_connection()).driver_connection.in_transaction
            async with engine.begin() as conn:  # the pooled connection again: BEGIN works
                await conn.execute(text("INSERT INTO parent VALUES (8)"))
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT count(*) FROM child"))).scalar_one() == 0
                assert (await conn.execute(text("SELECT id FROM parent"))).scalars().all() == [8]
        finally:
            await engine.dispose()

    asyncio.run(main())
