"""GdidGenerator.try_next/try_take (never wait on the database) and AsyncGdids built on them.

The reserver here is a counter in memory (the database side is tests/postgres/test_idgen_pg.py's): what
is tested is when a reservation happens and on which thread, which a database would only hide.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

import mdb.aio.store as aio_store
from mdb.aio import AsyncGdids
from mdb.gdid import GDID
from mdb.idgen import Block, GdidGenerator

T = TypeVar("T")


class Reserver:
    """Hands out consecutive blocks of era 0; counts calls, optionally holds them until released."""

    def __init__(self, hold: bool = False) -> None:
        self.next = 1
        self.calls: list[int] = []
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self._lock = threading.Lock()

    def __call__(self, size: int) -> Block:
        self.entered.set()
        self.release.wait()
        with self._lock:
            block = Block(0, self.next, self.next + size - 1)
            self.next += size
            self.calls.append(size)
            self.threads.append(threading.current_thread().name)
        return block


def counters(gdids: list[GDID]) -> list[int]:
    return [g.counter for g in gdids]


def test_try_next_hands_out_reserved_ids_only_and_never_reserves() -> None:
    reserve = Reserver()
    gen = GdidGenerator(reserve, authority=0, block_size=4, prefetch=False)
    assert gen.try_next() is None and gen.try_take(1) is None
    assert reserve.calls == []  # nothing reserved in the foreground
    first = gen.next()  # the one call that reserves
    rest = [gen.try_next() for _ in range(3)]
    assert all(g is not None for g in rest)
    assert counters([first, *(g for g in rest if g is not None)]) == [1, 2, 3, 4]
    assert gen.try_next() is None  # the block is used up; still nothing reserved
    assert reserve.calls == [4]
    assert gen.next().counter == 5  # next() reserves again, past the used block


def test_try_take_takes_all_or_nothing_across_reserved_blocks() -> None:
    reserve = Reserver()
    gen = GdidGenerator(reserve, authority=0, block_size=10, prefetch=False)
    gen.take(3)  # block 1..10 reserved, 4..10 left
    assert gen.try_take(8) is None  # only 7 reserved: none taken
    got = gen.try_take(7)
    assert got is not None and counters(got) == list(range(4, 11))
    assert gen.try_take(0) == [] and gen.try_take(1) is None
    assert len(reserve.calls) == 1
    with pytest.raises(ValueError):
        gen.try_take(-1)


def test_try_next_moves_into_prefetched_blocks_without_reserving_in_the_foreground() -> None:
    reserve = Reserver()
    gen = GdidGenerator(reserve, authority=0, block_size=10, prefetch=True)
    ids = [gen.next()]  # block 1..10, reserved by this thread
    for _ in range(3):  # past each block's low-water mark a prefetch starts in the background
        while (got := gen.try_next()) is not None:
            ids.append(got)
        assert gen.wait_idle(30)
    while (got := gen.try_next()) is not None:
        ids.append(got)
    assert counters(ids) == list(range(1, len(ids) + 1))  # through the queued blocks, no gap
    assert len(ids) > 10 and len(reserve.calls) >= 2
    assert reserve.threads[0] == threading.current_thread().name
    assert all(name.startswith("mdb-gdid-prefetch") for name in reserve.threads[1:])


def test_try_next_does_not_wait_for_a_reservation_in_flight() -> None:
    """A reservation that does not return: try_next answers None at once (a blocking call would
    hang here until pytest's timeout), and the block serves the callers after it arrives."""
    reserve = Reserver(hold=True)
    gen = GdidGenerator(reserve, authority=0, block_size=4, prefetch=True)
    assert gen.try_next() is None  # starts the prefetch, which now hangs in the reserver
    assert reserve.entered.wait(30)
    assert gen.try_next() is None and gen.try_take(2) is None
    reserve.release.set()
    assert gen.wait_idle(30)
    got = gen.try_take(4)
    assert got is not None and counters(got) == [1, 2, 3, 4]
    assert reserve.threads and all(name == "mdb-gdid-prefetch gdid" for name in reserve.threads)


def test_async_gdids_hop_to_a_thread_only_to_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the loop while a block is reserved; one worker-thread call per foreground reservation."""
    hops: list[str] = []
    real = asyncio.to_thread

    def counted(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Awaitable[T]:
        hops.append(getattr(fn, "__name__", "?"))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(aio_store.asyncio, "to_thread", counted)
    reserve = Reserver()
    ids = AsyncGdids(GdidGenerator(reserve, authority=0, block_size=5, prefetch=False))

    async def main() -> list[GDID]:
        single = [await ids.next() for _ in range(12)]
        return single + await ids.take(3) + await ids.take(6)

    got = asyncio.run(main())
    assert counters(got) == list(range(1, 22))
    # One hop per reservation (each in the worker thread), none for ids already reserved; the
    # last reservation is take(6)'s: 12 + 3 ids fit in the blocks before it (5, then 10).
    assert len(hops) == len(reserve.calls) >= 2 and hops[-1] == "take" and set(hops[:-1]) == {"next"}
    assert sum(reserve.calls[:-1]) >= 15 and threading.current_thread().name not in reserve.threads
