"""Store: the one object application code holds.

It owns the map, the router (with a cached relocation directory) and the engines, and hands
out briefcase sessions. A session starts with the ownership check on its shard; when the shard
says the route is stale (a fence, a re-stamped layout), the Store refreshes its routing and
retries on the right shard before any application code runs, so a stale cache costs a retry,
never a wrong write.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from mdb import telemetry
from mdb.briefcase import BriefcaseType, registered_types, types_by_area
from mdb.registry import Registry, default_registry
from mdb.backends import open_routed
from mdb.budget import ConnectionBudget
from mdb.central.service import Central
from mdb.dberrors import raise_translated, translated
from mdb.engines import BEGIN_RESULT, PRELUDE, BeginPrelude, EngineRegistry, prelude_of, set_prelude, take_result
from mdb.errors import QueryError, RetryableError, RoutingError
from mdb.fanout import FanOutResult, ShardFailure, fan_out, warm_up
from mdb.gdid import GDID
from mdb.idgen import GdidGenerator, Ids
from mdb.maps.history import load_applied_map
from mdb.ownership import OwnershipCheck, check_ownership, confirming_row
from mdb.partition_map import PartitionMap, load_map_cached
from mdb.relocations import load_relocation_reach, load_relocations
from mdb.retry import PLACEMENT_CACHE_SIZE, ROUTE_CACHE_SIZE, LearnedRoutes, RouteCache, RoutedOpen
from mdb.router import Placement, Router
from mdb.session import BriefcaseContext, BriefcaseSession

if TYPE_CHECKING:  # MongoDB is an optional plug-in: its modules load on first use of `Store.mongo`
    from mdb.mongo.store import DocumentBriefcase, MongoStore
    from mdb.mongo.types import DocumentBriefcaseType

__all__ = ["SessionRoute", "Store", "briefcase_request"]


class Store:
    """Routes briefcase sessions over the servers of a partition map.

    ``types`` are the briefcase types this application uses (default: every type declared so
    far). ``map_path``, when given, is re-read on refresh so a new map version is picked up.
    ``budget`` caps the PostgreSQL connections this Store holds open (docs/operations.md); pass
    one :class:`~mdb.budget.ConnectionBudget` to several Stores to make them share it. The
    map's ``max_connections_*`` settings lower its caps further.

    ``move_wait_seconds`` bounds how long a session waits for a briefcase in the middle of a
    move (or a reshard's freeze) before it raises :class:`~mdb.errors.BriefcaseMovingError`;
    ``max_stale_retries`` how many map refreshes one session open may ask for;
    ``route_cache_size`` how many locations learned from fences it remembers
    (:class:`~mdb.retry.LearnedRoutes`; docs/briefcases.md, "Retries"); ``placement_cache_size``
    for how many briefcases it keeps a session's routing (placement, rendered ownership check)
    for the next session (:class:`~mdb.retry.RouteCache`; 0: none; docs/briefcases.md, "What a
    session costs").
    """

    def __init__(
        self,
        pmap: PartitionMap,
        *,
        registry: Registry | None = None,
        types: Sequence[type[BriefcaseType]] | None = None,
        map_path: str | Path | None = None,
        max_stale_retries: int = 3,
        move_wait_seconds: float = 30.0,
        budget: ConnectionBudget | None = None,
        route_cache_size: int = ROUTE_CACHE_SIZE,
        placement_cache_size: int = PLACEMENT_CACHE_SIZE,
    ) -> None:
        self._map_path = None if map_path is None else Path(map_path)
        self._router = Router(pmap)
        self.engines = EngineRegistry.for_map(pmap, budget)
        self.registry = registry or default_registry
        """What the application declared (:mod:`mdb.registry`); ``types`` narrows its briefcase types."""
        self.types: list[type[BriefcaseType]] = list(registered_types(self.registry) if types is None else types)
        self.types_by_area = types_by_area(self.types)
        self.max_stale_retries = max_stale_retries
        self.move_wait_seconds = move_wait_seconds
        self._relocations_loaded = False
        self._refresh_lock = threading.Lock()
        self.routes = LearnedRoutes(route_cache_size)
        """Locations of briefcases off their default shard, learned from fences (bounded)."""
        self.session_routes: RouteCache[tuple[type[BriefcaseType], GDID, bool, bool], SessionRoute] = RouteCache(placement_cache_size)
        """Per (type, briefcase, readonly, exclusive): the routing of its last session confirmed at the
        first try, for the next one (bounded; valid under the router and learned routes it came from)."""
        self.refreshes = 0
        self.refresh_seconds = 0.0
        """How many refreshes this Store ran and how long they took (a benchmark reads them)."""
        self._ids = Ids(self)
        self._mongo: MongoStore | None = None
        self.central = Central(self, new_gdid=self.new_gdid)
        """CENTRAL indexes, cache and atomic creation (:mod:`mdb.central`)."""

    @classmethod
    def from_yaml(cls, path: str | Path, **kwargs: Any) -> Store:
        return cls(load_map_cached(path), map_path=path, **kwargs)

    def __repr__(self) -> str:
        # The version this Store routes with and where that map came from (the file, or the
        # map applied in CENTRAL); ``refreshed=False``: the first session will check CENTRAL.
        pmap = self.map
        return (
            f"Store(map_version={pmap.version}, map_source={pmap.source!r}, refreshed={self._relocations_loaded}, "
            f"servers={len(pmap.servers)}, types={[t.__name__ for t in self.types]})"
        )

    # -- routing -----------------------------------------------------------------------------

    @property
    def router(self) -> Router:
        if not self._relocations_loaded:
            self.refresh()
        return self._router

    @property
    def map(self) -> PartitionMap:
        return self._router.map

    def refresh(self) -> None:
        """Reload the map file (when it has a newer version) and the newest applied map; drop the directory.

        The file is parsed again only when its text changed (:func:`~mdb.partition_map.load_map_cached`):
        a refresh follows every stale route, and re-validating an unchanged map each time was the
        larger part of its cost. The relocation directory is read again only when something asks
        for it (``router.relocations``: the move and fleet tools, fan-out); briefcase sessions
        route without it, so an application's refresh costs the same however many briefcases
        moved (docs/design.md invariant 8).
        """
        started = time.perf_counter()
        try:
            self._refresh()
        finally:
            self.refreshes += 1
            self.refresh_seconds += time.perf_counter() - started

    def _refresh(self) -> None:
        with self._refresh_lock:
            pmap = self._router.map
            if self._map_path is not None:
                candidate = load_map_cached(self._map_path)
                if candidate.version > pmap.version:
                    pmap = candidate
                    self.engines.update(pmap.servers)
            applied = self._newest_applied_map(pmap)
            if applied is not None:
                pmap = applied
                self.engines.update(pmap.servers)
            central = Router(pmap)
            self._router = Router(pmap, lambda: self._load_relocations(central), lambda: load_relocation_reach(self, central))
            self.session_routes.clear()  # (a new router: they could not be hit again; their get checks it too)
            self._relocations_loaded = True

    @property
    def map_path(self) -> Path | None:
        """The map file this Store re-reads on refresh, if it was given one."""
        return self._map_path

    def _newest_applied_map(self, current: PartitionMap) -> PartitionMap | None:
        """A map newer than ``current`` that `mdb map apply` recorded in CENTRAL, if any (none
        where the CENTRAL backend keeps no records: :func:`mdb.maps.history.newest_applied`)."""
        return load_applied_map(self, current)

    def _load_relocations(self, router: Router) -> dict[tuple[str, GDID], str]:
        """The directory from the CENTRAL servers of ``router``'s map, through their backend."""
        return load_relocations(self, router)

    def types_of(self, area: str) -> list[type[BriefcaseType]]:
        return self.types_by_area.get(area, [])

    # -- connections -------------------------------------------------------------------------

    def engine(self, server: str, readonly: bool = False) -> Engine:
        return self.engines.engine(server, readonly)

    def connect(self, server: str, readonly: bool = False) -> Connection:
        """A pooled connection to a server, with driver errors turned into mdb errors."""
        with translated(server):
            return self.engines.engine(server, readonly).connect()

    @contextmanager
    def transaction(self, server: str, readonly: bool = False, prelude: BeginPrelude | None = None) -> Iterator[Connection]:
        """A Core connection in one transaction on ``server`` (commit on success).

        ``prelude``: statements sent with BEGIN in its round trip (:class:`mdb.engines.BeginPrelude`;
        their rows: :func:`mdb.engines.take_result`), as a mover's fence check is.
        """
        conn = self.connect(server, readonly)
        if prelude is not None:
            set_prelude(conn, prelude)
        try:
            with translated(server):
                conn = self._begin(conn, server, readonly, prelude)
                try:
                    yield conn
                    conn.commit()
                except BaseException:
                    if conn.in_transaction():
                        conn.rollback()
                    raise
        finally:
            conn.close()

    def begin(self, server: str, readonly: bool = False) -> Connection:
        """A pooled connection to ``server`` already in a transaction; the caller ends it and closes.

        For code that cannot use :meth:`transaction` (it inspects a failure before deciding);
        like it, a connection that died with its server is replaced once.
        """
        conn = self.connect(server, readonly)
        try:
            with translated(server):
                return self._begin(conn, server, readonly)
        except BaseException:
            conn.close()
            raise

    def _begin(self, conn: Connection, server: str, readonly: bool, prelude: BeginPrelude | None = None) -> Connection:
        """BEGIN on ``conn`` (with the prelude set on it), or on a fresh connection if ``conn`` was dead.

        After a server restart every pooled connection is dead, and the first statement on each
        fails ("terminating connection due to administrator command"). BEGIN and the ownership
        check are the first statements of every transaction, so nothing has run yet and one
        more attempt on a new connection is safe. SQLAlchemy invalidated the whole pool with
        the first failure, so one retry suffices. The normal path costs nothing (no pre-ping).
        ``conn`` is closed when replaced; the fresh one is closed if it fails too. ``prelude``: the
        one set on ``conn``, when the caller knows it (else it is read off ``conn``).
        """
        if prelude is None:
            prelude = prelude_of(conn)
        try:
            conn.begin()
            return conn
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
        conn.close()
        fresh = self.engines.engine(server, readonly).connect()
        try:
            if prelude is not None:
                set_prelude(fresh, prelude)
            fresh.begin()
        except BaseException:
            fresh.close()
            raise
        return fresh

    # -- fan-out reads -----------------------------------------------------------------------

    def fan_out(self, area: str, statement: Any, **kwargs: Any) -> FanOutResult:
        """Run one select() on every shard of ``area`` and merge the rows (:func:`mdb.fanout.fan_out`)."""
        return fan_out(self, area, statement, **kwargs)

    def warm_up(self, area: str | None = None, **kwargs: Any) -> list[ShardFailure]:
        """Connect to every shard in parallel before the first request (:func:`mdb.fanout.warm_up`)."""
        return warm_up(self, area, **kwargs)

    # -- GDID generation ---------------------------------------------------------------------

    def gdids(
        self, scope: str, sequence: str, *, authority: int | None = None, block_size: int | None = None
    ) -> GdidGenerator:
        """This Store's cached generator of a CENTRAL sequence (:func:`mdb.idgen.generator_for`).

        The raw API: exactly the sequence named. Briefcase keys come from :meth:`ids` (the
        type's one root sequence) and child-row ids from :meth:`row_ids`; drawing keys from any
        other sequence of the area can hand out ids that :meth:`ids` hands out too.
        """
        return self._ids.sequence(scope, sequence, authority=authority, block_size=block_size)

    def ids(self, btype: type[BriefcaseType]) -> GdidGenerator:
        """The generator of ``btype``'s root GDIDs: CENTRAL sequence ``{area}/{btype.id_sequence}``.

        The one source of briefcase keys (``central.create`` and ``Repository.new_root_id`` draw
        from it too). On first use per Store the sequence is moved past every other sequence of
        scope ``{area}``: older mdb versions drew root ids from ``{area}/{TypeName}`` and the
        README tour from ``{area}/ids``, so a new sequence must not re-issue what those did.
        """
        return self._ids.of(btype)

    def new_gdid(self, btype: type[BriefcaseType]) -> GDID:
        """A fresh root GDID (briefcase key) for ``btype``, from :meth:`ids`."""
        return self._ids.of(btype).next()

    def row_ids(self, scope: str | type[BriefcaseType], sequence: str) -> GdidGenerator:
        """The generator of child-row ids: CENTRAL sequence ``{scope}:rows/{sequence}``.

        ``scope`` is a name or a briefcase type (its area). Child ids stay out of the area's
        scope so they never raise its high-water mark (docs/partition-map.md). On first use per
        Store the sequence is moved past ``{scope}/{sequence}``, where older versions of
        :class:`~mdb.repository.Repository` drew the same ids.
        """
        return self._ids.rows(scope, sequence)

    # -- briefcase sessions ------------------------------------------------------------------

    @telemetry.observed_session
    def briefcase(
        self, btype: type[BriefcaseType], gdid: GDID | str, *, readonly: bool = False, exclusive: bool = False
    ) -> AbstractContextManager[BriefcaseSession]:
        """A Session on the briefcase's shard, in one transaction: commit on success, rollback on error.

        ``readonly`` reads from the server's replica when the map has one. ``exclusive`` makes
        write sessions of this briefcase that also ask for it run one at a time (the
        briefcase's advisory lock is taken exclusive, in the round trip of BEGIN), so a
        read-modify-write in the block cannot lose an update (docs/briefcases.md, "Isolation").
        Nothing happens until the block is entered: routing, the check and its retries run then.
        """
        return _BriefcaseBlock(self, btype, gdid, readonly, exclusive)

    def routed_open(self, area: str, gdid: GDID, first: tuple[Router, Placement] | None = None,
                    learned: str | None = None) -> RoutedOpen:
        """The routing and retry policy of one session open of ``area``/``gdid`` (:mod:`mdb.retry`):
        every session opener (SQL, documents, async) takes its policy from here. ``first``: a
        placement kept from an earlier session (:meth:`session_routing`), checked against the
        briefcase's learned location ``learned``."""
        return RoutedOpen(self.routes, area, gdid, move_wait_seconds=self.move_wait_seconds,
                          max_stale_retries=self.max_stale_retries, first=first, learned=learned)

    def session_routing(self, btype: type[BriefcaseType], gdid: GDID, readonly: bool, exclusive: bool) -> tuple[
            tuple[type[BriefcaseType], GDID, bool, bool], SessionRoute | None, RoutedOpen]:
        """What an async briefcase session open starts from: its key in :attr:`session_routes`,
        the route kept there (None: none valid) and its policy, whose first attempt goes to the
        kept placement. The sync open (:meth:`_open`) does the same two lookups inline and makes
        the policy only after a kept route is refused (docs/dev/0019, amended)."""
        key = (btype, gdid, readonly, exclusive)
        learned = self.routes.get(btype.area, gdid)
        kept = self.session_routes.get(key, self._router, learned)
        if kept is None:
            return key, None, self.routed_open(btype.area, gdid)
        return key, kept, self.routed_open(btype.area, gdid, (kept.router, kept.placement), learned)

    def confirmed(self, key: tuple[type[BriefcaseType], GDID, bool, bool], route: SessionRoute, policy: RoutedOpen) -> None:
        """Keep ``route`` for the next session of ``key`` when its shard confirmed it at the open's
        first attempt (after a refusal the loop's state, not the map, chose it)."""
        if not policy.refusals:
            self.session_routes.put(key, route.router, policy.learned, route)

    def _open(
        self, btype: type[BriefcaseType], gdid: GDID, readonly: bool, exclusive: bool = False
    ) -> tuple[BriefcaseSession, Connection]:
        area = btype.area
        key = (btype, gdid, readonly, exclusive)
        learned = self.routes.get(area, gdid)
        kept = self.session_routes.get(key, self._router, learned)  # (session_routing, inlined)
        refused: tuple[Placement, RetryableError] | None = None
        if kept is not None and self._relocations_loaded:
            # The common case: this briefcase's last session (same type and mode) was confirmed
            # at its first try under the router in use. Open there before making a policy, which
            # only a refusal needs: the policy's first placement would be this one (5 Python
            # calls per session fewer, docs/dev/measured-sessions.md).
            try:
                return self._open_on(kept)
            except RetryableError as exc:
                refused = (kept.placement, exc)
        policy = self.routed_open(area, gdid, None if kept is None else (kept.router, kept.placement), learned)
        if refused is not None:
            policy.placement(self._router)  # the kept placement, as the loop's first attempt would have placed it

        def attempt(router: Router, placement: Placement) -> tuple[BriefcaseSession, Connection]:
            if kept is not None and placement is kept.placement:
                return self._open_on(kept)
            route = SessionRoute(router, placement, btype, gdid, readonly, exclusive)
            opened = self._open_on(route)
            self.confirmed(key, route, policy)
            return opened

        return open_routed(self, attempt, policy, on_refused=_refused, on_retry=_retried, refused=refused)

    def _open_on(self, route: SessionRoute) -> tuple[BriefcaseSession, Connection]:
        """Open ``route``'s server, BEGIN with its ownership check and judge the row; a session on it."""
        placement = route.placement
        server = placement.server
        context = route.context
        try:  # one translation around connect and BEGIN, as ``translated`` does, without a context manager per session
            conn = self.engines.engine(server, context.readonly).connect()
            try:
                info = conn.info  # set_prelude and take_result, without looking the pooled connection's info up twice
                info[PRELUDE] = route.check
                begun = self._begin(conn, server, context.readonly, route.check)
                rows = info.pop(BEGIN_RESULT, None) if begun is conn else take_result(begun)
                conn = begun
                if not rows or rows[0] != route.confirms:  # (the row that confirms it: no call)
                    check_ownership(rows, placement, route.version, write=not context.readonly)
            except BaseException:
                conn.close()
                raise
        except DBAPIError as exc:
            raise_translated(server, exc)
            raise
        session = BriefcaseSession(bind=conn, briefcase=context, join_transaction_mode="rollback_only",
                                   expire_on_commit=False)
        return session, conn

    # -- document briefcases on MongoDB servers ----------------------------------------------

    @property
    def mongo(self) -> MongoStore:
        """The MongoDB side of this Store (:class:`mdb.mongo.MongoStore`), created on first use.

        Creating it imports nothing of pymongo: clients are made on first use of a server.
        """
        mongo = self._mongo
        if mongo is None:
            from mdb.mongo.store import MongoStore

            mongo = self._mongo = MongoStore(self)
        return mongo

    def attach_documents(self, mongo: MongoStore) -> MongoStore:
        """Use ``mongo`` as this Store's MongoDB side (a client factory or types of its own); closes the one before."""
        if self._mongo is not None and self._mongo is not mongo:
            self._mongo.close()
        self._mongo = mongo
        return mongo

    def documents(
        self, dtype: type[DocumentBriefcaseType], gdid: GDID | str, *, readonly: bool = False
    ) -> AbstractContextManager[DocumentBriefcase]:
        """A document briefcase context on a MongoDB shard (:meth:`mdb.mongo.MongoStore.documents`)."""
        return self.mongo.documents(dtype, gdid, readonly=readonly)

    def close(self) -> None:
        self.engines.dispose()
        if self._mongo is not None:
            self._mongo.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refused(placement: Placement, exc: RetryableError) -> None:
    telemetry.ownership_refused(placement.area, placement.server, exc)


def _retried(placement: Placement, exc: RetryableError) -> None:
    telemetry.stale_retry(placement.area, placement.server, exc)


class SessionRoute:
    """What a briefcase session derives from its routing, kept between sessions of one briefcase
    (:attr:`Store.session_routes`) so the next one does not derive it again: the router and the
    placement, the ownership check (its SQL rendered once: :class:`~mdb.ownership.OwnershipCheck`),
    the session's confinement context, the map version the check reports against and the row
    that confirms the check at once (:func:`~mdb.ownership.confirming_row`). Immutable,
    so concurrent sessions of one briefcase share it; the check itself runs in every session.
    """

    __slots__ = ("router", "placement", "check", "context", "version", "confirms")

    def __init__(self, router: Router, placement: Placement, btype: type[BriefcaseType], gdid: GDID, readonly: bool,
                 exclusive: bool) -> None:
        self.router = router
        self.placement = placement
        self.check = OwnershipCheck(placement, lock=not readonly, exclusive=exclusive)
        self.context = BriefcaseContext(btype, gdid, placement, readonly)
        self.version = router.version
        self.confirms = confirming_row(placement)


def briefcase_request(store: Store, btype: type[BriefcaseType], gdid: GDID | str, readonly: bool, exclusive: bool) -> GDID:
    """What every briefcase open checks before it routes, sync and async alike: the type is
    registered with ``store``, the GDID parses, and a readonly session is not also exclusive."""
    gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
    if btype not in store.types_by_area.get(btype.area, ()):  # (types_of, without a call per session)
        raise RoutingError(f"briefcase type {btype.__name__} is not registered with this Store")
    if readonly and exclusive:
        raise QueryError(f"briefcase {btype.area}/{gid}: a session cannot be both readonly and exclusive (exclusive serializes writers)")
    return gid


class _BriefcaseBlock(AbstractContextManager[BriefcaseSession]):
    """One ``with store.briefcase(...)`` block: route, open and check on enter; flush and commit, or
    roll back, on exit; driver errors of the block and of its end translated (:func:`mdb.dberrors.translate`).

    A class rather than a ``@contextmanager`` generator with a ``translated`` block inside: every
    session of every request enters one, and the generator's machinery and the nested context
    manager were ~12 of the Python calls mdb adds to a session (docs/dev/measured-sessions.md, "Third pass").
    """

    __slots__ = ("_store", "_btype", "_gdid", "_readonly", "_exclusive", "_session", "_conn")

    _session: BriefcaseSession
    _conn: Connection

    def __init__(self, store: Store, btype: type[BriefcaseType], gdid: GDID | str, readonly: bool, exclusive: bool) -> None:
        self._store = store
        self._btype = btype
        self._gdid = gdid
        self._readonly = readonly
        self._exclusive = exclusive

    def __enter__(self) -> BriefcaseSession:
        store = self._store
        gid = briefcase_request(store, self._btype, self._gdid, self._readonly, self._exclusive)
        session, self._conn = store._open(self._btype, gid, self._readonly, self._exclusive)
        self._session = session
        return session

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        session, conn = self._session, self._conn
        try:
            if exc is None:
                try:
                    if session._new or session._deleted or session.identity_map._modified:  # (Session._is_clean, without 3 calls)
                        session.flush()
                    conn.commit()
                except BaseException as failure:
                    _failed(conn, session, failure)
                    raise
            else:
                _failed(conn, session, exc)
        finally:
            session.close()
            conn.close()


def _failed(conn: Connection, session: BriefcaseSession, exc: BaseException) -> None:
    """Roll back after ``exc``; raise its translation instead when it is a driver error mdb names
    (as ``with translated(server)`` around the block did), else return and let it go on."""
    if conn.in_transaction():
        conn.rollback()
    raise_translated(session.placement.server, exc)
