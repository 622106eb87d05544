"""The Store's retry budget for refused sessions (SQL and document briefcases share it)."""

from __future__ import annotations

import pytest

from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.retry import SessionRetry


def test_stale_routes_are_retried_max_stale_retries_times_then_raised() -> None:
    retry = SessionRetry(move_wait_seconds=30, max_stale_retries=2)
    exc = StaleRouteError("briefcase user/0:0:1 on server 'u1': fenced")
    retry.wait_or_raise(exc)
    retry.wait_or_raise(exc)
    with pytest.raises(StaleRouteError) as raised:
        retry.wait_or_raise(exc)
    assert raised.value is exc


def test_a_move_is_waited_for_only_within_move_wait_seconds() -> None:
    exc = BriefcaseMovingError("briefcase user/0:0:1 on server 'u1': a move into this server is not finished yet")
    with pytest.raises(BriefcaseMovingError):
        SessionRetry(move_wait_seconds=0, max_stale_retries=3).wait_or_raise(exc)
    patient = SessionRetry(move_wait_seconds=60, max_stale_retries=0)
    for _ in range(3):  # waits (10, 20, 40 ms) without spending the stale budget
        patient.wait_or_raise(exc)
    with pytest.raises(StaleRouteError):
        patient.wait_or_raise(StaleRouteError("stale"))
