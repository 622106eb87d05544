"""Pools registering while another thread makes room: the set of pools is read as a snapshot under a lock."""

from __future__ import annotations

import threading
from typing import Any

from mdb.budget import ConnectionBudget


class _IdlePool:
    """Stands in for a BudgetPool in the budget's pool set: never has an idle connection."""

    def __init__(self, instance: str) -> None:
        self.instance = instance

    def oldest_idle(self) -> float | None:
        return None


def test_pools_registering_while_room_is_made_never_break_the_scan() -> None:
    for _ in range(5):  # the race is narrow: one round caught it about one time in three
        _one_round()


def _one_round() -> None:
    budget = ConnectionBudget(per_instance=1)
    keep: list[Any] = []  # the set holds pools weakly: keep them alive so it only grows
    errors: list[BaseException] = []
    stop = threading.Event()

    def register() -> None:
        try:
            for n in range(20_000):
                pool = _IdlePool(f"i{n % 7}")
                keep.append(pool)
                budget.register(pool)  # type: ignore[arg-type]
        except BaseException as exc:  # reported below, not swallowed
            errors.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=register)
    thread.start()
    scans = 0
    try:
        while not stop.is_set():
            assert budget._shed(None) is False  # nothing idle anywhere
            scans += 1
    except BaseException as exc:
        errors.append(exc)
    thread.join()
    assert not errors, errors
    assert scans > 0
