"""The one backoff policy (mdb.backoff), sans I/O: delays and deadlines on a fake clock, no sleeping.

RoutedOpen's use of it is in test_retry.py; here the policy itself and ``connect_patiently``,
whose sleeps advance the same fake clock that decides when it gives up.
"""

from __future__ import annotations

import pytest

from mdb.backoff import BackoffPolicy
from mdb.budget import CAPACITY_WAIT, connect_patiently
from mdb.testing import FakeClock


def test_delays_grow_to_the_cap_and_stop_before_the_deadline() -> None:
    clock = FakeClock()
    wait = BackoffPolicy(first=0.1, cap=0.4).within(1.3, clock)
    while (delay := wait.next_delay()) is not None:
        clock.sleep(delay)
    assert clock.slept == [0.1, 0.2, 0.4, 0.4]  # 1.1 s; a fifth 0.4 would end past the 1.3 s
    assert clock.now + 0.4 > wait.deadline and wait.waits == 4


def test_no_wait_is_handed_out_once_the_deadline_has_passed() -> None:
    clock = FakeClock()
    wait = BackoffPolicy(first=0.1, cap=1.0).until(clock.now + 5, clock)
    clock.now += 10  # the caller's own tries took the time
    assert wait.next_delay() is None and wait.waits == 0


@pytest.mark.parametrize("first, cap, factor", [(0, 1, 2), (2, 1, 2), (0.1, 1, 0.5)])
def test_a_policy_that_could_not_end_or_grow_is_refused(first: float, cap: float, factor: float) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        BackoffPolicy(first=first, cap=cap, factor=factor)


class Refusing:
    """A connect that the server refuses for capacity ``times`` times, then accepts."""

    def __init__(self, times: int) -> None:
        self.left = times

    def __call__(self) -> str:
        if self.left:
            self.left -= 1
            raise OSError("FATAL:  sorry, too many clients already")
        return "connection"


def test_a_full_server_is_retried_with_the_capacity_backoff_until_it_has_room() -> None:
    clock = FakeClock()
    assert connect_patiently(Refusing(3), clock.now + 10, "db:5432", sleep=clock.sleep, clock=clock) == "connection"
    assert clock.slept == [CAPACITY_WAIT.first, CAPACITY_WAIT.first * 2, CAPACITY_WAIT.first * 4]


def test_a_server_full_past_the_deadline_raises_its_last_refusal() -> None:
    clock = FakeClock()
    with pytest.raises(OSError, match="too many clients"):
        connect_patiently(Refusing(1000), clock.now + 3, "db:5432", sleep=clock.sleep, clock=clock)
    assert sum(clock.slept) <= 3 and clock.slept[-1] == CAPACITY_WAIT.cap


def test_any_other_connect_error_is_raised_at_once() -> None:
    clock = FakeClock()

    def down() -> str:
        raise OSError("connection refused")

    with pytest.raises(OSError, match="refused"):
        connect_patiently(down, clock.now + 10, "db:5432", sleep=clock.sleep, clock=clock)
    assert clock.slept == []
