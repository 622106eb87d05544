"""One backoff policy for every wait of mdb that retries until a deadline (sans-IO).

A :class:`BackoffPolicy` says how delays grow (first delay, factor, cap); a :class:`Backoff`
is one wait under it, with its deadline and its clock. It only computes: the caller tries,
asks :meth:`Backoff.next_delay`, and sleeps the way it can (``time.sleep``, an event loop, a
test's fake clock), so the same policy serves sync and async code and tests need no sleeping.
Users: the routed open waiting out a move (:mod:`mdb.retry`), a connect refused for capacity
(:func:`mdb.budget.connect_patiently`), a move waiting for its briefcases' locks
(``mdb.moves.sql_steps.locked_briefcases``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Backoff", "BackoffPolicy", "Clock"]

Clock = Callable[[], float]
"""Seconds on a monotonic scale (``time.monotonic``, or a test's fake)."""


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """Delays that start at ``first`` seconds and grow by ``factor`` up to ``cap``."""

    first: float
    cap: float
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap or self.factor < 1:
            raise ValueError(f"backoff needs 0 < first <= cap and factor >= 1, got {self}")

    def until(self, deadline: float, clock: Clock = time.monotonic) -> Backoff:
        """A wait that gives up when the next delay would end past ``deadline`` (on ``clock``'s scale)."""
        return Backoff(self, deadline, clock)

    def within(self, seconds: float, clock: Clock = time.monotonic) -> Backoff:
        """A wait of at most ``seconds`` from now."""
        return Backoff(self, clock() + seconds, clock)


class Backoff:
    """One wait under a :class:`BackoffPolicy`: how long to sleep before each next try."""

    __slots__ = ("policy", "deadline", "waits", "_clock", "_delay")

    def __init__(self, policy: BackoffPolicy, deadline: float, clock: Clock) -> None:
        self.policy = policy
        self.deadline = deadline
        self.waits = 0
        """Delays handed out so far."""
        self._clock = clock
        self._delay = policy.first

    def next_delay(self) -> float | None:
        """Seconds to sleep before the next try; None when sleeping them would pass the deadline (give up)."""
        delay = self._delay
        if self._clock() + delay > self.deadline:
            return None
        self._delay = min(delay * self.policy.factor, self.policy.cap)
        self.waits += 1
        return delay
