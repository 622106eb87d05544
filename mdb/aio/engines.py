"""Async engines for the servers of a map: SQLAlchemy's asyncio extension, psycopg 3 and aiosqlite.

One :class:`~sqlalchemy.ext.asyncio.AsyncEngine` per (URL, reader, pooler) as in
:class:`mdb.engines.EngineRegistry`, whose URLs, ``direct:``/replica choice and engine settings
are read, never copied. Like the sync engines, mdb issues BEGIN itself from ``do_begin`` of
its registered dialects (driver autocommit mode): ``create_async_engine`` on a ``postgresql+mdb``
or ``sqlite+mdb`` URL picks :class:`MdbPGDialectAsync` or :class:`MdbSQLiteDialectAsync`, so the ownership check travels with BEGIN in ONE round
trip: the SAME :class:`mdb.engines.BeginPrelude` (:class:`mdb.ownership.OwnershipCheck`) is
handed over with :func:`mdb.engines.set_prelude` and its rows read with
:func:`mdb.engines.take_result`.

Why that works on an async driver: SQLAlchemy runs the sync core of an AsyncConnection inside
a greenlet, where ``await_`` suspends on the event loop. The prelude sends its statements with
:func:`mdb.engines.simple_query`, which uses only libpq's send, psycopg's ``wait`` and its
loaders, so :class:`_GreenletConnection` offers those over a ``psycopg.AsyncConnection``, the
wait awaited on the loop. The ownership SQL, the prepare-once bookkeeping and the re-prepare after a
``DEALLOCATE`` are therefore the sync ones, not a second copy. On SQLite, SQLAlchemy's aiosqlite
adapter already offers a sync-looking cursor and connection: the sync engine's SQLite BEGIN and
connection setup are used as they are.

PostgreSQL async engines count their connections in the sync registry's
:class:`~mdb.budget.ConnectionBudget` (:class:`AsyncBudgetPool`): the per-instance and total
caps hold for sync and async connections of a process together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Hashable
from typing import Any, cast

import psycopg
from sqlalchemy import event
from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
from sqlalchemy.dialects.sqlite.aiosqlite import SQLiteDialect_aiosqlite
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, NullPool
from sqlalchemy.pool.base import _AsyncConnDialect
from sqlalchemy.util import await_
from sqlalchemy.util.concurrency import greenlet_spawn, in_greenlet

from mdb.budget import BudgetPool, ConnectionBudget, connect_patiently, instance_of

# The same per-connection ``info`` keys and record as mdb.engines (set_prelude, take_result and
# prelude_of are used unchanged on the sync Connection inside an AsyncConnection).
from mdb.engines import (
    DEFAULT_ENGINE,
    SQLITE_READ_BEGIN,
    SQLITE_WRITE_BEGIN,
    EngineRegistry,
    PGTransactions,
    Rows,
    finish_pending_record,
    mdb_url,
    sqlite_begin,
    sqlite_setup,
)
from mdb.errors import CapacityError
from mdb.partition_map import EngineSpec
from mdb.urls import mask_url, sqlalchemy_url

__all__ = ["AsyncBudgetPool", "AsyncEngines", "MdbPGDialectAsync", "MdbSQLiteDialectAsync"]

log = logging.getLogger("mdb.aio.engines")


class _GreenletConnection:
    """What :func:`mdb.engines.simple_query` and a prelude use of psycopg's sync Connection, over a
    ``psycopg.AsyncConnection``: its ``pgconn`` and loaders as they are, ``wait`` awaited on the loop."""

    __slots__ = ("_connection",)

    def __init__(self, connection: psycopg.AsyncConnection[Any]) -> None:
        self._connection = connection

    @property
    def pgconn(self) -> Any:
        return self._connection.pgconn

    @property
    def adapters(self) -> Any:
        return self._connection.adapters

    @property
    def connection(self) -> Any:
        return self._connection

    def wait(self, gen: Any) -> Any:
        return await_(self._connection.wait(gen))


def _facade(fairy: Any) -> psycopg.Connection[Any]:
    """The pooled connection's AsyncConnection seen through the greenlet facade: the API the prelude,
    BEGIN and an unwaited end use (:func:`mdb.engines.pg_begin`, :func:`mdb.engines.commit_unwaited`)."""
    return cast(psycopg.Connection[Any], _GreenletConnection(fairy.driver_connection))


def _finish_pending_record(record: Any) -> None:
    """:attr:`mdb.budget.BudgetPool.reuse` of the async PostgreSQL engines (:func:`mdb.engines.finish_pending_record`, awaited)."""
    finish_pending_record(record, _facade)


class MdbPGDialectAsync(PGTransactions, PGDialectAsync_psycopg):
    """psycopg's AsyncConnection with mdb's BEGIN: what ``create_async_engine`` picks for ``postgresql+mdb``
    (:meth:`mdb.engines.MdbPGDialect.get_async_dialect_cls`); ``mdb_pooled`` as there."""

    supports_statement_cache = True
    mdb_scatter = True
    """:mod:`mdb.scatter` may send a fan-out's statement on its connections itself (from a greenlet)."""

    def __init__(self, mdb_pooled: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.mdb_pooled = mdb_pooled

    mdb_connection = staticmethod(_facade)  # the AsyncConnection, its waits awaited on the loop


class MdbSQLiteDialectAsync(SQLiteDialect_aiosqlite):
    """aiosqlite with mdb's BEGIN, for ``sqlite+mdb`` under ``create_async_engine``; ``mdb_begin`` as
    :class:`mdb.engines.MdbSQLiteDialect`'s (SQLAlchemy's adapter offers the same sync cursor API)."""

    supports_statement_cache = True

    def __init__(self, mdb_begin: str = SQLITE_WRITE_BEGIN, **kw: Any) -> None:
        super().__init__(**kw)
        self.mdb_begin = mdb_begin
        self.mdb_known_rows: dict[Hashable, tuple[Any, Rows]] = {}

    def do_begin(self, dbapi_connection: Any) -> None:
        sqlite_begin(dbapi_connection, self.mdb_begin, self.mdb_known_rows)

    def do_commit(self, dbapi_connection: Any) -> None:
        # The adapter's commit() (one trip to aiosqlite's thread); a COMMIT that fails leaves
        # SQLite's transaction open, which nothing else would end: rolled back here, as
        # mdb.engines.sqlite_end does for the sync dialect.
        try:
            super().do_commit(dbapi_connection)
        except BaseException:
            if dbapi_connection.driver_connection.in_transaction:
                super().do_rollback(dbapi_connection)
            raise


_POLL_FIRST = 0.002
_POLL_MAX = 0.05
"""How often a task waiting for room in the budget or for a returned connection looks again (s)."""


def _suspend(seconds: float) -> None:
    """Sleep on the event loop from sync code running in SQLAlchemy's greenlet (the pool's code)."""
    await_(asyncio.sleep(seconds))


class AsyncBudgetPool(BudgetPool):
    """:class:`mdb.budget.BudgetPool` for async engines: the same counts in the same budget, waits on the loop.

    Why not SQLAlchemy's AsyncAdaptedQueuePool: the budget's caps (per instance, in total) and
    its closing of other pools' idle connections to make room must hold for async connections
    too, or an async fan-out over 64 shard databases of one instance opens 64 connections
    whatever the cap says. What differs from the sync pool is how it waits and how it closes:

    * it waits (for a returned connection, or for room in the budget) by sleeping on the event
      loop and looking again, with a growing pause (``await_`` from the greenlet its code runs
      in): the sync pool's thread condition would block the loop. The pause is the price of
      the rare full-budget path only; a checkout of an idle connection takes one lock.
    * an async connection can only be closed on its own loop, inside a greenlet. The budget
      asks from anywhere (a waiter of another pool, possibly a sync one in another thread; the
      idle reaper's thread): on the pool's loop the connection is closed at once; from elsewhere
      it is taken out of the pool and handed to its loop to close, and ``close_idle`` answers 0
      (nothing is free yet). It stays counted in the budget until it is closed, so the budget
      never counts fewer connections than the servers see.
    """

    _is_asyncio = True  # a class attribute, as AsyncAdaptedQueuePool's
    _dialect = _AsyncConnDialect()

    def __init__(
        self, creator: Any, pool_size: int = 10, max_overflow: int = 20, timeout: float = 30.0, **kw: Any
    ) -> None:
        super().__init__(creator, pool_size=pool_size, max_overflow=max_overflow, timeout=timeout, **kw)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def _do_get(self) -> ConnectionPoolEntry:
        # The loop its connections are used on: a checkout runs on it (an AsyncStore that moves
        # to a new loop, as a second asyncio.run does, brings its idle connections along).
        self._loop = asyncio.get_running_loop()
        return super()._do_get()

    def _wait_for_return(self, remaining: float) -> None:
        self._cond.release()
        try:
            _suspend(min(remaining, _POLL_MAX / 5))
        finally:
            self._cond.acquire()

    def _acquire_budget(self, timeout: float) -> None:
        budget = self.budget
        assert budget is not None
        deadline = time.monotonic() + timeout
        pause = _POLL_FIRST
        while budget.try_acquire(self.instance) is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                budget.acquire(self.instance, 0)  # the budget's own CapacityError, unless room came just now
                return
            _suspend(min(pause, remaining))
            pause = min(pause * 2, _POLL_MAX)

    def close_idle(self, limit: int | None = None, returned_before: float | None = None) -> int:
        if self._on_own_loop():
            return super().close_idle(limit, returned_before)
        taken = self._take_idle(limit, returned_before)
        if taken:
            self._close_on_loop(taken)
        return 0

    def _on_own_loop(self) -> bool:
        """True in a greenlet on the loop of this pool's connections (where they can be closed)."""
        if self._loop is None:
            return True  # never connected: nothing to close
        if not in_greenlet():
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _close_on_loop(self, records: list[ConnectionPoolEntry]) -> None:
        loop = self._loop
        assert loop is not None

        if self.budget is not None:
            self.budget.handed_over(len(records))

        async def close() -> None:
            for record in records:
                await greenlet_spawn(self._close_record, record)

        def start() -> None:
            task = loop.create_task(close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed: its connections cannot be closed in order any more
            log.warning("%d idle async connections of instance %s dropped unclosed: their event loop is closed",
                        len(records), self.instance or "?")
            if self.budget is not None:
                for _ in records:
                    self.budget.release(self.instance)


def _budgeted(engine: AsyncEngine, instance: str, spec: EngineSpec, budget: ConnectionBudget | None) -> None:
    """Count the engine's connections in ``budget`` and wait out "too many clients" on the loop.

    The async twin of ``mdb.engines._budgeted``: the same pool attachment and patience, with
    the pause between connection attempts taken on the event loop.
    """
    pool = engine.sync_engine.pool
    assert isinstance(pool, AsyncBudgetPool)  # create_async chose the class
    pool.attach(budget, instance, spec.idle_timeout)
    patience = spec.pool_timeout or 0.0

    def connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        return connect_patiently(
            lambda: dialect.connect(*cargs, **cparams), time.monotonic() + patience, instance, sleep=_suspend
        )

    event.listen(engine.sync_engine, "do_connect", connect)


def create_async(
    url: str, readonly: bool, settings: EngineSpec | None = None, pooled: bool = False,
    budget: ConnectionBudget | None = None,
) -> AsyncEngine:
    """A new async engine for ``url`` under the server's engine settings (unset: mdb's defaults);
    a PostgreSQL engine counts its connections in ``budget``."""
    spec = (settings or EngineSpec()).over(DEFAULT_ENGINE)
    parsed = sqlalchemy_url(url)
    pool_args: dict[str, Any] = {
        "pool_size": spec.pool_size, "max_overflow": spec.max_overflow, "pool_timeout": spec.pool_timeout,
        "pool_recycle": -1 if spec.pool_recycle is None else spec.pool_recycle,
    }
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database
        begin = SQLITE_READ_BEGIN if readonly else SQLITE_WRITE_BEGIN
        # sqlite+mdb: create_async_engine picks its aiosqlite variant (MdbSQLiteDialectAsync).
        if database in (None, "", ":memory:"):
            sqlite = create_async_engine(mdb_url(parsed), poolclass=NullPool, mdb_begin=begin)
        else:
            sqlite = create_async_engine(mdb_url(parsed), mdb_begin=begin, **pool_args)
        event.listen(sqlite.sync_engine, "connect", sqlite_setup)
        return sqlite
    if backend == "postgresql":
        connect_args: dict[str, Any] = {} if "connect_timeout" in parsed.query else {"connect_timeout": spec.connect_timeout}
        if pooled:
            connect_args["prepare_threshold"] = None
        # postgresql+mdb: create_async_engine picks its async variant (MdbPGDialectAsync, psycopg.AsyncConnection).
        pg = create_async_engine(
            mdb_url(parsed), isolation_level="AUTOCOMMIT", connect_args=connect_args, poolclass=AsyncBudgetPool,
            mdb_pooled=pooled, **pool_args,
        )
        _budgeted(pg, instance_of(parsed) or "", spec, budget)
        pool = pg.sync_engine.pool
        assert isinstance(pool, AsyncBudgetPool)
        pool.reuse = _finish_pending_record
        return pg
    raise ValueError(f"no async driver for {backend!r} servers ({mask_url(url)})")


class FairGate:
    """At most ``size`` holders (the pool's ``pool_size``), first come, first served; a waiter gives up after ``timeout``.

    Why not just the pool: SQLAlchemy's async pool waits on an ``asyncio.Queue``, where a task
    that returns a connection and asks again without yielding takes it back before the woken
    waiter runs, and a woken waiter that finds the queue empty queues again at the END. Under
    load (200 readers on a pool of 30) some tasks then waited past ``pool_timeout`` while others
    looped (measured: ``QueuePool limit ... timed out``). The gate hands a freed slot straight to
    the oldest waiter, so a checkout after it never waits in the pool's queue.
    """

    def __init__(self, size: int, timeout: float | None) -> None:
        self.size = size
        self.timeout = timeout
        self._free = size
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def in_use(self) -> int:
        return self.size - self._free

    def try_acquire(self) -> bool:
        """A slot now if one is free and nobody waits (the fan-out's scatter takes no turn); else False."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return True
        return False

    async def acquire(self, server: str) -> None:
        if self.try_acquire():
            return
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            await asyncio.wait_for(asyncio.shield(slot), self.timeout)
        except asyncio.TimeoutError as exc:
            self._give_up(slot)
            raise CapacityError(
                f"server {server!r}: all {self.size} async connections stayed in use for {self.timeout:g} s",
                server=server,
            ) from exc
        except BaseException:  # cancelled while waiting
            self._give_up(slot)
            raise

    def _give_up(self, slot: asyncio.Future[None]) -> None:
        if slot.done() and not slot.cancelled():
            self.release()  # the slot was handed over just as we gave up: pass it on
        else:
            slot.cancel()
            self._waiters.remove(slot)

    def release(self) -> None:
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot goes to the oldest waiter, never back to the pool
                return
        self._free += 1


class AsyncEngines:
    """Lazily created async engines for the servers of a sync :class:`EngineRegistry`.

    The registry decides which URL a use of a server connects to (primary, replica, ``direct:``)
    and whether it is behind a transaction pooler; this only keeps one AsyncEngine per answer.
    Creating one does no I/O (connections are made on first checkout), so it runs on the loop.
    """

    def __init__(self, registry: EngineRegistry) -> None:
        self._registry = registry
        self._engines: dict[tuple[str, bool, bool], AsyncEngine] = {}
        self._gates: dict[tuple[str, bool, bool], FairGate] = {}
        self._by_server: dict[tuple[str, str, bool], tuple[AsyncEngine, FairGate]] = {}

    def engine(self, server: str, readonly: bool = False) -> AsyncEngine:
        """The async engine of ``server``; ``readonly`` picks the replica when the map has one."""
        return self.engine_and_gate(server, readonly)[0]

    def gate(self, server: str, readonly: bool = False) -> FairGate:
        """The first-come-first-served gate in front of that engine's pool (one slot per connection)."""
        return self.engine_and_gate(server, readonly)[1]

    def engine_and_gate(self, server: str, readonly: bool = False) -> tuple[AsyncEngine, FairGate]:
        registry = self._registry
        url = registry.url(server, readonly)
        found = self._by_server.get((server, url, readonly))
        if found is not None:
            return found
        spec = registry.spec(server)
        separate_reader = spec.replica is not None or registry.sql_dialect(server).one_writer_per_file
        key = (url, readonly and separate_reader, registry.pooled(server, readonly))
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = create_async(
                url, readonly=key[1], settings=spec.engine, pooled=key[2], budget=registry.budget
            )
            settings = (spec.engine or EngineSpec()).over(DEFAULT_ENGINE)
            # pool_size, not + max_overflow: under sustained load the QueuePool closes every
            # overflow connection as it is returned (its idle queue is full) and opens a new one
            # for the next waiter, which connects and prepares the check again each time
            # (measured: 200 readers got 4x fewer reads/s than 8). The overflow stays for
            # what bypasses the gate (a plain AsyncSession on engine()).
            self._gates[key] = FairGate(max(1, settings.pool_size or 1), settings.pool_timeout)
            log.debug("created async engine for server %s at %s", server, mask_url(url))
        found = self._by_server[(server, url, readonly)] = (engine, self._gates[key])
        return found

    def all(self) -> list[AsyncEngine]:
        """Every engine created so far (tests read their pools)."""
        return list(self._engines.values())

    def gates(self) -> list[FairGate]:
        """Every engine's gate (tests check that no slot outlives its session)."""
        return list(self._gates.values())

    async def dispose(self) -> None:
        engines = list(self._engines.values())
        self._engines.clear()
        self._by_server.clear()
        await asyncio.gather(*(e.dispose() for e in engines))
