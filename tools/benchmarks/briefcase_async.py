"""Async routed point read (``tools/bench.py briefcase_async``): AsyncStore vs a plain AsyncSession.

1. Latency (wall time, and this process's CPU time per read): one briefcase session reading one row by GDID (``AsyncStore.briefcase``: routing,
   the ownership check carried by BEGIN, the confining criteria) vs what an async application
   without mdb writes, ``AsyncSession(engine)`` on the SAME async engine (same pool, same
   psycopg async driver), one read after the other on one event loop, alternating rounds.
2. Throughput: 200 concurrent readers (asyncio tasks, one event loop) vs the sync
   ``Store.briefcase`` from 8 threads; reads per second, the same rows.

PostgreSQL only: the async SQLite driver (aiosqlite) runs every call on its own thread, so its
figures measure that thread hop, not mdb.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from benchmarks import BenchContext, Result
from benchmarks.briefcase import NOW, ROWS, _store
from mdb.aio import AsyncStore
from mdb.demo.models import User, UserBriefcase
from mdb.gdid import GDID
from mdb.store import Store

CONCURRENT = 200
THREADS = 8


async def _per_call(fn: Callable[[], Awaitable[object]], iterations: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) per call."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        await fn()
    return (time.perf_counter() - start) / iterations, (time.process_time() - cpu) / iterations


async def _compare(subject: Callable[[], Awaitable[object]], baseline: Callable[[], Awaitable[object]],
                   iterations: int, rounds: int, warmup: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median (wall, CPU) seconds per call of subject and of baseline in alternating rounds (as benchmarks.compare)."""
    await _per_call(subject, warmup)
    await _per_call(baseline, warmup)
    subject_times, baseline_times = [], []
    for _ in range(rounds):
        subject_times.append(await _per_call(subject, iterations))
        baseline_times.append(await _per_call(baseline, iterations))
    return _medians(subject_times), _medians(baseline_times)


def _medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def run(ctx: BenchContext) -> list[Result]:
    central, shard = ctx.pg_urls(2)
    store = _store(ctx.tmpdir / "async-postgresql", central, shard)
    ids = [GDID(0, 0, i) for i in range(1, ROWS + 1)]
    with store.transaction("u1") as conn:
        conn.execute(insert(User), [{"user_id": g, "email": f"{g}@example.com", "name": f"user {g}", "created_at": NOW} for g in ids])
    order = ids * 20
    random.Random(7).shuffle(order)
    cursor = iter(order * 1000)
    iterations, rounds, warmup = ctx.iterations(2000, 200), ctx.iterations(5, 2), ctx.iterations(300, 50)
    total = ctx.iterations(20_000, 2000)

    async def measure() -> list[Result]:
        aio = AsyncStore(store)
        await aio.router()
        engine = aio.engines.engine("u1", readonly=True)

        async def routed() -> object:
            g = next(cursor)
            async with aio.briefcase(UserBriefcase, g, readonly=True) as session:
                return (await session.scalars(select(User).where(User.user_id == g))).one()

        async def plain() -> object:
            g = next(cursor)
            async with AsyncSession(engine) as session, session.begin():
                return (await session.scalars(select(User).where(User.user_id == g))).one()

        for g in ids * 2:  # the steady state: every briefcase's route kept (as benchmarks.briefcase does)
            async with aio.briefcase(UserBriefcase, g, readonly=True) as session:
                (await session.scalars(select(User).where(User.user_id == g))).one()
        (value, value_cpu), (base, base_cpu) = await _compare(routed, plain, iterations, rounds, warmup)
        results = [Result(
            "briefcase_async", "postgresql: async routed point read (readonly session)", value * 1e6, "µs/read",
            "plain AsyncSession on the same async engine", base * 1e6, f"{iterations} reads x {rounds} rounds, median",
        ), Result(
            # The client's own CPU per read (the loop's thread; the servers are other processes):
            # what mdb adds, with less of the scheduling noise of a busy machine in it than the wall time.
            "briefcase_async", "postgresql: async routed point read, client CPU", value_cpu * 1e6, "µs/read",
            "plain AsyncSession, client CPU", base_cpu * 1e6, "same rounds; time.process_time of this process",
        )]

        async def reader(share: int) -> None:
            for _ in range(share):
                await routed()

        await asyncio.gather(*(reader(warmup // CONCURRENT + 1) for _ in range(CONCURRENT)))
        start = time.perf_counter()
        await asyncio.gather(*(reader(total // CONCURRENT) for _ in range(CONCURRENT)))
        async_rate = total / (time.perf_counter() - start)
        await aio.close()
        return results + [Result(
            "briefcase_async", f"postgresql: {CONCURRENT} concurrent async readers", async_rate, "reads/s",
            f"sync Store.briefcase, {THREADS} threads", _sync_rate(store, cursor, total, warmup),
            f"{total} routed readonly point reads each; one event loop vs a thread pool", better="higher",
        )]

    try:
        return asyncio.run(measure())
    finally:
        store.close()


def _sync_rate(store: Store, cursor: Iterator[GDID], total: int, warmup: int) -> float:
    """Reads per second of the sync API from a pool of THREADS threads (next() on the shared
    iterator is atomic under the GIL)."""

    def read(_: int) -> object:
        g = next(cursor)
        with store.briefcase(UserBriefcase, g, readonly=True) as session:
            return session.scalars(select(User).where(User.user_id == g)).one()

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(read, range(warmup)))
        start = time.perf_counter()
        list(pool.map(read, range(total)))
        return total / (time.perf_counter() - start)
