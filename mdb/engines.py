"""Server name -> SQLAlchemy engine: lazy, pooled, one engine per URL, primary or replica.

Engines know nothing of GDIDs or areas; they only turn the map's server names into pooled
connections. SQLite files get WAL and a busy timeout (so concurrent writers wait instead of
failing), PostgreSQL URLs are forced onto psycopg 3. On both, mdb issues BEGIN itself (driver
autocommit mode plus the dialect's ``do_begin``) so that a transaction can carry a prelude,
the briefcase ownership check, without an extra round trip. URLs are masked in every repr and
error.

Pool sizes, recycling and the PostgreSQL connect timeout come from the map's ``engine:``
settings (:class:`mdb.partition_map.EngineSpec`) over the defaults below. The connect timeout
always has a value: without one, libpq waits for the operating system to give up on a
powered-off host, which takes minutes, and every command touching that server hangs as long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool

from mdb.budget import BudgetPool, ConnectionBudget, connect_patiently, instance_of
from mdb.partition_map import EngineSpec, PartitionMap, ServerSpec
from mdb.servers import ServerDirectory
from mdb.urls import mask_url, sqlalchemy_url

__all__ = ["BEGIN_PRELUDE", "BEGIN_RESULT", "EngineRegistry", "Prelude", "sqlalchemy_url"]

log = logging.getLogger("mdb.engines")

SQLITE_BUSY_TIMEOUT_MS = 30_000
DEFAULT_ENGINE = EngineSpec(pool_size=10, max_overflow=20, pool_timeout=30.0, connect_timeout=10, idle_timeout=300.0)
"""What an engine gets for the settings a map leaves unset (docs/operations.md: the budget)."""


def _sqlite_setup(dbapi_connection: Any, _record: Any) -> None:
    # pysqlite's own transaction handling would defer BEGIN; SQLAlchemy's recommended recipe
    # turns it off so that our explicit BEGIN takes effect (see _sqlite_begin).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


BEGIN_PRELUDE = "mdb.begin_prelude"
"""``Connection.info`` key: a :class:`Prelude` to run right after BEGIN."""
BEGIN_RESULT = "mdb.begin_result"
"""``Connection.info`` key where the rows of the prelude's last statement are left."""
_PREPARED = "mdb.prepared"
"""DBAPI-connection ``info`` key: the names of our prepared statements known to exist on it, or
None when that is unknown (a PREPARE failed half-way, or they went missing)."""


@dataclass(frozen=True)
class Prelude:
    """Statements to run right after BEGIN, in the same round trip.

    ``prepare`` maps the names of server-side prepared statements the statements ``EXECUTE``
    to their definitions, ``(argument types) AS query`` (PostgreSQL only). They are prepared
    once per pooled connection, on first use and outside any transaction, so a session pays
    for parsing and planning the prelude once per connection instead of once per BEGIN.
    """

    statements: tuple[str, ...]
    prepare: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)
    """Named parameters of the statements (SQLite only: a PostgreSQL prelude travels as one
    simple-protocol string, which takes none, so its values are inlined)."""
    unprepared: tuple[str, ...] = ()
    """The same with no prepared statement behind them (PostgreSQL): what an engine behind a
    transaction-pooling pooler sends, where nothing prepared outlives a transaction."""


def _last_rows(cursor: Any) -> list[tuple[Any, ...]] | None:
    """Rows of the last result of a multi-statement string (psycopg), skipping the others.

    Checks the result status instead of ``description``, which builds column objects.
    """
    while cursor.nextset():
        pass
    result = cursor.pgresult
    return cursor.fetchall() if result is not None and result.status == pq.ExecStatus.TUPLES_OK else None


def _pg_prepare(fairy: Any, prepare: Mapping[str, str]) -> None:
    """Prepare the statements this connection lacks, in one round trip before BEGIN.

    PREPARE is not transactional: of several in one string, those before a failure stay. So
    after a failure, or when statements went missing, the next call first asks the server
    which ones exist instead of trusting the record.
    """
    known: set[str] | None = fairy.info.get(_PREPARED, set())  # absent: a new connection
    with fairy.driver_connection.cursor() as cursor:
        try:
            if known is None:
                cursor.execute("SELECT name FROM pg_prepared_statements WHERE name = ANY(%s)", (list(prepare),))
                known = {name for (name,) in cursor.fetchall()}
            missing = [name for name in prepare if name not in known]
            if missing:
                cursor.execute("; ".join(f"PREPARE {name} {prepare[name]}" for name in missing))
                known.update(missing)
        except BaseException:
            fairy.info[_PREPARED] = None
            raise
    fairy.info[_PREPARED] = known


def _pg_begin(fairy: Any) -> None:
    # The engine runs in driver autocommit mode and every transaction starts here, so that a
    # prelude (the briefcase ownership check) travels with BEGIN in ONE round trip: psycopg
    # sends a parameterless multi-statement string with the simple query protocol.
    prelude: Prelude | None = fairy.info.pop(BEGIN_PRELUDE, None)
    if prelude is None:
        fairy.driver_connection.execute("BEGIN")
        return
    known = fairy.info.get(_PREPARED)
    if known is None or not known.issuperset(prelude.prepare):
        _pg_prepare(fairy, prelude.prepare)
    text = "; ".join(["BEGIN", *prelude.statements])
    with fairy.driver_connection.cursor() as cursor:
        try:
            cursor.execute(text)
        except psycopg.errors.InvalidSqlStatementName:
            # Our statements were dropped behind our back. psycopg itself does it: a ROLLBACK
            # on a connection where it auto-prepared statements sends DEALLOCATE ALL. So do
            # DISCARD ALL and a pooler that swaps server sessions. Prepare them again, once.
            cursor.execute("ROLLBACK")
            fairy.info[_PREPARED] = None
            _pg_prepare(fairy, prelude.prepare)
            cursor.execute(text)
        fairy.info[BEGIN_RESULT] = _last_rows(cursor)


def _pg_begin_pooled(fairy: Any) -> None:
    # Behind a transaction-pooling pooler each transaction may run on another server session,
    # so nothing may be prepared on one: the prelude's unprepared form (the ownership check as
    # a call of its PL/pgSQL function), still one simple-protocol string with BEGIN, still one
    # round trip.
    prelude: Prelude | None = fairy.info.pop(BEGIN_PRELUDE, None)
    if prelude is None:
        fairy.driver_connection.execute("BEGIN")
        return
    with fairy.driver_connection.cursor() as cursor:
        cursor.execute("; ".join(["BEGIN", *(prelude.unprepared or prelude.statements)]))
        fairy.info[BEGIN_RESULT] = _last_rows(cursor)


def _sqlite_begin(fairy: Any, begin: str) -> None:
    cursor = fairy.driver_connection.cursor()
    try:
        cursor.execute(begin)
        prelude: Prelude | None = fairy.info.pop(BEGIN_PRELUDE, None)
        if prelude is not None:
            rows = None
            for statement in prelude.statements:
                cursor.execute(statement, prelude.params)
                rows = cursor.fetchall() if cursor.description is not None else rows
            fairy.info[BEGIN_RESULT] = rows
    finally:
        cursor.close()


def _sqlite_begin_write(fairy: Any) -> None:
    # BEGIN IMMEDIATE takes SQLite's write lock up front, so two writers queue on the busy
    # timeout instead of deadlocking when both upgrade from a read lock.
    _sqlite_begin(fairy, "BEGIN IMMEDIATE")


def _sqlite_begin_read(fairy: Any) -> None:
    _sqlite_begin(fairy, "BEGIN")


def _begin_with(engine: Engine, begin: Callable[[Any], None]) -> Engine:
    """Make ``begin(pooled DBAPI connection)`` the engine's BEGIN.

    Why the dialect and not a ``begin`` event listener: an engine with any connection event
    makes every Connection build its own event dispatch and consult it around every
    statement; a no-op ``begin`` listener alone cost the plain point read ~20 µs of CPU
    (measured). The dialect instance belongs to this engine only.
    """
    # Deliberate (see above): method-assign for replacing a method on the instance, assignment
    # because mypy compares ``begin`` with the unbound do_begin(self, dbapi_connection).
    engine.dialect.do_begin = begin  # type: ignore[method-assign, assignment]
    return engine


def _pool_args(settings: EngineSpec) -> dict[str, Any]:
    """``create_engine`` keyword arguments of a pooled engine (QueuePool) under ``settings``."""
    return {
        "pool_size": settings.pool_size,
        "max_overflow": settings.max_overflow,
        "pool_timeout": settings.pool_timeout,
        "pool_recycle": -1 if settings.pool_recycle is None else settings.pool_recycle,
    }


def _budgeted(pg: Engine, instance: str, settings: EngineSpec, budget: ConnectionBudget | None) -> Engine:
    """Count ``pg``'s connections in ``budget``, close idle ones, and wait out "too many clients".

    A capacity refusal is retried with backoff for up to ``pool_timeout`` (the ``do_connect``
    hook runs only when a connection is made, never on a checkout) before it is raised.
    """
    pool = pg.pool
    assert isinstance(pool, BudgetPool)  # _create chose the class
    pool.attach(budget, instance, settings.idle_timeout)
    patience = settings.pool_timeout or 0.0

    def connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
        return connect_patiently(lambda: dialect.connect(*cargs, **cparams), time.monotonic() + patience, instance)

    event.listen(pg, "do_connect", connect)
    return pg


def _create(url: str, readonly: bool, engine: EngineSpec | None = None, pooled: bool = False,
            budget: ConnectionBudget | None = None) -> Engine:
    """A new engine for ``url``; ``engine`` is the server's settings from the map (unset: defaults);
    ``pooled``: the URL reaches a transaction pooler (no session state may be relied on); a
    PostgreSQL engine counts its connections in ``budget``."""
    settings = (engine or EngineSpec()).over(DEFAULT_ENGINE)
    parsed = sqlalchemy_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        if database in (None, "", ":memory:"):
            sqlite = create_engine(parsed, poolclass=NullPool)
        else:
            sqlite = create_engine(parsed, **_pool_args(settings))
        event.listen(sqlite, "connect", _sqlite_setup)
        return _begin_with(sqlite, _sqlite_begin_read if readonly else _sqlite_begin_write)
    if parsed.get_backend_name() == "postgresql":
        # A connect_timeout written in the URL is the more specific setting and stays.
        connect_args: dict[str, Any] = {} if "connect_timeout" in parsed.query else {"connect_timeout": settings.connect_timeout}
        if pooled:  # psycopg's automatic prepare (named statements of a server session) is off too
            connect_args["prepare_threshold"] = None
        pg = create_engine(parsed, isolation_level="AUTOCOMMIT", connect_args=connect_args, poolclass=BudgetPool,
                           **_pool_args(settings))
        _budgeted(pg, instance_of(parsed) or "", settings, budget)
        return _begin_with(pg, _pg_begin_pooled if pooled else _pg_begin)
    return create_engine(parsed)


def _cap_budget(budget: ConnectionBudget, servers: Mapping[str, ServerSpec]) -> None:
    """Apply the servers' budget settings: per instance, the smallest cap of its servers; in total,
    the smallest of all (a cap only ever goes down: a process never holds more than any map allowed)."""
    for spec in servers.values():
        if spec.engine is None:
            continue
        budget.limit_total(spec.engine.max_connections_total)
        for url in (spec.primary, spec.replica):
            instance = None if url is None else instance_of(sqlalchemy_url(url))
            if instance is not None:
                budget.cap(instance, spec.engine.max_connections_per_instance)


class EngineRegistry(ServerDirectory):
    """Lazily created engines for the servers of a map; replaced servers keep their engines.

    One engine per distinct URL: two server names with the same URL share a pool. Changing a
    map (a new version with new servers or URLs) is done with :meth:`update`, which keeps the
    engines of URLs that did not change.

    Every PostgreSQL engine counts its open connections in :attr:`budget` (given, to share it
    between Stores, or a new one), capped by the servers' ``max_connections_per_instance`` and
    ``max_connections_total`` settings (mdb.budget).
    """

    def __init__(self, servers: Mapping[str, ServerSpec], budget: ConnectionBudget | None = None) -> None:
        super().__init__(servers)
        self._engines: dict[tuple[str, bool, bool], Engine] = {}
        self._by_server: dict[tuple[str, bool], Engine] = {}
        self._lock = threading.Lock()
        self._direct = False
        self.budget = budget if budget is not None else ConnectionBudget()
        _cap_budget(self.budget, servers)

    @classmethod
    def for_map(cls, pmap: PartitionMap, budget: ConnectionBudget | None = None) -> EngineRegistry:
        return cls(pmap.servers, budget)

    def __repr__(self) -> str:
        return f"EngineRegistry(servers={sorted(self._servers)}, open={len(self._engines)})"

    @property
    def server_names(self) -> list[str]:
        return list(self._servers)

    def has_replica(self, server: str) -> bool:
        return self.spec(server).replica is not None

    def is_sqlite(self, server: str) -> bool:
        return sqlalchemy_url(self.spec(server).primary).get_backend_name() == "sqlite"

    def backend(self, server: str) -> str:
        return sqlalchemy_url(self.spec(server).primary).get_backend_name()

    def use_direct(self) -> None:
        """Connect to each server's ``direct:`` URL where the map gives one (the tools do this).

        A move holds a briefcase's lock while it opens more connections to the same database;
        pooled sessions that queue on that lock each hold one of the pooler's few server
        connections, so through the pooler the move could wait for a connection that only its
        own lock frees. A direct connection is outside the pooler's budget.
        """
        with self._lock:
            self._direct = True
            self._by_server.clear()

    def url(self, server: str, readonly: bool = False) -> str:
        """The URL a connection uses: the replica for readonly work when the map has one; the
        ``direct:`` URL for primary work after :meth:`use_direct`."""
        spec = self.spec(server)
        if self._direct and spec.direct is not None and not (readonly and spec.replica):
            return spec.direct
        return super().url(server, readonly)

    def pooled(self, server: str, readonly: bool = False) -> bool:
        """Whether connections for this use of ``server`` go through a transaction-pooling pooler."""
        spec = self.spec(server)
        return spec.pooler == "transaction" and self.url(server, readonly) != spec.direct

    def engine(self, server: str, readonly: bool = False) -> Engine:
        """The pooled engine of a server; ``readonly`` picks the replica when the map has one."""
        engine = self._by_server.get((server, readonly))
        if engine is not None:
            return engine  # the per-session fast path: no URL parsing
        spec = self.spec(server)
        url = self.url(server, readonly)
        # SQLite readers get their own engine (deferred BEGIN, no write lock); PostgreSQL readers
        # without a replica share the primary's pool.
        separate_reader = spec.replica is not None or self.is_sqlite(server)
        key = (url, readonly and separate_reader, self.pooled(server, readonly))
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                engine = _create(url, readonly=key[1], engine=spec.engine, pooled=key[2], budget=self.budget)
                self._engines[key] = engine
                log.debug("created engine for server %s at %s", server, mask_url(url))
            self._by_server[(server, readonly)] = engine
        return engine

    def update(self, servers: Mapping[str, ServerSpec]) -> None:
        """Adopt a new server list; engines of URLs no longer used are disposed."""
        _cap_budget(self.budget, servers)
        with self._lock:
            live = self._adopt(servers) | {s.direct for s in self._servers.values() if s.direct}
            self._by_server.clear()
            for key in [k for k in self._engines if k[0] not in live]:
                self._engines.pop(key).dispose()

    def dispose(self) -> None:
        with self._lock:
            for engine in self._engines.values():
                engine.dispose()
            self._engines.clear()
            self._by_server.clear()
