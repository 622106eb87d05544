"""Async fan-out: the plan of :mod:`mdb.fanout`, its shards queried concurrently on the event loop.

Everything but the waiting is the sync fan-out's public, sans-IO core: :func:`mdb.fanout.plan_fan_out`
decides the servers, rewrites the statement per backend and says how each shard runs it and
how the rows merge (a heap merge of the sorted per-shard streams, or the combining of aggregate
partials); :func:`mdb.fanout.fan_out_result` applies the error translation and the partial-failure
policy to the outcomes collected here and merges. Nothing of the merge or the policy is written
twice, and aggregates run on the loop like any other fan-out.

A warm shard is sent as the sync fan-out sends it (:func:`mdb.fanout.scatter_shards`, docs/dev/0022):
in SQLAlchemy's greenlet, the statement goes to every shard with an idle connection (and a free
slot of its server's :class:`~mdb.aio.engines.FairGate`) before any answer is read, each wait
awaited on the loop. The others, and a shard that failed there, run as their own task through
``AsyncStore.transaction``, which translates errors and replaces a dead connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, cast

from sqlalchemy import Row, Select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.util.concurrency import greenlet_spawn

from mdb import telemetry
from mdb.aio.engines import AsyncEngines, FairGate
from mdb.engines import BeginPrelude, one_statement_prelude
from mdb.fanout import DEFAULT_MAX_WORKERS, FanOutPlan, FanOutResult, ShardQuery, fan_out_result, plan_fan_out, scatter_shards
from mdb.gdid import GDID
from mdb.router import Router
from mdb.scatter import has_idle_connection
from mdb.store import Store

__all__ = ["fan_out"]


class AsyncServers(Protocol):
    """What the async fan-out needs of an :class:`mdb.aio.AsyncStore`."""

    @property
    def sync(self) -> Store: ...

    @property
    def engines(self) -> AsyncEngines: ...

    async def router(self) -> Router: ...

    def transaction(
        self, server: str, readonly: bool = False, *, prelude: BeginPrelude | None = None,
    ) -> AbstractAsyncContextManager[AsyncConnection]: ...


class _DiedBeforeRunning(Exception):
    """A pooled connection that died with its server (a restart), met by a statement sent without BEGIN."""


async def _attempt(store: AsyncServers, server: str, query: ShardQuery, readonly: bool, retry: bool) -> list[Row[Any]]:
    prelude = one_statement_prelude() if query.one_statement else None
    async with store.transaction(server, readonly, prelude=prelude) as conn:
        try:
            if not query.orm:
                return list((await conn.execute(query.statement)).all())
            async with AsyncSession(bind=conn, expire_on_commit=False) as session:
                return list((await session.execute(query.statement)).all())
        except DBAPIError as exc:
            if retry and prelude is not None and exc.connection_invalidated:
                raise _DiedBeforeRunning from exc
            raise


async def _run(store: AsyncServers, server: str, query: ShardQuery, readonly: bool) -> list[Row[Any]]:
    """One shard's rows (as :func:`mdb.fanout.run_shard`): one statement without BEGIN and COMMIT
    where the plan allows it, else in a transaction of its own.

    Without BEGIN, a pooled connection that died with its server fails on the statement (a
    read: nothing ran), so it is replaced once, as a failed BEGIN is (``AsyncStore``).
    """
    with telemetry.fanout_shard(server):
        try:
            return await _attempt(store, server, query, readonly, retry=True)
        except _DiedBeforeRunning:
            return await _attempt(store, server, query, readonly, retry=False)


async def _outcome(work: Awaitable[list[Row[Any]]]) -> list[Row[Any]] | Exception:
    try:
        rows: list[Row[Any]] = await work
        return rows
    except Exception as exc:  # handed to mdb.fanout.settle, which decides what it is
        return exc


async def fan_out(
    store: AsyncServers,
    area: str,
    statement: Select[Any],
    *,
    aggregate: bool = False,
    from_gdid: GDID | str | None = None,
    readonly: bool = False,
    allow_partial: bool = False,
) -> FanOutResult:
    """:func:`mdb.fanout.fan_out` with every shard's query running concurrently on the loop."""
    router = await store.router()
    if not router.reach_loaded:  # the server list reads the relocation directory's summary: its first read is sync I/O
        await asyncio.to_thread(lambda: router.relocation_reach)
    cluster = store.sync
    plan = plan_fan_out(cluster, router, area, statement, aggregate=aggregate, from_gdid=from_gdid, readonly=readonly)
    outcomes, sent = await _scatter(store, plan, readonly)
    rest = [i for i, outcome in enumerate(outcomes) if outcome is None]
    if rest:  # cold, or not sendable that way, or failed there (run again: this path translates the error)
        run = await asyncio.gather(*(_outcome(_run(store, plan.servers[i], plan.query(plan.servers[i]), readonly)) for i in rest))
        for i, outcome in zip(rest, run):
            outcomes[i] = outcome
    # Every None was run as a task above.
    return fan_out_result(cluster, plan, cast("list[list[Any] | Exception]", outcomes), sent,
                          aggregate=aggregate, allow_partial=allow_partial)


async def _scatter(store: AsyncServers, plan: FanOutPlan, readonly: bool) -> tuple[list[Any], list[Any]]:
    """:func:`mdb.fanout.scatter_shards` in a greenlet, over the async engines of warm shards whose
    gate has a free slot now (taken without waiting; every slot given back before the rest runs)."""
    held: list[FairGate] = []

    def engine_of(server: str) -> Engine | None:
        engine, gate = store.engines.engine_and_gate(server, readonly)
        sync = engine.sync_engine
        if not has_idle_connection(sync) or not gate.try_acquire():
            return None
        held.append(gate)
        return sync

    try:
        return await greenlet_spawn(scatter_shards, plan, DEFAULT_MAX_WORKERS, engine_of)
    finally:
        for gate in held:
            gate.release()
