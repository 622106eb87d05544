"""How a Store routes a briefcase session and reacts when its shard refuses it (docs/design.md invariants 2, 8).

One policy, written once and without I/O (:class:`RoutedOpen`), drives both routed-open loops:
the sync one (:func:`mdb.backends.open_routed`, SQL sessions and document contexts) and the async
one (``AsyncStore._open_routed``). The loops only do what it says: open on the placement it
gives, and on a refusal sleep for the step's delay and refresh the map when the step asks.

Routing state per process is the map plus :class:`LearnedRoutes`, a bounded LRU of locations
learned from fences, never the relocation directory. Three kinds of refusal, three reactions:

- a fence (``StaleRouteError`` with ``moved_to``): the briefcase left for the server the fence
  names. Go there at once (no refresh, no wait) and check ownership there; remember it.
  Following fences from the default shard reaches the briefcase after any chain of moves,
  hand-made relocations (a hot tenant) included: fences stay on the servers a briefcase left.
- a briefcase in the middle of a move (``BriefcaseMovingError``: the target still holds an
  ``incoming`` copy because the mover is between its commit point and its finalize, or a
  reshard froze the partition, or its map apply has re-stamped the shard before the map is
  published): wait with exponential backoff, up to ``move_wait_seconds``, then raise that
  (retryable) error; in the map apply's case re-read the map before each try.
- any other stale route (a re-stamped layout after a map apply, a learned location that no
  longer holds a ``resident`` record): forget what was learned, re-read the map (cheap: the
  relocation directory is not read), try again; at most ``max_stale_retries`` times.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from mdb.backoff import Backoff, BackoffPolicy
from mdb.errors import BriefcaseMovingError, RetryableError, StaleRouteError
from mdb.gdid import GDID
from mdb.router import Placement, Router

__all__ = ["LearnedRoutes", "MOVE_WAIT", "PLACEMENT_CACHE_SIZE", "RouteCache", "RoutedOpen", "Step", "ROUTE_CACHE_SIZE", "MAX_FENCE_HOPS"]

ROUTE_CACHE_SIZE = 16_384
"""Locations a Store remembers by default (least recently used dropped first): about 2 MB.
Only briefcases that live off their default shard are kept; the rest route by the map."""

PLACEMENT_CACHE_SIZE = 4_096
"""Briefcase sessions whose routing a Store keeps for the next session of the same briefcase
(:class:`RouteCache`; then it starts over): about 3 MB."""

MOVE_WAIT = BackoffPolicy(first=0.01, cap=0.5)
"""How an open waits out a briefcase in the middle of a move (up to ``move_wait_seconds``)."""

MAX_FENCE_HOPS = 16
"""Fences one session open follows before it gives up: each names where the briefcase went
next, so a longer chain means a fence points back (a bug worth seeing, never looped on)."""


class LearnedRoutes:
    """Where briefcases that left their default shard were last found: a bounded LRU, shared by a Store's sessions.

    Its size, not the number of briefcases moved, bounds what a process holds. An entry is a
    hint: the shard it names checks ownership like any other, and a wrong one costs a retry.
    Keys are (area, era, raw id): a tuple of a string and ints, which the garbage collector stops
    tracking, so a full LRU (filled by every reshard) does not lengthen the application's own
    full collections as 16,384 GDID objects and their tuples would (about +25% measured).
    """

    def __init__(self, capacity: int = ROUTE_CACHE_SIZE) -> None:
        if capacity < 0:
            raise ValueError(f"route cache size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, int, int], str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, area: str, gdid: GDID) -> str | None:
        if not self._entries:
            return None  # the common case (nothing learned): every session asks, so no tuple and no lock
        key = (area, gdid.era, gdid.raw_id)
        with self._lock:
            server = self._entries.get(key)
            if server is not None:
                self._entries.move_to_end(key)
            return server

    def learn(self, area: str, gdid: GDID, server: str) -> None:
        if not self.capacity:
            return
        key = (area, gdid.era, gdid.raw_id)
        with self._lock:
            self._entries[key] = server
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def forget(self, area: str, gdid: GDID) -> None:
        with self._lock:
            self._entries.pop((area, gdid.era, gdid.raw_id), None)

    def __len__(self) -> int:
        return len(self._entries)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RouteCache(Generic[K, V]):
    """What a Store derived from the routing of a briefcase session, kept for the next session of
    that briefcase: bounded (it starts over when full), valid only under the router it was
    computed with and while the briefcase's own learned location (:class:`LearnedRoutes`, None
    when none) is the one it was computed from. Locations learned for other briefcases leave it
    valid: during a reshard every process learns thousands, and a global invalidation would drop
    every kept route on each of them.

    A route is kept from the second session of its key within the doorkeeper's window (the
    hashes of keys seen once, up to twice the capacity, then it starts over): an application that
    reads briefcases spread over millions meets most once, and keeping each of their routes
    (about ten objects that outlive the young generations) made the application's own full
    collections run once per ~10,000 sessions instead of never (docs/dev/0019).

    A hit is exactly what the policy would compute again: :meth:`RoutedOpen.placement` is a pure
    function of the router and the learned routes, and a refresh makes a new router. It only
    saves computing it; the session still checks ownership on its shard in its own transaction,
    so an entry made stale by a move this process has not met yet is refused there as a stale
    router is, and the refusal is handled by the same loop (docs/dev/0019).
    """

    __slots__ = ("capacity", "_entries", "_seen")

    def __init__(self, capacity: int = PLACEMENT_CACHE_SIZE) -> None:
        if capacity < 0:
            raise ValueError(f"placement cache size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: dict[K, tuple[Router, str | None, V]] = {}
        self._seen: set[int] = set()  # the doorkeeper: ints, which the collector does not track

    def get(self, key: K, router: Router, learned: str | None) -> V | None:
        """The value kept for ``key`` if it was computed under ``router`` from the learned location ``learned``."""
        entry = self._entries.get(key)
        if entry is None or entry[0] is not router or entry[1] != learned:
            return None
        return entry[2]

    def put(self, key: K, router: Router, learned: str | None, value: V) -> None:
        """Keep ``value`` for ``key`` if the key was seen before (or is kept already); else remember its hash."""
        entries = self._entries
        if key not in entries:
            if not self.capacity:
                return
            seen, h = self._seen, hash(key)
            if h not in seen:
                if len(seen) >= 2 * self.capacity:
                    seen.clear()
                seen.add(h)
                return
            seen.discard(h)
            if len(entries) >= self.capacity:
                entries.clear()  # (as the CENTRAL key cache: no per-hit bookkeeping, as an LRU would need)
        entries[key] = (router, learned, value)

    def clear(self) -> None:
        """Drop every entry (a refresh: the old router's entries could never be hit again).
        The doorkeeper's hashes stay: a key seen before the refresh is kept at its next session."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True, slots=True)
class Step:
    """What the loop does before its next attempt: sleep ``delay`` seconds, then refresh the map if ``refresh``."""

    delay: float = 0.0
    refresh: bool = False


class RoutedOpen:
    """The routing and retry policy of one session open (sans-IO: the caller opens, sleeps and refreshes).

    Every session open makes one, so making it costs attribute stores only: the wait for a move
    (its :class:`~mdb.backoff.Backoff`, the clock read that starts its deadline) is set up by the
    first refusal that asks for one, and ``move_wait_seconds`` is counted from that refusal.

    ``first``: a placement a :class:`RouteCache` kept for this briefcase and the router it was
    computed under; the first attempt goes there without computing it again when the loop's
    router is that one. What follows a refusal there is what follows any refusal. ``learned``:
    the briefcase's learned location the kept placement was checked against.
    """

    __slots__ = ("routes", "area", "gdid", "waits", "refusals", "learned", "_move_wait", "_clock", "_backoff",
                 "_stale_left", "_hops_left", "_followed", "_router", "_first")

    def __init__(
        self, routes: LearnedRoutes, area: str, gdid: GDID, *, move_wait_seconds: float, max_stale_retries: int,
        clock: Callable[[], float] = time.monotonic, first: tuple[Router, Placement] | None = None,
        learned: str | None = None,
    ) -> None:
        self.routes = routes
        self.area = area
        self.gdid = gdid
        self._move_wait = move_wait_seconds
        self._clock = clock
        self._backoff: Backoff | None = None  # the first move refusal starts the wait
        self._stale_left = max_stale_retries
        self._hops_left = MAX_FENCE_HOPS
        self._followed: str | None = None  # where the last fence sent this open (whatever the cache keeps)
        self._router: Router | None = None  # the router of the last placement (its map's servers are known)
        self._first = first
        self.waits = 0
        """Refusals waited out (a move or a freeze in progress): counted, not raised."""
        self.refusals = 0
        """Refusals met so far: a placement confirmed at the first attempt may be kept (:class:`RouteCache`)."""
        self.learned = learned
        """The briefcase's learned location the last placement was computed from (None: none)."""

    def placement(self, router: Router) -> Placement:
        """Where to try: a learned location when there is one, else the map's default shard."""
        self._router = router
        first = self._first
        if first is not None:
            self._first = None
            if first[0] is router:
                return first[1]
        learned = self._followed or self.routes.get(self.area, self.gdid)
        self.learned = learned
        if learned is None:
            return router.default_placement(self.area, self.gdid)
        if learned not in router.map.servers:
            return router.default_placement(self.area, self.gdid)
        return router.placement_on(self.area, self.gdid, learned)

    def refused(self, placement: Placement, exc: RetryableError) -> Step:
        """The next step after ``placement`` refused the session with ``exc``; raises ``exc`` when the budget is spent."""
        self.refusals += 1
        if isinstance(exc, StaleRouteError) and exc.moved_to is not None:
            if self._hops_left <= 0:
                raise exc
            self._hops_left -= 1
            self._followed = exc.moved_to
            router = self._router
            if router is None or exc.moved_to not in router.map.servers:
                # a server added by a map this process has not read yet: read it, then go there
                if self._stale_left <= 0:
                    raise exc
                self._stale_left -= 1
                return Step(refresh=True)
            if exc.moved_to == placement.default_server:
                self.routes.forget(self.area, self.gdid)  # back home: the map routes it
            else:
                self.routes.learn(self.area, self.gdid, exc.moved_to)
            return Step()
        if isinstance(exc, BriefcaseMovingError):
            backoff = self._backoff
            if backoff is None:
                backoff = self._backoff = MOVE_WAIT.within(self._move_wait, self._clock)
            delay = backoff.next_delay()
            if delay is None:
                raise exc
            self.waits += 1
            return Step(delay=delay, refresh=exc.refresh)
        if self._stale_left <= 0:
            raise exc
        self._stale_left -= 1
        self._followed = None
        self.routes.forget(self.area, self.gdid)
        return Step(refresh=True)
