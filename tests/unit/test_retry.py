"""The one routing and retry policy of every session open (mdb.retry.RoutedOpen), sans I/O.

The sync and async loops only carry out its steps, so these cases hold for both; the tests on
real PostgreSQL (test_stale_routing, test_aio_stale, test_reshard_routing) drive it end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mdb import GDID, Router, load_map
from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.retry import MAX_FENCE_HOPS, LearnedRoutes, RouteCache, RoutedOpen, Step
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


# -- the routing kept between sessions (RouteCache, docs/dev/0019) ------------------------------


def test_a_kept_route_is_valid_only_under_its_router_and_the_briefcases_learned_location(router: Router) -> None:
    cache = RouteCache[str, str](capacity=8)
    cache.put("g", router, None, "route")
    cache.put("g", router, None, "route")  # kept from its second put
    assert cache.get("g", router, None) == "route"
    assert cache.get("g", Router(router.map), None) is None  # a refresh makes a new router
    assert cache.get("g", router, "user-7") is None  # the briefcase was learned elsewhere since
    cache.put("g", router, "user-7", "learned route")
    assert cache.get("g", router, "user-7") == "learned route"
    assert cache.get("g", router, None) is None  # forgotten (or dropped from the LRU) since
    assert cache.get("g", router, "user-8") is None


def test_the_policy_reports_the_learned_location_its_placement_came_from(router: Router) -> None:
    """What :meth:`Store.confirmed` keeps a route under: a location learned for another briefcase
    does not change it, one learned for this briefcase does."""
    routes = LearnedRoutes()
    gdid = GDID(0, 0, 5)
    p = RoutedOpen(routes, "user", gdid, move_wait_seconds=1.0, max_stale_retries=2)
    p.placement(router)
    assert p.learned is None
    routes.learn("user", GDID(0, 0, 99), "user-7")  # another briefcase
    p.placement(router)
    assert p.learned is None
    routes.learn("user", gdid, "user-7")
    assert p.placement(router).server == "user-7" and p.learned == "user-7"
    kept = RoutedOpen(routes, "user", gdid, move_wait_seconds=1.0, max_stale_retries=2,
                      first=(router, router.placement_on("user", gdid, "user-7")), learned="user-7")
    assert kept.placement(router).server == "user-7" and kept.learned == "user-7"


def test_the_route_cache_keeps_a_key_from_its_second_put_is_bounded_and_can_be_off(router: Router) -> None:
    cache = RouteCache[int, int](capacity=3)
    cache.put(0, router, None, 0)
    assert len(cache) == 0 and cache.get(0, router, None) is None  # seen once: only its hash remembered
    for n in range(3):
        cache.put(n, router, None, n)
    assert len(cache) == 1 and cache.get(0, router, None) == 0 and cache.get(2, router, None) is None  # 1, 2 seen once
    for n in (1, 2):
        cache.put(n, router, None, n)
    cache.put(1, router, None, 10)  # a key it holds: replaced, nothing dropped
    assert len(cache) == 3 and cache.get(1, router, None) == 10
    cache.put(3, router, None, 3)
    cache.put(3, router, None, 3)  # full: it starts over
    assert len(cache) == 1 and cache.get(0, router, None) is None and cache.get(3, router, None) == 3
    off = RouteCache[int, int](capacity=0)
    off.put(1, router, None, 1)
    off.put(1, router, None, 1)
    assert len(off) == 0 and off.get(1, router, None) is None
    with pytest.raises(ValueError, match="placement cache size must be >= 0, got -1"):
        RouteCache(capacity=-1)


def test_the_route_caches_doorkeeper_forgets_keys_seen_once_long_ago(router: Router) -> None:
    """Keys met once (a read spread over millions of briefcases) never fill the cache: the
    doorkeeper holds at most twice the capacity of hashes, then starts over."""
    cache = RouteCache[int, int](capacity=2)
    cache.put(0, router, None, 0)
    for n in range(1, 5):  # four more keys seen once: the window (4 hashes) starts over
        cache.put(n, router, None, n)
    cache.put(0, router, None, 0)
    assert len(cache) == 0  # 0 was forgotten: seen once again
    cache.put(0, router, None, 0)
    assert cache.get(0, router, None) == 0


def test_a_kept_placement_is_the_first_attempt_only_under_its_router_and_a_refusal_there_is_any_refusal(router: Router) -> None:
    routes = LearnedRoutes()
    kept = policy(routes).placement(router)
    p = RoutedOpen(routes, "user", G, move_wait_seconds=30, max_stale_retries=3, first=(router, kept))
    assert p.placement(router) is kept and p.refusals == 0
    # refused there by a fence: followed as from a computed placement (no refresh), never offered again
    assert p.refused(kept, StaleRouteError("fenced", moved_to="user-7")) == Step()
    assert p.refusals == 1 and p.placement(router).server == "user-7"
    assert p.learned == "user-7"  # computed from the location the fence taught
    other = Router(router.map)
    q = RoutedOpen(routes, "user", G, move_wait_seconds=30, max_stale_retries=3, first=(router, kept))
    assert q.placement(other) is not kept and q.placement(other).server == "user-7"  # another router: computed
