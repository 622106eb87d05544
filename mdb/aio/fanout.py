"""Async fan-out: every shard queried concurrently on the event loop, merged by mdb.fanout.

The statement is restricted, ordered and limited per shard by :mod:`mdb.fanout`'s own helpers,
the per-shard rows are merged by its :func:`~mdb.fanout.merge_sorted` with its sort keys, and
the partial-failure policy is its :func:`~mdb.fanout.gather`: each shard's outcome (rows or the
error) is collected on the loop, then handed to ``gather`` which translates errors through the
server's backend, raises capacity errors and, unless ``allow_partial``, the first failure, and
lists the failed shards. Nothing of the merge or the policy is written twice.

Aggregates (``aggregate=True``) run the sync fan-out in a worker thread: its combining code is
not separable from its thread-pool gather without a change in mdb.fanout (docs/async.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from sqlalchemy import Row, Select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from mdb import fanout as sync_fanout
from mdb import telemetry
from mdb.errors import QueryError
from mdb.fanout import FanOutResult
from mdb.gdid import GDID
from mdb.router import Router
from mdb.store import Store

__all__ = ["fan_out"]


class AsyncServers(Protocol):
    """What the async fan-out needs of an :class:`mdb.aio.AsyncStore`."""

    @property
    def sync(self) -> Store: ...

    async def router(self) -> Router: ...

    def transaction(self, server: str, readonly: bool = False) -> AbstractAsyncContextManager[AsyncConnection]: ...


async def _run(store: AsyncServers, server: str, statement: Select[Any], readonly: bool, orm: bool) -> list[Row[Any]]:
    """One shard's rows (the async twin of ``mdb.fanout._run``)."""
    with telemetry.fanout_shard(server):
        async with store.transaction(server, readonly) as conn:
            if not orm:
                return list((await conn.execute(statement)).all())
            async with AsyncSession(bind=conn, expire_on_commit=False) as session:
                return list((await session.execute(statement)).all())


async def _outcome(work: Awaitable[list[Row[Any]]]) -> list[Row[Any]] | Exception:
    try:
        rows: list[Row[Any]] = await work
        return rows
    except Exception as exc:  # handed to mdb.fanout.gather, which decides what it is
        return exc


def _replay(outcomes: dict[str, list[Row[Any]] | Exception]) -> Callable[[str], list[Row[Any]]]:
    def one(server: str) -> list[Row[Any]]:
        outcome = outcomes[server]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return one


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
    if aggregate:
        await store.router()
        return await asyncio.to_thread(
            sync_fanout.fan_out, store.sync, area, statement, aggregate=True, from_gdid=from_gdid,
            readonly=readonly, allow_partial=allow_partial,
        )
    if not isinstance(statement, Select):
        raise QueryError(f"fan-out runs a SQLAlchemy select(), got {type(statement).__name__}")
    cluster = store.sync
    start = GDID.parse(from_gdid) if isinstance(from_gdid, str) else from_gdid
    router = await store.router()
    if not router.reach_loaded:  # the server list reads the relocation directory's summary: its first read is sync I/O
        await asyncio.to_thread(lambda: router.relocation_reach)
    servers = sync_fanout._dedupe_by_url(cluster, sync_fanout.fan_out_servers(router, area, start), readonly)
    restricted = sync_fanout._restrict(statement, cluster, area, start)
    sync_fanout._refuse_aggregates(statement)
    orders = sync_fanout._orders(statement, statement.column_descriptions)
    limit, offset = sync_fanout._limits(statement)
    per_backend: dict[str, tuple[Select[Any], bool]] = {}
    work = []
    for server in servers:
        backend = cluster.engines.backend(server)
        if backend not in per_backend:
            shard = restricted.offset(None)
            if limit is not None:
                shard = shard.limit(limit + offset)
            if orders:
                shard = shard.order_by(None).order_by(*sync_fanout._shard_order_by(orders, backend))
            per_backend[backend] = (shard, sync_fanout._selects_entities(shard))
        shard_statement, orm = per_backend[backend]
        work.append(_outcome(_run(store, server, shard_statement, readonly, orm)))
    outcomes = dict(zip(servers, await asyncio.gather(*work)))
    # The sync gather replays the outcomes: its error translation and partial-failure policy.
    per_shard, failed = sync_fanout.gather(cluster, servers, _replay(outcomes), allow_partial=allow_partial, max_workers=None)
    rows = sync_fanout.merge_sorted(per_shard, sync_fanout._row_key(orders) if orders else None, offset, limit)
    return FanOutResult(rows, failed, servers)
