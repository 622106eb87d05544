"""The routing a Store keeps between sessions of one briefcase (Store.session_routes, docs/dev/0019).

A kept route saves the next session of the briefcase computing its placement and rendering its
ownership check; the check still runs in every session. These tests make a kept route wrong
(a move this process has not met, a route learned by another session, a new map) and check
that the next session goes to the briefcase's owner, that a stale kept route never writes
to the shard it names, and that the cache is invalidated where this process knows better:
each invalidation case counts the refusals, which are there exactly when it is missing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select
from support.stale import Cluster, SHARDS, V2, count_refreshes, count_refusals, create_user, move_by_hand, restamp_for, rows_on_every_shard
from support.stale import stale_pg_cluster, stale_sqlite_cluster  # noqa: F401 (fixtures)

from mdb.aio import AsyncStore
from mdb.demo.models import Address, User, UserBriefcase
from mdb.gdid import GDID
from mdb.store import Store


@pytest.fixture(params=["postgresql", "sqlite"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """test_stale_routing's cluster (support.stale) on PostgreSQL and on SQLite."""
    yield request.getfixturevalue("stale_pg_cluster" if request.param == "postgresql" else "stale_sqlite_cluster")


def add_address(store: Store, gdid: GDID, n: int) -> str:
    with store.briefcase(UserBriefcase, gdid) as session:
        session.add(Address(address_id=GDID(0, 2, gdid.counter * 100 + n), line1=f"{n} Side St", city="Shelbyville", country="US"))
        return session.placement.server


def visit(store: Store, gdid: GDID, readonly: bool = False) -> str:
    """A session that reads the briefcase's user: the second session of a key keeps its route."""
    with store.briefcase(UserBriefcase, gdid, readonly=readonly) as session:
        assert session.get(User, gdid) is not None
        return session.placement.server


def test_the_next_session_reuses_the_route_and_a_store_without_the_cache_keeps_none(cluster: Cluster) -> None:
    gdid = GDID(0, 0, 4)
    store = cluster.store()
    assert create_user(store, gdid) == "u1"
    assert store.session_routes.get((UserBriefcase, gdid, False, False), store.router, None) is None  # seen once
    assert visit(store, gdid) == "u1"  # the second session: its route is kept
    kept = store.session_routes.get((UserBriefcase, gdid, False, False), store.router, None)
    assert kept is not None and kept.placement.server == "u1"
    with store.briefcase(UserBriefcase, gdid) as session:
        assert session.briefcase is kept.context  # nothing derived again
        assert session.get(User, gdid) is not None
    uncached = cluster.store(placement_cache_size=0)
    assert add_address(uncached, gdid, 1) == "u1" and len(uncached.session_routes) == 0


def test_a_kept_route_to_a_shard_the_briefcase_left_is_refused_there_and_the_write_lands_on_the_owner(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    gdid = GDID(0, 0, 4)
    store = cluster.store()
    assert create_user(store, gdid) == "u1" and visit(store, gdid) == "u1"  # its route is kept: u1
    move_by_hand(cluster.store(), gdid, "u1", "x")  # by another process: this Store has met no fence

    refusals = count_refusals(monkeypatch)
    assert add_address(store, gdid, 1) == "x"
    assert refusals == ["u1"]  # the kept route went to u1, whose check refused it (the fence), then x
    assert rows_on_every_shard(store, gdid) == {s: (3 if s == "x" else 0) for s in SHARDS}  # nothing written on u1

    # the refused route is not kept again: the next session routes by the fence it learned, at once
    assert add_address(store, gdid, 2) == "x" and add_address(store, gdid, 3) == "x"
    assert refusals == ["u1"]
    assert rows_on_every_shard(store, gdid) == {s: (5 if s == "x" else 0) for s in SHARDS}


def test_a_location_learned_by_another_session_replaces_the_kept_route(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails without the briefcase's learned location in the cache's validity: the readonly session
    would go to its kept u1 and be refused there once more."""
    gdid = GDID(0, 0, 4)
    store = cluster.store()
    assert create_user(store, gdid) == "u1"
    assert visit(store, gdid, readonly=True) == visit(store, gdid, readonly=True) == "u1"  # a readonly route kept: u1
    move_by_hand(cluster.store(), gdid, "u1", "x")

    refusals = count_refusals(monkeypatch)
    assert add_address(store, gdid, 1) == "x"  # the write session meets the fence and learns x
    assert refusals == ["u1"]
    with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
        assert session.placement.server == "x"
        assert len(session.scalars(select(Address)).all()) == 2
    assert refusals == ["u1"]  # the readonly session went to x directly


def test_a_location_learned_for_another_briefcase_leaves_this_ones_route_kept(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails with a global invalidation (a counter of every learn and forget, as before): during a
    reshard a process learns a location per moved briefcase it meets, and each dropped every route
    kept for the briefcases that did not move."""
    stays, moves = GDID(0, 0, 4), GDID(0, 0, 6)
    store = cluster.store()
    assert create_user(store, stays) == "u1" and create_user(store, moves) == "u1" and visit(store, stays) == "u1"
    move_by_hand(cluster.store(), moves, "u1", "x")
    refusals = count_refusals(monkeypatch)
    assert add_address(store, moves, 1) == "x"  # the fence is met and x learned for that briefcase
    assert refusals == ["u1"] and store.routes.get("user", moves) == "x"

    kept = store.session_routes.get((UserBriefcase, stays, False, False), store.router, None)
    assert kept is not None and kept.placement.server == "u1"
    with store.briefcase(UserBriefcase, stays) as session:
        assert session.briefcase is kept.context  # nothing derived again
        assert session.get(User, stays) is not None
    assert refusals == ["u1"]


def test_a_refresh_replaces_every_kept_route(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails without the router in the cache's validity: after the refresh the kept route (u1,
    the old layout) would be refused by u1's new stamp and cost a refusal and another refresh."""
    gdid = GDID(0, 0, 1500)  # version 1: u1 (1500 % 2 = 0); version 2: u3 (1500 % 3 = 0)
    store = cluster.store()
    for _ in range(2):  # a write route kept under version 1 (at its second session)
        with store.briefcase(UserBriefcase, gdid) as session:
            assert session.placement.server == "u1" and session.get(User, gdid) is None
    cluster.publish(2, V2)
    restamp_for(cluster, 2)
    store.refresh()  # the process reads the new map (as after any stale route or a map file change)
    assert store.map.version == 2 and len(store.session_routes) == 0

    refusals, refreshes = count_refusals(monkeypatch), count_refreshes(store, monkeypatch)
    assert create_user(store, gdid) == "u3"
    assert refusals == [] and refreshes == []
    assert rows_on_every_shard(store, gdid) == {s: (2 if s == "u3" else 0) for s in SHARDS}


def test_an_async_session_follows_the_fence_past_a_kept_route(stale_pg_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The async opener shares the cache and the loop's handling of a refusal."""
    import asyncio

    gdid = GDID(0, 0, 4)
    store = stale_pg_cluster.store()

    async def run() -> list[str]:
        aio = AsyncStore(store)
        try:
            servers = []
            for n in range(4):
                async with aio.briefcase(UserBriefcase, gdid) as session:
                    if n == 0:
                        session.add(User(user_id=gdid, email=f"{gdid}@example.com", name="u"))
                    session.add(Address(address_id=GDID(0, 2, 400 + n), line1="1 Main St", city="Springfield", country="US"))
                    servers.append(session.placement.server)
                if n == 1:  # the route is kept at the second session
                    move_by_hand(stale_pg_cluster.store(), gdid, "u1", "x")
                    refusals.clear()
            return servers
        finally:
            await aio.close()

    refusals = count_refusals(monkeypatch)
    assert asyncio.run(run()) == ["u1", "u1", "x", "x"]
    assert refusals == ["u1"]  # the kept route once, then the learned location
    assert rows_on_every_shard(store, gdid) == {s: (5 if s == "x" else 0) for s in SHARDS}
