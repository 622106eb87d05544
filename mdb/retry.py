"""How a Store reacts when a shard refuses a briefcase session (docs/design.md invariant 2).

Two kinds of refusal, two reactions. ``StaleRouteError``: this process routed with an old map
or relocation cache; refresh and try again, a few times at most (more would mean the refresh
does not help, which is a bug worth seeing). ``BriefcaseMovingError``: a move or a reshard's
freeze holds the briefcase; wait with exponential backoff up to the Store's
``move_wait_seconds``, then give up with that error (still retryable for the caller).
SQL and document briefcases share this one policy.
"""

from __future__ import annotations

import time

from mdb.errors import BriefcaseMovingError, RetryableError

__all__ = ["SessionRetry"]


class SessionRetry:
    """The retry budget of one ``Store.briefcase(...)`` call."""

    def __init__(self, move_wait_seconds: float, max_stale_retries: int) -> None:
        self._deadline = time.monotonic() + move_wait_seconds
        self._delay = 0.01
        self._stale_left = max_stale_retries

    def wait_or_raise(self, exc: RetryableError) -> None:
        """Sleep before the next attempt, or re-raise ``exc`` when the budget is spent."""
        if isinstance(exc, BriefcaseMovingError):
            if time.monotonic() + self._delay > self._deadline:
                raise exc
            time.sleep(self._delay)
            self._delay = min(self._delay * 2, 0.5)
            return
        if self._stale_left <= 0:
            raise exc
        self._stale_left -= 1
