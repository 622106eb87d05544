"""Async engines under the connection budget (mdb.aio.engines.AsyncBudgetPool, mdb.budget), on real PostgreSQL.

Every test runs its own small PostgreSQL server (tests/postgres/test_budget.py's ``small_server``), so
its connections are this process's only and can be counted on the server as well.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.mapfiles import map_dict
from sqlalchemy import event, insert, select, text
from sqlalchemy.pool import Pool
from support.budget import fill, settled_connections_to, refusals, small_server, write_budget_map  # noqa: F401 (refusals, small_server: the suite's fixtures)

from mdb.aio import AsyncStore
from mdb.aio.engines import AsyncBudgetPool
from mdb.budget import instance_of
from mdb.demo.models import User, UserBriefcase
from mdb.errors import CapacityError, RetryableError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.testing.postgres import PostgresServer
from mdb.urls import sqlalchemy_url

SHARDS = [f"s{i}" for i in range(6)]


def shard_store(server: PostgresServer, tmp_path: Path, engine: dict[str, Any]) -> tuple[Store, str]:
    """CENTRAL and six shard databases on ``server`` (one instance), one user on each shard; the instance."""
    urls = {"c": server.create_database(), **{name: server.create_database() for name in SHARDS}}
    data = map_dict(urls, central=["c"], partitions=[("0:0:0", SHARDS)])
    data["engine_defaults"] = engine
    data["models"] = ["mdb.demo.models"]
    path = tmp_path / "map.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    store = Store.from_yaml(path, types=[UserBriefcase])
    assert all(r.ok for r in apply_schema(store))
    for i, name in enumerate(SHARDS):  # written directly: the fan-out reads whatever each shard holds
        with store.transaction(name) as conn:
            conn.execute(insert(User).values(user_id=GDID(0, 0, 100 + i), email=f"{i}@example.com", name=f"user {i}"))
    instance = instance_of(sqlalchemy_url(urls["c"]))
    assert instance is not None
    return store, instance


def async_records(aio: AsyncStore) -> int:
    """Connections the AsyncStore's pools hold (idle or in use), by the pools' own count."""
    total = 0
    for engine in aio.engines.all():
        pool = engine.sync_engine.pool
        assert isinstance(pool, AsyncBudgetPool)
        total += pool.checkedout() + pool.checkedin()
    return total


class Live:
    """Driver connections open in this process, counted by SQLAlchemy's pool events (not by the
    budget): +1 once connected, -1 when closing starts; ``peak`` is exact, no sampling."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self._lock = threading.Lock()

    def connected(self, _dbapi: Any, _record: Any) -> None:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def closed(self, _dbapi: Any, _record: Any) -> None:
        with self._lock:
            self.now -= 1


@pytest.fixture
def live() -> Iterator[Live]:
    counter = Live()
    event.listen(Pool, "connect", counter.connected)
    event.listen(Pool, "close", counter.closed)
    yield counter
    event.remove(Pool, "connect", counter.connected)
    event.remove(Pool, "close", counter.closed)


@pytest.mark.slow  # 23 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_concurrent_async_fan_outs_over_more_shards_than_the_cap_wait_for_the_budget(
    small_server: Callable[[int], PostgresServer], tmp_path: Path, live: Live
) -> None:
    """8 concurrent fan-outs x 3 rounds over 6 shard databases of one instance, capped at 3
    connections: each completes with every shard's rows, and the process never holds more than 3."""
    cap = 3
    server = small_server(30)
    store, instance = shard_store(server, tmp_path, {"max_connections_per_instance": cap, "pool_timeout": 60})
    budget = store.engines.budget
    assert budget.open_connections(instance) > 0  # the sync pools keep idle connections: shed below

    live.peak = live.now  # count from here: the sync setup's idle connections are in ``now``

    async def main() -> list[list[GDID]]:
        async with AsyncStore(store) as aio:
            results = []
            for _ in range(3):
                rounds = await asyncio.gather(*(aio.fan_out("user", select(User.user_id)) for _ in range(8)))
                results += [sorted(r.user_id for r in out) for out in rounds]
                assert all(sorted(out.servers) == SHARDS and not out.failed for out in rounds)
                assert budget.open_connections(instance) <= cap
        return results

    try:
        with server.connect() as admin:
            results = asyncio.run(main())
            expected = [GDID(0, 0, 100 + i) for i in range(len(SHARDS))]
            assert results == [expected] * 24
            assert live.peak == cap  # reached (6 shards x 8 fan-outs wanted up to 48), never passed
            assert settled_connections_to(server, admin, cap) <= cap
    finally:
        store.close()


def test_a_full_budget_is_a_retryable_capacity_error_after_pool_timeout_and_the_loop_keeps_running(
    small_server: Callable[[int], PostgresServer], tmp_path: Path
) -> None:
    server = small_server(30)
    store, instance = shard_store(server, tmp_path, {"pool_timeout": 0.5})
    store.engines.budget.cap(instance, 1)  # after the setup, whose parallel schema apply needs more

    async def main() -> tuple[CapacityError, int, list[GDID]]:
        ticks = 0
        stop = asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        async with AsyncStore(store) as aio:
            ticker = asyncio.create_task(tick())
            async with aio.transaction("s0") as held:  # the one connection the cap allows, in use
                assert (await held.execute(text("SELECT 1"))).scalar() == 1
                before = ticks
                with pytest.raises(CapacityError) as raised:  # even with allow_partial: the shard is only busy
                    await aio.fan_out("user", select(User.user_id), allow_partial=True)
                waited = ticks - before
            out = await aio.fan_out("user", select(User.user_id))  # the connection came back: room again
            stop.set()
            await ticker
            return raised.value, waited, sorted(r.user_id for r in out)

    try:
        error, ticks_while_waiting, users = asyncio.run(main())
        assert isinstance(error, RetryableError) and error.instance == instance
        assert "cap of 1 connections" in str(error)
        assert ticks_while_waiting > 0  # other tasks ran while the fan-out waited for the budget
        assert users == [GDID(0, 0, 100 + i) for i in range(len(SHARDS))]
        assert store.engines.budget.open_connections(instance) <= 1
    finally:
        store.close()


@pytest.mark.slow  # 26 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_a_sync_waiter_makes_async_pools_close_idle_connections_on_their_loop(
    small_server: Callable[[int], PostgresServer], tmp_path: Path
) -> None:
    """The budget is full of idle async connections; a sync transaction in another thread needs
    one: the async pool hands its idle connection to its loop to close, and the sync one gets room."""
    cap = 2
    server = small_server(30)
    store, instance = shard_store(server, tmp_path, {"max_connections_per_instance": cap, "pool_timeout": 30})
    budget = store.engines.budget

    def sync_read() -> tuple[int, str]:
        with store.transaction("c") as conn:
            return int(conn.execute(text("SELECT 1")).scalar_one()), threading.current_thread().name

    async def main() -> tuple[int, int, tuple[int, str]]:
        async with AsyncStore(store) as aio:
            await aio.router()
            store.engines.dispose()  # the sync side holds nothing on the instance now
            await aio.fan_out("user", select(User.user_id))
            idle_async = async_records(aio)
            assert budget.open_connections(instance) == idle_async == cap
            got = await asyncio.to_thread(sync_read)
            return idle_async, async_records(aio), got

    try:
        with server.connect() as admin:
            idle_before, idle_after, (one, thread) = asyncio.run(main())
            assert one == 1 and thread != threading.current_thread().name
            assert idle_after == idle_before - 1  # one async connection closed to make room
            assert budget.open_connections(instance) <= cap and settled_connections_to(server, admin, cap) <= cap
    finally:
        store.close()


@pytest.mark.slow  # 23 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_idle_async_connections_are_closed_by_the_reaper_on_their_loop(
    small_server: Callable[[int], PostgresServer], tmp_path: Path
) -> None:
    server = small_server(30)
    # 2 s, not less: a connection the fan-out gave back must not be reaped before all six are counted.
    store, instance = shard_store(server, tmp_path, {"idle_timeout": 2.0})

    async def main() -> tuple[int, int]:
        async with AsyncStore(store) as aio:
            await aio.fan_out("user", select(User.user_id))
            opened = async_records(aio)
            deadline = time.monotonic() + 30  # generous: the reaper runs every second here
            while async_records(aio) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the loop runs: the reaper's closes are done on it
            return opened, async_records(aio)

    try:
        with server.connect() as admin:
            opened, left = asyncio.run(main())
            assert opened == len(SHARDS) and left == 0
            deadline = time.monotonic() + 30
            while store.engines.budget.open_connections(instance) and time.monotonic() < deadline:
                time.sleep(0.05)  # the sync pools' idle connections (schema, inserts) age out too
            assert store.engines.budget.open_connections(instance) == 0
            assert settled_connections_to(server, admin, 0) == 0
    finally:
        store.close()


def test_an_async_capacity_refusal_is_retried_on_the_loop_until_a_slot_frees(
    small_server: Callable[[int], PostgresServer], tmp_path: Path, refusals: Any
) -> None:
    """The server itself is full (other clients): the async connect is retried with backoff,
    sleeping on the loop, where another task frees a slot; then the transaction runs."""
    server = small_server(6)
    path = write_budget_map(tmp_path / "map.yaml", {"c": server.create_database()}, ["c"], {"pool_timeout": 60})
    held = fill(server)

    async def main() -> tuple[int, bool]:
        async def free_a_slot() -> bool:
            seen = await asyncio.to_thread(refusals.seen.wait, 60)
            held.pop().close()  # one slot frees: the next retry gets it
            return seen

        async with AsyncStore.from_yaml(path, types=[]) as aio:
            freer = asyncio.create_task(free_a_slot())
            async with aio.transaction("c") as conn:
                answer = int((await conn.execute(text("SELECT 41 + 1"))).scalar_one())
            return answer, await freer

    try:
        assert asyncio.run(main()) == (42, True)
    finally:
        for conn in held:
            conn.close()


@pytest.mark.slow  # 26 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_idle_async_connections_of_an_ended_loop_leave_the_budget(
    small_server: Callable[[int], PostgresServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An AsyncStore left open when its loop ended: the reaper cannot close its connections on
    that loop any more; they are dropped with a warning and the budget stops counting them."""
    server = small_server(30)
    # 2 s: long enough that the reaper does not close a connection the fan-out already gave back
    # before the loop ends (at 0.2 s it did, on a loaded machine: 5 of 6 held), short enough to wait for.
    store, instance = shard_store(server, tmp_path, {"idle_timeout": 2.0})

    async def main() -> int:
        aio = AsyncStore(store)  # never closed
        await aio.fan_out("user", select(User.user_id))
        return async_records(aio)

    try:
        with caplog.at_level("WARNING", logger="mdb.aio.engines"):
            held = asyncio.run(main())
            assert 1 <= held <= len(SHARDS), held  # connections left on the ended loop: what the reaper must drop
            deadline = time.monotonic() + 30  # generous: the reaper runs every second here
            while store.engines.budget.open_connections(instance) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert store.engines.budget.open_connections(instance) == 0
        dropped = [r.getMessage() for r in caplog.records if "event loop is closed" in r.getMessage()]
        assert dropped and all(f"instance {instance}" in m for m in dropped)
    finally:
        store.close()
