"""Python's cyclic garbage collector kept out of write pauses.

A full (generation 2) collection walks every object the process holds: the models, the
SQLAlchemy and psycopg modules, a reshard's plan. Measured in the mover of a 10,000-briefcase
reshard, one took 52-73 ms, five times in ten seconds; one landing while a batch held its
briefcases' write locks turned a 28 ms pause into 80-100 ms, and those were the reshard's p99.
So while any cutover of this process holds write locks, automatic collection waits; it runs
when the last one lets go. A cutover is bounded by ``max_pause``, so the wait is too, and
reference counting still frees all acyclic garbage meanwhile.

Process-wide, because the collector is: cutovers of parallel workers nest, and the collector is
enabled again only when none is left, and only if it was enabled when the first began (an
application that runs with it off keeps it off).

The deferral does not cover what follows a cutover: between a batch's commit point and its
finalize the application waits for the batch's briefcases, and a full collection there is a
wait too. How long one takes grows with the heap, and a reshard's plan is most of the heap: a
million-briefcase reshard holds ~670,000 planned moves, and a full collection of that mover
took 0.5-0.7 s (2 cores, idle; one application read waited 2.2 s at a million in
``tools/bench.py reshard_impact``). The plan lives as long as the moves, and none of it is
cyclic garbage, so :func:`long_lived_frozen` moves everything alive when the moves begin out
of the collector's sight (``gc.freeze``) until they end (``gc.unfreeze``); collections then walk
only what was allocated since. Acyclic garbage is still freed by reference counting (the plan
is freed when the reshard drops it); a cycle among the frozen objects that becomes garbage
during the moves is collected after them. ``gc.unfreeze`` releases every frozen object, so in a
process that had frozen objects of its own before (the ``mdb`` command freezes its start-up),
nothing is unfrozen: there such a cycle is never collected, which a command that ends after its
reshard does not notice.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

__all__ = ["collection_deferred", "long_lived_frozen"]


class _Overlapping:
    """A process-wide setting held by overlapping blocks of any threads: ``first`` when the first
    block begins (it answers whether ``last`` should undo it), ``every`` as each begins, ``last``
    when the last one ends."""

    def __init__(self, first: Callable[[], bool], every: Callable[[], None], last: Callable[[], None]) -> None:
        self._first, self._every, self._last = first, every, last
        self._lock = threading.Lock()
        self._holders = 0
        self._restore = False

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if not self._holders:
                self._restore = self._first()
            self._every()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if not self._holders and self._restore:
                    self._last()


def _disable() -> bool:
    enabled = gc.isenabled()  # an application that runs with the collector off keeps it off
    gc.disable()
    return enabled


def _nothing_frozen() -> bool:
    # gc.unfreeze is all or nothing: undo the freeze only where nothing was frozen before
    # (the `mdb` command froze its start-up for good, so there the plan stays frozen too)
    return gc.get_freeze_count() == 0


_deferral = _Overlapping(_disable, lambda: None, gc.enable)
_freeze = _Overlapping(_nothing_frozen, gc.freeze, gc.unfreeze)


def collection_deferred() -> AbstractContextManager[None]:
    """Automatic garbage collection off for the block (and any block of another thread overlapping it)."""
    return _deferral.held()


def long_lived_frozen() -> AbstractContextManager[None]:
    """Every object alive now left out of collections until the block (and any overlapping one) ends."""
    return _freeze.held()
