"""AsyncStore: briefcase sessions, CENTRAL, GDIDs and fan-out for asyncio applications.

A facade like :class:`mdb.store.Store`, and built on one: the sync Store it holds keeps the map,
the router, the relocation directory, CENTRAL and the GDID sequences. What must not block the
event loop, opening a session and its ownership check, runs on SQLAlchemy's asyncio extension
(:mod:`mdb.aio.engines`); what is rare, re-reading the map and the relocation directory after a
stale route, runs the sync Store's own code in a worker thread (``asyncio.to_thread``).

The rules are the sync ones, imported, not copied: the session class is
:class:`mdb.session.BriefcaseSession` (``AsyncSession(sync_session_class=...)``, same ``info``
context, so reads are filtered, writes checked and keys filled in by the same listeners); the
check is :class:`mdb.ownership.OwnershipCheck` riding on BEGIN and read by
:func:`mdb.ownership.check_ownership`; the routing and retry policy is :class:`mdb.retry.RoutedOpen`.
Nothing is kept in thread-locals or globals: a session's briefcase lives in its own ``info``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session
from sqlalchemy.util import greenlet_spawn

from mdb import telemetry
from mdb.aio.engines import AsyncEngines, FairGate
from mdb.aio.fanout import fan_out
from mdb.briefcase import BriefcaseType
from mdb.central.indexes import IndexRef
from mdb.dberrors import raise_translated, translated
from mdb.engines import BeginPrelude, set_prelude, take_result
from mdb.errors import RetryableError
from mdb.fanout import FanOutResult
from mdb.gdid import GDID
from mdb.idgen import GdidGenerator
from mdb.ownership import check_ownership
from mdb.retry import RoutedOpen
from mdb.router import Placement, Router
from mdb.session import BriefcaseContext, BriefcaseSession
from mdb.store import SessionRoute, Store, briefcase_request

__all__ = ["AsyncBriefcaseSession", "AsyncCentral", "AsyncGdids", "AsyncStore"]

S = TypeVar("S")
T = TypeVar("T")
P = ParamSpec("P")


def _sync(conn: AsyncConnection) -> Connection:
    """The sync Connection inside a started AsyncConnection (where the BEGIN hook's info lives)."""
    sync = conn.sync_connection
    if sync is None:
        raise RuntimeError("the AsyncConnection is not started")
    return sync


def _open_sync(engine: Engine, prelude: BeginPrelude | None, check: Callable[[Connection], None] | None) -> Connection:
    """Connect, BEGIN with ``prelude``, ``check``: run in a greenlet, each driver call awaited on the loop.

    A connection that died with its server is replaced once, as ``Store._begin`` does (BEGIN
    and the check are the first statements of the transaction, so nothing has run yet).
    """
    conn = engine.connect()
    try:
        if prelude is not None:
            set_prelude(conn, prelude)
        try:
            conn.begin()
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            conn.close()
            conn = engine.connect()
            if prelude is not None:
                set_prelude(conn, prelude)
            conn.begin()
        if check is not None:
            check(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def _end_sync(session: Session | None, conn: Connection, ok: bool) -> None:
    """Flush and commit (``ok``) or roll back, then close the session and the connection: one greenlet."""
    try:
        if ok:
            if session is not None:
                session.flush()
            conn.commit()
        elif conn.in_transaction():
            conn.rollback()
    except BaseException:
        if conn.in_transaction():
            conn.rollback()
        raise
    finally:
        try:
            if session is not None:
                session.close()
        finally:
            conn.close()


class AsyncBriefcaseSession(AsyncSession):
    """The AsyncSession ``AsyncStore.briefcase`` yields; its ``sync_session`` is a BriefcaseSession."""

    sync_session_class = BriefcaseSession

    @property
    def confined(self) -> BriefcaseSession:
        """The sync session inside (the one whose listeners confine every statement and flush)."""
        sync = self.sync_session
        assert isinstance(sync, BriefcaseSession)  # sync_session_class
        return sync

    @property
    def briefcase(self) -> BriefcaseContext:
        return self.confined.briefcase

    @property
    def gdid(self) -> GDID:
        return self.confined.gdid

    @property
    def placement(self) -> Placement:
        return self.confined.placement

    async def run_confined(
        self, fn: Callable[Concatenate[BriefcaseSession, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """``fn(confined sync session, ...)`` in SQLAlchemy's greenlet, typed (``run_sync`` says Session).

        How sync helpers that take a BriefcaseSession (the hot-data patterns: counters, stats
        lock, event log) run from async code: their database calls suspend on the loop.
        """
        sync = self.confined
        return await self.run_sync(lambda _session: fn(sync, *args, **kwargs))


class AsyncGdids:
    """A GDID sequence for async code: ``await ids.next()``.

    The blocks, their reservation, growth and prefetch are the sync
    :class:`mdb.idgen.GdidGenerator`'s (one generator per sequence per Store, shared with sync
    callers). An id from a block already reserved is handed out on the loop
    (:meth:`~mdb.idgen.GdidGenerator.try_next`, which never waits); only when none is left does
    the call run in a worker thread, so a refill never blocks the loop.
    """

    def __init__(self, generator: GdidGenerator) -> None:
        self.sync = generator

    async def next(self) -> GDID:
        gdid = self.sync.try_next()
        return gdid if gdid is not None else await asyncio.to_thread(self.sync.next)

    async def take(self, n: int) -> list[GDID]:
        gdids = self.sync.try_take(n)
        return gdids if gdids is not None else await asyncio.to_thread(self.sync.take, n)


class AsyncCentral:
    """``await store.central.lookup(...)`` / ``create(...)``: the sync :class:`mdb.central.Central` in a worker thread.

    CENTRAL's rules (pending entries, confirmation on the root, the write order of a creation)
    are written against the sync Cluster; running them in a thread keeps ONE implementation and
    the loop free. Each call holds a pooled sync connection for its duration.
    """

    def __init__(self, store: Store) -> None:
        self.sync = store.central

    async def lookup(self, index: IndexRef, key: str, *, verify: bool = True) -> GDID | None:
        return await asyncio.to_thread(self.sync.lookup, index, key, verify=verify)

    async def lookup_all(self, index: IndexRef, key: str) -> list[GDID]:
        return await asyncio.to_thread(self.sync.lookup_all, index, key)

    async def keys_of(self, index: IndexRef, gdid: GDID | str) -> list[str]:
        return await asyncio.to_thread(self.sync.keys_of, index, gdid)

    async def add(self, index: IndexRef, key: str, gdid: GDID | str) -> None:
        await asyncio.to_thread(self.sync.add, index, key, gdid)

    async def remove(self, index: IndexRef, key: str, gdid: GDID | str | None = None) -> bool:
        return await asyncio.to_thread(self.sync.remove, index, key, gdid)

    async def rename(self, index: IndexRef, old_key: str, new_key: str) -> GDID:
        return await asyncio.to_thread(self.sync.rename, index, old_key, new_key)

    async def create(
        self,
        btype: type[BriefcaseType],
        factory: Callable[[GDID], Any | Sequence[Any]],
        keys: Mapping[IndexRef, str] | Iterable[IndexRef] = (),
        *,
        gdid: GDID | str | None = None,
    ) -> GDID:
        """Create a briefcase and its unique keys atomically (``factory`` runs in the worker thread)."""
        return await asyncio.to_thread(self.sync.create, btype, factory, keys, gdid=gdid)


class AsyncStore:
    """Routes async briefcase sessions over the servers of a sync :class:`Store`'s map.

    ``AsyncStore(store)`` shares ``store``'s routing, CENTRAL cache and GDID generators with
    its sync users; :meth:`from_yaml` makes a Store of its own (closed by :meth:`close`).
    """

    def __init__(self, store: Store, *, owns_store: bool = False) -> None:
        self.sync = store
        self.engines = AsyncEngines(store.engines)
        self.central = AsyncCentral(store)
        """CENTRAL lookups and atomic creation, awaitable (:class:`AsyncCentral`)."""
        self._owns_store = owns_store
        self._routed = False
        self._refresh_lock: asyncio.Lock | None = None
        self._ids: dict[tuple[str, str], AsyncGdids] = {}

    @classmethod
    def from_yaml(cls, path: str | Path, **kwargs: Any) -> AsyncStore:
        """An AsyncStore on its own :class:`Store` (``Store.from_yaml(path, **kwargs)``); no I/O yet."""
        return cls(Store.from_yaml(path, **kwargs), owns_store=True)

    def __repr__(self) -> str:
        return f"AsyncStore({self.sync!r})"

    # -- routing -----------------------------------------------------------------------------

    async def router(self) -> Router:
        """The sync Store's router; its first load (map history, relocations) runs in a thread."""
        if not self._routed:
            await asyncio.to_thread(lambda: self.sync.router)
            self._routed = True
        return self.sync.router

    async def refresh(self) -> None:
        """Re-read the map (the sync Store's refresh, in a thread)."""
        await asyncio.to_thread(self.sync.refresh)
        self._routed = True

    async def _refresh_after(self, stale: Router) -> None:
        """Refresh once for every task that was refused under the router ``stale``.

        A thousand writers refused by one move would otherwise run a thousand refreshes one
        after the other; whoever comes second finds a newer router and retries with it.
        """
        if self._refresh_lock is None:
            self._refresh_lock = asyncio.Lock()
        async with self._refresh_lock:
            if self.sync.router is stale:
                await self.refresh()

    async def _open_routed(self, attempt: Callable[[Router, Placement], Awaitable[S]], policy: RoutedOpen) -> S:
        """The async driver of :class:`mdb.retry.RoutedOpen`, as :func:`mdb.backends.open_routed` is the sync one.

        The policy (where to try, follow a fence, wait for a move, refresh the map) is the same
        object's; only the I/O differs: ``attempt`` is awaited on the loop, the wait is
        ``asyncio.sleep`` and the map refresh runs in a thread, once for every task refused
        under the same router.
        """
        area = policy.area
        while True:
            router = await self.router()
            placement = policy.placement(router)
            try:
                return await attempt(router, placement)
            except RetryableError as exc:
                telemetry.ownership_refused(area, placement.server, exc)
                step = policy.refused(placement, exc)
                if step.delay:
                    await asyncio.sleep(step.delay)
                telemetry.stale_retry(area, placement.server, exc)
                if step.refresh:
                    await self._refresh_after(router)

    # -- connections -------------------------------------------------------------------------

    async def _begun(
        self, server: str, readonly: bool, prelude: BeginPrelude | None = None,
        check: Callable[[Connection], None] | None = None,
    ) -> tuple[AsyncConnection, FairGate]:
        """A pooled connection in a transaction (``prelude`` run with BEGIN, then ``check``), and its gate slot.

        Connect, BEGIN and the check run in ONE greenlet (:func:`_open_sync`): each separate
        ``await`` of an AsyncConnection method is a greenlet spawn of its own.
        """
        engine, gate = self.engines.engine_and_gate(server, readonly)
        await gate.acquire(server)
        try:
            sync = await greenlet_spawn(_open_sync, engine.sync_engine, prelude, check)
        except BaseException as exc:
            gate.release()
            raise_translated(server, exc)  # as ``with translated(server)``, without a context manager per session
            raise
        return AsyncConnection(engine, sync), gate

    @asynccontextmanager
    async def transaction(
        self, server: str, readonly: bool = False, *, prelude: BeginPrelude | None = None,
    ) -> AsyncIterator[AsyncConnection]:
        """An async Core connection in one transaction on ``server`` (commit on success).

        ``prelude``: the engine's BEGIN hook for this transaction (mdb's own uses: the async
        fan-out sends a one-statement read without BEGIN, :func:`mdb.engines.one_statement_prelude`).
        """
        conn, gate = await self._begun(server, readonly, prelude)
        try:
            with translated(server):
                try:
                    yield conn
                except BaseException:
                    await greenlet_spawn(_end_sync, None, _sync(conn), False)
                    raise
                await greenlet_spawn(_end_sync, None, _sync(conn), True)
        finally:
            gate.release()

    # -- briefcase sessions ------------------------------------------------------------------

    @telemetry.observed_async_session
    def briefcase(
        self, btype: type[BriefcaseType], gdid: GDID | str, *, readonly: bool = False, exclusive: bool = False
    ) -> AbstractAsyncContextManager[AsyncBriefcaseSession]:
        """An AsyncSession on the briefcase's shard in one transaction, as ``Store.briefcase``.

        Commit on success, rollback on error; ``readonly`` and ``exclusive`` as in the sync API.
        """
        return _AsyncBriefcaseBlock(self, btype, gdid, readonly, exclusive)

    async def _open(
        self, btype: type[BriefcaseType], gdid: GDID, readonly: bool, exclusive: bool
    ) -> tuple[AsyncBriefcaseSession, AsyncConnection, FairGate]:
        store = self.sync
        key, kept, policy = store.session_routing(btype, gdid, readonly, exclusive)

        async def attempt(router: Router, placement: Placement) -> tuple[AsyncBriefcaseSession, AsyncConnection, FairGate]:
            route = kept if kept is not None and placement is kept.placement else SessionRoute(
                router, placement, btype, gdid, readonly, exclusive)

            def check(conn: Connection) -> None:
                rows = take_result(conn)
                if not rows or rows[0] != route.confirms:  # (as the sync opener)
                    check_ownership(rows, placement, route.version, write=not readonly)

            conn, gate = await self._begun(placement.server, readonly, route.check, check)
            session = AsyncBriefcaseSession(bind=conn, briefcase=route.context, join_transaction_mode="rollback_only",
                                            expire_on_commit=False)
            if route is not kept:
                store.confirmed(key, route, policy)
            return session, conn, gate

        return await self._open_routed(attempt, policy)

    # -- GDIDs -------------------------------------------------------------------------------

    async def ids(self, btype: type[BriefcaseType]) -> AsyncGdids:
        """``btype``'s root-id sequence (``Store.ids``); its first use per Store runs in a thread."""
        key = (btype.area, btype.id_sequence)
        gen = self._ids.get(key)
        if gen is None:
            gen = self._ids[key] = AsyncGdids(await asyncio.to_thread(self.sync.ids, btype))
        return gen

    async def new_gdid(self, btype: type[BriefcaseType]) -> GDID:
        """A fresh root GDID (briefcase key) for ``btype``."""
        return await (await self.ids(btype)).next()

    async def gdids(self, scope: str, sequence: str, *, authority: int | None = None,
                    block_size: int | None = None) -> AsyncGdids:
        """A raw CENTRAL sequence (``Store.gdids``), awaitable."""
        return AsyncGdids(await asyncio.to_thread(
            self.sync.gdids, scope, sequence, authority=authority, block_size=block_size))

    # -- fan-out -----------------------------------------------------------------------------

    async def fan_out(self, area: str, statement: Any, **kwargs: Any) -> FanOutResult:
        """Run one select() on every shard of ``area`` concurrently and merge (:func:`mdb.aio.fanout.fan_out`)."""
        return await fan_out(self, area, statement, **kwargs)

    # -- lifetime ----------------------------------------------------------------------------

    async def close(self) -> None:
        await self.engines.dispose()
        if self._owns_store:
            self.sync.close()

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _AsyncBriefcaseBlock(AbstractAsyncContextManager[AsyncBriefcaseSession]):
    """One ``async with store.briefcase(...)`` block, as ``mdb.store``'s sync one: route, open and check
    on enter; flush and commit, or roll back, on exit (one greenlet: :func:`_end_sync`); driver
    errors of the block and of its end translated. A class rather than an ``@asynccontextmanager``
    generator with a ``translated`` block inside (their machinery, per session)."""

    __slots__ = ("_store", "_btype", "_gdid", "_readonly", "_exclusive", "_session", "_conn", "_gate")

    _session: AsyncBriefcaseSession
    _conn: AsyncConnection
    _gate: FairGate

    def __init__(self, store: AsyncStore, btype: type[BriefcaseType], gdid: GDID | str, readonly: bool, exclusive: bool) -> None:
        self._store = store
        self._btype = btype
        self._gdid = gdid
        self._readonly = readonly
        self._exclusive = exclusive

    async def __aenter__(self) -> AsyncBriefcaseSession:
        store = self._store
        gid = briefcase_request(store.sync, self._btype, self._gdid, self._readonly, self._exclusive)
        session, self._conn, self._gate = await store._open(self._btype, gid, self._readonly, self._exclusive)
        self._session = session
        return session

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        session = self._session
        try:
            try:
                await greenlet_spawn(_end_sync, session.confined, _sync(self._conn), exc is None)
            except BaseException as failure:
                raise_translated(session.placement.server, failure)
                raise
            if exc is not None:
                raise_translated(session.placement.server, exc)
        finally:
            self._gate.release()
