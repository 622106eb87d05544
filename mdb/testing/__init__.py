"""Helpers for mdb's own tests and benchmarks (not used by the router at run time).

Kept out of ``mdb/__init__`` so that importing mdb never needs the ``test`` extra. The test
hooks that production code carries (``MDB_FAULT_POINT`` crash points, the CLI's file-backed
MongoDB fake) act only in a process this package armed: :func:`arm`.
"""

from __future__ import annotations

import os

from mdb.faults import TESTING_ENV

__all__ = ["FakeClock", "arm"]


class FakeClock:
    """A monotonic clock for sans-IO policies (:mod:`mdb.backoff`, :mod:`mdb.retry`): time passes
    only when the test says so or :meth:`sleep` is called, and every sleep is recorded."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def arm() -> None:
    """Switch the environment's test hooks on for this process and every process it starts.

    Sets ``MDB_TESTING=1`` (tests/support/plugin.py calls it once): from then on ``MDB_FAULT_POINT``
    and ``MDB_MONGO_FAKE_DIR`` in a process's environment take effect; without it mdb ignores them.
    """
    os.environ[TESTING_ENV] = "1"
