"""tests/postgres/test_stale_routing.py with async writers: an AsyncStore with a stale cache cannot lose data.

The cluster, the map versions, the simulated moves and the shard-by-shard inspection are that
suite's own (tests/support/stale.py); the writers are asyncio tasks on an AsyncStore. Each test runs on direct
PostgreSQL connections and again through a transaction-mode PgBouncer (``pooler: transaction``:
the async engine sends the check as a call of its PL/pgSQL function, nothing prepared).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.pgbouncer import THROUGH_PGBOUNCER
from sqlalchemy import select, update
from support.stale import stale_pg_cluster  # noqa: F401 (the fixture)
from support.stale import SHARDS, V2, Cluster, count_waits, create_user, move_by_hand, restamp_for, rows_on_every_shard

from mdb.aio import AsyncStore
from mdb.demo.models import Address, User, UserBriefcase
from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.gdid import GDID
from mdb.partition_map import load_map
from mdb.router import Router, ShardLayout
from mdb.schema import stamp_layout
from mdb.system_tables import STATE_INCOMING, STATE_RESIDENT, briefcase_state


pytestmark = THROUGH_PGBOUNCER  # every test on direct connections and through PgBouncer


@pytest.fixture
def cluster(stale_pg_cluster: Cluster) -> Cluster:
    """test_stale_routing's cluster on PostgreSQL (support.stale), reached as ``pg_route`` says."""
    return stale_pg_cluster


def counted(aio: AsyncStore) -> list[int]:
    """Count the AsyncStore's refreshes (each is one re-read of the map and relocations)."""
    calls: list[int] = []
    refresh = aio.refresh

    async def refresh_counted() -> None:
        calls.append(1)
        await refresh()

    aio.refresh = refresh_counted  # type: ignore[method-assign]
    return calls


async def write_user(aio: AsyncStore, gdid: GDID, tag: int = 0) -> str:
    async with aio.briefcase(UserBriefcase, gdid) as session:
        if tag == 0:
            session.add(User(user_id=gdid, email=f"{gdid}@example.com", name="u"))
        address_id = GDID(0, 1, gdid.counter) if tag == 0 else GDID(0, 2, gdid.counter * 1000 + tag)
        session.add(Address(address_id=address_id, line1="1 Main St", city="Springfield", country="US"))
        return session.placement.server


@pytest.mark.slow  # 65 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_async_store_with_an_older_map_is_refused_and_retried_on_the_right_shard(cluster: Cluster) -> None:
    old_writer, old_reader = AsyncStore(cluster.store()), AsyncStore(cluster.store())
    cluster.publish(2, V2)
    restamp_for(cluster, 2)
    gdids = [GDID(0, 0, 1500 + 3 * i) for i in range(20)]  # version 1: u1/u2; version 2: all on u3
    assert {Router(load_map(cluster.path)).locate("user", g).server for g in gdids} == {"u3"}

    async def main() -> tuple[list[str], int, int, list[GDID]]:
        writes, reads = counted(old_writer), counted(old_reader)
        servers = await asyncio.gather(*(write_user(old_writer, g) for g in gdids))
        async with old_reader.briefcase(UserBriefcase, gdids[0], readonly=True) as session:
            assert session.placement.server == "u3"
            found = list((await session.scalars(select(User.user_id))).all())
        await old_writer.close()
        await old_reader.close()
        return list(servers), len(writes), len(reads), found

    servers, writes, reads, found = asyncio.run(main())
    assert set(servers) == {"u3"} and writes == 1 and reads == 1 and found == [gdids[0]]
    admin = cluster.store()
    for g in gdids:
        assert rows_on_every_shard(admin, g) == {s: (2 if s == "u3" else 0) for s in SHARDS}


def test_a_restamped_shard_refuses_async_sessions_until_the_retries_run_out(cluster: Cluster) -> None:
    store = cluster.store(max_stale_retries=2)
    with store.transaction("u1") as conn:
        assert stamp_layout(conn, ShardLayout("user", GDID.ZERO, None, 0, 3), 1, replace=True) is None
    gdid = GDID(0, 0, 8)  # u1 in the map

    async def main() -> int:
        async with AsyncStore(store) as aio:
            refreshes = counted(aio)
            with pytest.raises(StaleRouteError, match=r"server 'u1': the server is stamped partition \[0:0:0, open\) shard 0 of 3"):
                await write_user(aio, gdid)
            assert await write_user(aio, GDID(0, 0, 9)) == "u2"  # the other shard is unaffected
            return len(refreshes)

    assert asyncio.run(main()) == 2  # three attempts: the first and max_stale_retries retries
    assert rows_on_every_shard(store, gdid) == {s: 0 for s in SHARDS}


def test_fence_and_relocation_send_many_stale_async_writers_to_the_new_shard(cluster: Cluster) -> None:
    gdid = GDID(0, 0, 4)
    stale = cluster.store()
    assert create_user(stale, gdid) == "u1"
    move_by_hand(cluster.store(), gdid, "u1", "x")

    async def main() -> tuple[list[str], int]:
        async with AsyncStore(stale) as aio:
            refreshes = counted(aio)
            servers = await asyncio.gather(*(write_user(aio, gdid, tag=1 + i) for i in range(30)))
            return list(servers), len(refreshes)

    servers, refreshes = asyncio.run(main())
    assert set(servers) == {"x"} and refreshes == 0  # thirty refused writers followed the fence: no refresh
    assert rows_on_every_shard(stale, gdid) == {s: (32 if s == "x" else 0) for s in SHARDS}


def test_an_incoming_copy_makes_async_sessions_wait_without_blocking_the_loop(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    gdid = GDID(0, 0, 12)
    admin = cluster.store()
    assert create_user(admin, gdid) == "u1"
    move_by_hand(admin, gdid, "u1", "x", target_state=STATE_INCOMING)

    async def main() -> tuple[Any, int]:
        async with AsyncStore(cluster.store(move_wait_seconds=0.2)) as impatient:
            with pytest.raises(BriefcaseMovingError, match=r"a move into this server is not finished yet"):
                await write_user(impatient, gdid, tag=1)
        async with AsyncStore(cluster.store(move_wait_seconds=60)) as patient:
            waits = count_waits(monkeypatch, on_wait=lambda n: None)
            session = asyncio.create_task(write_user(patient, gdid, tag=2))
            ticks = 0
            while len(waits) < 2:  # the loop keeps running while the session waits
                await asyncio.sleep(0.01)
                ticks += 1
            assert not session.done()
            with admin.transaction("x") as conn:
                conn.execute(update(briefcase_state).where(briefcase_state.c.gdid == gdid).values(state=STATE_RESIDENT))
            return await session, ticks

    server, ticks = asyncio.run(main())
    assert server == "x" and ticks > 1
    assert rows_on_every_shard(admin, gdid) == {s: (3 if s == "x" else 0) for s in SHARDS}
