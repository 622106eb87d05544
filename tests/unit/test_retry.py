"""The one routing and retry policy of every session open (mdb.retry.RoutedOpen), sans I/O.

The sync and async loops only carry out its steps, so these cases hold for both; the tests on
real PostgreSQL (test_stale_routing, test_aio_stale, test_reshard_routing) drive it end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mdb import GDID, Router, load_map
from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.retry import MAX_FENCE_HOPS, LearnedRoutes, RoutedOpen, Step
from mdb.testing import FakeClock as Clock

EXAMPLE = Path(__file__).resolve().parents[2] / "partition_maps" / "example.yaml"
G = GDID.parse("0:0:2")  # user-1 by default (docs/design.md example)


@pytest.fixture(scope="module")
def router() -> Router:
    return Router(load_map(EXAMPLE))


def policy(routes: LearnedRoutes | None = None, *, wait: float = 30, stale: int = 3, clock: Clock | None = None) -> RoutedOpen:
    return RoutedOpen(LearnedRoutes() if routes is None else routes, "user", G, move_wait_seconds=wait, max_stale_retries=stale,
                      clock=clock or Clock())


def test_a_fence_sends_the_retry_where_it_names_without_a_refresh(router: Router) -> None:
    p = policy()
    home = p.placement(router)
    assert (home.server, home.relocated) == ("user-1", False)
    step = p.refused(home, StaleRouteError("fenced", moved_to="user-7"))
    assert step == Step()  # no wait, no refresh
    there = p.placement(router)
    assert (there.server, there.relocated, there.default_server) == ("user-7", True, "user-1")
    # a fence there naming the default shard again: back home, routed by the map, nothing remembered
    assert p.refused(there, StaleRouteError("fenced", moved_to="user-1")) == Step()
    assert p.placement(router) == home and len(p.routes) == 0


def test_learned_locations_are_shared_by_later_opens_and_bounded(router: Router) -> None:
    routes = LearnedRoutes(capacity=2)
    first = policy(routes)
    first.refused(first.placement(router), StaleRouteError("fenced", moved_to="user-7"))
    assert policy(routes).placement(router).server == "user-7"  # the next open goes there directly
    for n in range(3, 10):
        routes.learn("user", GDID(0, 0, n), "user-8")
    assert len(routes) == 2 and routes.get("user", G) is None  # the oldest dropped first


def test_a_fence_is_followed_even_by_a_store_that_remembers_nothing(router: Router) -> None:
    p = policy(LearnedRoutes(capacity=0))
    p.refused(p.placement(router), StaleRouteError("fenced", moved_to="user-7"))
    assert p.placement(router).server == "user-7" and len(p.routes) == 0


def test_a_fence_naming_a_server_the_map_lacks_refreshes_the_map_first(router: Router) -> None:
    p = policy(stale=1)
    home = p.placement(router)
    fence = StaleRouteError("fenced", moved_to="user-99")  # added by a map version this process lacks
    assert p.refused(home, fence) == Step(refresh=True)
    assert p.placement(router) == home  # still unknown to this map: routed by it
    with pytest.raises(StaleRouteError) as raised:
        p.refused(home, fence)
    assert raised.value is fence


def test_any_other_stale_route_forgets_refreshes_and_is_bounded(router: Router) -> None:
    routes = LearnedRoutes()
    routes.learn("user", G, "user-7")
    p = policy(routes, stale=2)
    relocated = p.placement(router)
    exc = StaleRouteError("routed here away from its default shard (a fence or the relocation directory) but the server holds no resident record")
    assert p.refused(relocated, exc) == Step(refresh=True)
    assert routes.get("user", G) is None
    assert p.refused(p.placement(router), exc) == Step(refresh=True)
    with pytest.raises(StaleRouteError) as raised:
        p.refused(p.placement(router), exc)
    assert raised.value is exc


def test_a_move_in_progress_is_waited_for_only_within_move_wait_seconds(router: Router) -> None:
    clock = Clock()
    p = policy(wait=3.0, stale=0, clock=clock)
    moving = BriefcaseMovingError("a move into this server is not finished yet")
    delays = []
    with pytest.raises(BriefcaseMovingError) as raised:
        while True:
            step = p.refused(p.placement(router), moving)
            assert not step.refresh
            delays.append(step.delay)
            clock.now += step.delay
    assert raised.value is moving
    assert delays[:3] == [0.01, 0.02, 0.04] and max(delays) == 0.5 and sum(delays) <= 3.0
    assert p.waits == len(delays)
    # the waits spent none of the stale budget, and a fence is still followed after them
    assert p.refused(p.placement(router), StaleRouteError("fenced", moved_to="user-8")) == Step()


def test_a_fence_chain_that_does_not_end_is_raised_not_followed_forever(router: Router) -> None:
    p = policy()
    for hop in range(MAX_FENCE_HOPS):
        p.refused(p.placement(router), StaleRouteError("fenced", moved_to="user-7" if hop % 2 else "user-8"))
    loop = StaleRouteError("fenced", moved_to="user-7")
    with pytest.raises(StaleRouteError) as raised:
        p.refused(p.placement(router), loop)
    assert raised.value is loop
