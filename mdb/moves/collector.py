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
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

__all__ = ["collection_deferred"]


class _Deferral:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._restore = False

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if not self._holders:
                self._restore = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if not self._holders and self._restore:
                    gc.enable()


_deferral = _Deferral()


def collection_deferred() -> AbstractContextManager[None]:
    """Automatic garbage collection off for the block (and any block of another thread overlapping it)."""
    return _deferral.held()
