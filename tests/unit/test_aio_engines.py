"""mdb.aio.engines._at_once: driver coroutines run in place when they do not wait, on the loop when they do."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.util import greenlet_spawn

from mdb.aio.engines import _at_once


async def ready(value: int) -> int:
    return value + 1


async def waiting(value: int, steps: list[str]) -> int:
    steps.append("before")
    try:
        await asyncio.sleep(0.01)
        await asyncio.sleep(0)
    except asyncio.CancelledError:
        steps.append("cancelled")
        raise
    steps.append("after")
    if value < 0:
        raise ValueError("negative")
    return value * 2


def test_a_coroutine_that_never_waits_runs_in_place_without_a_loop() -> None:
    assert _at_once(ready(41)) == 42  # no greenlet, no loop: await_ would raise MissingGreenlet here


def test_a_coroutine_that_waits_is_finished_on_the_loop_with_its_result_or_error() -> None:
    async def main() -> tuple[int, list[str]]:
        steps: list[str] = []
        got = await greenlet_spawn(_at_once, waiting(21, steps))
        with pytest.raises(ValueError, match="negative"):
            await greenlet_spawn(_at_once, waiting(-1, []))
        return got, steps

    assert asyncio.run(main()) == (42, ["before", "after"])


def test_a_cancellation_reaches_the_waiting_coroutine() -> None:
    async def main() -> list[str]:
        steps: list[str] = []
        task = asyncio.create_task(greenlet_spawn(_at_once, waiting(1, steps)))
        while not steps:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return steps

    assert asyncio.run(main()) == ["before", "cancelled"]
