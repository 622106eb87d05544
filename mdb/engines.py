"""Server name -> SQLAlchemy engine: lazy, pooled, one engine per URL, primary or replica.

Engines know nothing of GDIDs or areas; they only turn the map's server names into pooled
connections. SQLite files get WAL and a busy timeout (so concurrent writers wait instead of
failing), PostgreSQL URLs are forced onto psycopg 3. On both, mdb issues BEGIN itself (driver
autocommit mode plus ``do_begin`` of mdb's registered dialects, ``postgresql+mdb`` and
``sqlite+mdb``, which the engines connect with whatever driver the map names: psycopg, sqlite3)
so that a transaction can carry a prelude,
the briefcase ownership check, without an extra round trip. The engine only knows WHEN to run
a prelude (a typed hook: :class:`BeginPrelude`, handed over with :func:`set_prelude` and its
rows read with :func:`take_result`); WHAT it runs, the check's SQL, lives in
:mod:`mdb.ownership`. URLs are masked in every repr and error.

Pool sizes, recycling and the PostgreSQL connect timeout come from the map's ``engine:``
settings (:class:`mdb.partition_map.EngineSpec`) over the defaults below. The connect timeout
always has a value: without one, libpq waits for the operating system to give up on a
powered-off host, which takes minutes, and every command touching that server hangs as long.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psycopg
from psycopg import errors as pg_errors
from psycopg import generators as pg_generators
from psycopg import pq
from psycopg.adapt import Transformer
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects import registry as dialect_registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import URL, Connection, Dialect
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.util import LRUCache
from sqlalchemy.pool import NullPool

from mdb.budget import BudgetPool, ConnectionBudget, connect_patiently, instance_of
from mdb.dialects import SqlDialect, sql_dialect
from mdb.partition_map import EngineSpec, PartitionMap, ServerSpec
from mdb.servers import ServerDirectory
from mdb.urls import mask_url, sqlalchemy_url

__all__ = [
    "BEGIN_RESULT", "BeginPrelude", "DEFAULT_ENGINE", "EngineRegistry", "KnownRows", "MDB_DRIVER", "MdbPGDialect",
    "MdbSQLiteDialect", "PGTransactions", "PRELUDE", "PreparedNames", "Rows", "SQLITE_READ_BEGIN", "SQLITE_WRITE_BEGIN",
    "finish_pending_end", "finish_pending_record", "mdb_url", "one_statement",
    "one_statement_prelude", "prelude_of", "prepared_names", "set_prelude",
    "simple_query", "sqlite_begin", "sqlite_end", "sqlite_setup", "take_result"
]

log = logging.getLogger("mdb.engines")

SQLITE_BUSY_TIMEOUT_MS = 30_000
DEFAULT_ENGINE = EngineSpec(pool_size=10, max_overflow=20, pool_timeout=30.0, connect_timeout=10, idle_timeout=300.0)
"""What an engine gets for the settings a map leaves unset (docs/operations.md: the budget)."""
COMPILED_CACHE_SIZE = 4000
"""Compiled statements kept for all PostgreSQL engines together (SQLAlchemy keeps 500 per engine)."""


def sqlite_setup(dbapi_connection: Any, _record: Any) -> None:
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


PRELUDE = "mdb.begin_prelude"
"""``info`` key (per pooled DBAPI connection): the :class:`BeginPrelude` the next BEGIN runs
(public to the package: the async engines' BEGIN reads the same key)."""
BEGIN_RESULT = "mdb.begin_result"
"""``info`` key where the rows of the prelude's last statement are left."""
_PREPARED = "mdb.prepared"
"""``info`` key: the connection's :class:`PreparedNames`."""
_UNWAITED_END = "mdb.unwaited_end"
"""``info`` key: the open transaction cannot write (its prelude began it ``READ ONLY``), so its end
is sent without waiting for the answer (:func:`commit_unwaited`)."""
_KNOWN = "mdb.known_rows"
"""``info`` key: the connection's :class:`KnownRows` (SQLite)."""
_PENDING_END = "mdb.pending_end"
"""``info`` key: an end was sent unwaited and its answer is not read yet (:func:`finish_pending_end`)."""


Rows = list[tuple[Any, ...]]
"""What a prelude's last statement returned."""


@dataclass
class PreparedNames:
    """The server-side prepared statements known to exist on one DBAPI connection.

    Kept with the pooled connection (it lives as long as the server session does), so a prelude
    prepares its statements once per connection. ``known`` is None when that is unknown: a
    PREPARE failed half-way (PREPARE is not transactional) or the statements went missing.
    """

    known: set[str] | None = field(default_factory=set)
    loader: Any = None
    """psycopg's loader of the check's row on this connection, made on first use: a new one per
    session looked its column types up again (:func:`simple_query`)."""


@dataclass
class KnownRows:
    """What a SQLite connection keeps for its later transactions: SQLite's counterpart of :class:`PreparedNames`.

    ``shared`` is the engine's (one database file), shared by its connections: key -> (the version
    the rows were read at, the rows), each entry written and read whole, so connections that race
    only replace each other's entries. ``versioned`` is this connection's: whether its database
    carries the version a kept entry is checked against (None: not asked yet), asked once per
    connection so that a connection opened after ``mdb schema apply`` installed it starts using it.
    What may be kept, and when an entry is still true, is the prelude's business (:mod:`mdb.ownership`).
    """

    shared: dict[Hashable, tuple[Any, Rows]]
    versioned: bool | None = None
    cursor: Any = None
    """The cursor this connection's BEGIN and prelude send on, made on its first BEGIN and kept:
    one made and closed per transaction was ~0.2 µs of each session on pysqlite in a tight loop,
    more in the read (docs/dev/measured-sessions.md, "Tenth pass"), and a trip to aiosqlite's
    thread on the async engines. Its statements are done when BEGIN returns; closed and
    replaced when a BEGIN fails."""


class BeginPrelude(Protocol):
    """Work a transaction does right after BEGIN, in the SAME round trip (the ownership check).

    The engine calls the method of its kind from the dialect's ``do_begin``; the prelude sends
    BEGIN itself, together with its statements, and returns the rows of its last statement
    (None when it returned none). What the statements are, and how their rows read, is the
    prelude's business (:mod:`mdb.ownership`); the engine only knows when to call it.
    """

    def begin_postgresql(self, connection: psycopg.Connection[Any], prepared: PreparedNames) -> Rows | None:
        """BEGIN on a direct PostgreSQL connection, where statements prepared earlier persist."""
        ...

    def begin_postgresql_pooled(self, connection: psycopg.Connection[Any]) -> Rows | None:
        """BEGIN behind a transaction-pooling pooler: nothing prepared may be relied on."""
        ...

    def begin_sqlite(self, cursor: sqlite3.Cursor, begin: str, known: KnownRows) -> Rows | None:
        """``begin`` (``BEGIN`` or ``BEGIN IMMEDIATE``) and the statements on SQLite; ``known``:
        what this prelude may keep of its reads between transactions on this database."""
        ...

    @property
    def read_only(self) -> bool:
        """The PostgreSQL transaction it begins cannot write (``BEGIN ... READ ONLY``): its end
        changes nothing, so the engine sends it without waiting for the answer (:func:`commit_unwaited`)."""
        ...


def set_prelude(conn: Connection, prelude: BeginPrelude) -> None:
    """Make the next BEGIN on ``conn`` run ``prelude`` (taken by that BEGIN, never run twice)."""
    conn.info[PRELUDE] = prelude


class _OneStatement:
    """The prelude of a "transaction" that is one statement: on PostgreSQL it sends nothing."""

    read_only = False

    def begin_postgresql(self, connection: psycopg.Connection[Any], prepared: PreparedNames) -> Rows | None:
        return None

    def begin_postgresql_pooled(self, connection: psycopg.Connection[Any]) -> Rows | None:
        return None

    def begin_sqlite(self, cursor: sqlite3.Cursor, begin: str, known: KnownRows) -> Rows | None:
        cursor.execute(begin)  # a local call, no round trip to save
        return None


_ONE_STATEMENT = _OneStatement()


def one_statement(conn: Connection) -> None:
    """Run the next transaction on ``conn``, which must be ONE statement, without BEGIN on PostgreSQL.

    Why: the driver runs in autocommit mode and every BEGIN is sent by mdb; a statement sent
    without one is a transaction of its own on the server (one snapshot, committed data only,
    exactly what BEGIN; statement; COMMIT gives a lone read). The COMMIT that follows then costs
    nothing either (psycopg sees no transaction open and sends nothing): two round trips of
    three saved, per shard of a fan-out. A second statement would run in a transaction of its
    own, so this is for single statements only. SQLite keeps its BEGIN (no round trip there).

    A pooled connection that died with its server fails on the statement, not on BEGIN, so
    the caller's retry on a fresh connection (as ``Store`` does for a failed BEGIN) must be
    around the statement.
    """
    set_prelude(conn, _ONE_STATEMENT)


def one_statement_prelude() -> BeginPrelude:
    """The prelude :func:`one_statement` sets, for a caller that hands a prelude over itself (the async fan-out)."""
    return _ONE_STATEMENT


def prelude_of(conn: Connection) -> BeginPrelude | None:
    """The prelude set on ``conn`` that no BEGIN has taken yet (to set it on a replacement connection)."""
    prelude: BeginPrelude | None = conn.info.get(PRELUDE)
    return prelude


def take_result(conn: Connection) -> Rows | None:
    """The rows the prelude of the last BEGIN on ``conn`` returned, removed (None: no prelude ran)."""
    rows: Rows | None = conn.info.pop(BEGIN_RESULT, None)
    return rows


def simple_query(connection: psycopg.Connection[Any], sql: str, names: PreparedNames | None = None) -> Rows | None:
    """Send ``sql`` (statements separated by ``;``) in ONE simple-protocol message; the rows of the last result.

    Why not a cursor: this is the BEGIN of every briefcase session, and psycopg's cursor
    machinery (a cursor object, its result sets, row makers, one ``nextset`` per statement)
    cost more client CPU than everything else mdb adds to a session's BEGIN (a raw loop of
    BEGIN + check + COMMIT: ~40% less CPU this way, measured). Only libpq's send, psycopg's
    own wait (interrupts cancel the query as in psycopg) and its loaders for the one row are
    used. An error result raises psycopg's error class for its SQLSTATE, as a cursor would.
    Works on anything with psycopg's ``pgconn``, ``wait(generator)``, ``adapters`` and
    ``connection`` (the async engines' greenlet facade offers them over an AsyncConnection).
    ``names``: the connection's :class:`PreparedNames`, where the row loader is kept between calls.
    """
    pgconn = connection.pgconn
    pgconn.send_query(sql.encode())
    results = connection.wait(pg_generators.execute(pgconn))
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise pg_errors.error_from_result(result, encoding=_encoding(pgconn))
    last = results[-1] if results else None
    if last is None or last.status != pq.ExecStatus.TUPLES_OK:
        return None
    loader = None if names is None else names.loader
    if loader is None:
        loader = Transformer.from_context(connection)
        if names is not None:
            names.loader = loader
    loader.set_pgresult(last)
    return loader.load_rows(0, last.ntuples, tuple)


def _encoding(pgconn: Any) -> str:
    """The connection's client encoding as Python names it (for an error message's text)."""
    name = pgconn.parameter_status(b"client_encoding")
    return {b"UTF8": "utf-8", b"SQL_ASCII": "ascii"}.get(name or b"UTF8", "utf-8")


def prepared_names(fairy: Any) -> PreparedNames:
    """The :class:`PreparedNames` of a pooled connection (``fairy``), made on first use."""
    return _prepared(fairy)


def _prepared(fairy: Any) -> PreparedNames:
    names: PreparedNames | None = fairy.info.get(_PREPARED)
    if names is None:  # a new connection: nothing prepared on it yet
        names = fairy.info[_PREPARED] = PreparedNames()
    return names


def pg_begin(fairy: Any, pooled: bool, connection: Any) -> None:
    """The BEGIN of mdb's PostgreSQL dialects: the prelude set on ``fairy`` (the pooled connection) with it.

    The engine runs in driver autocommit mode and every transaction starts here, so that a
    prelude (the briefcase ownership check) travels with BEGIN in ONE round trip. ``pooled``:
    behind a transaction-pooling pooler each transaction may run on another server session, so
    the prelude may rely on nothing prepared on one; still one round trip. Without a prelude
    (``store.transaction``, a Session on a Store's engine) BEGIN alone takes the same way: psycopg's
    ``execute`` would spend a cursor on it and auto-prepare it from its fifth use (about 40 µs of
    client CPU per transaction on the 2-core machine, docs/dev/measured-sessions.md).
    ``connection``: psycopg's Connection, or the async engines' greenlet facade over an AsyncConnection.
    """
    info = fairy.info
    if _PENDING_END in info:  # the last transaction's end, sent unwaited on this checkout
        finish_pending_end(connection, info)
    prelude: BeginPrelude | None = info.pop(PRELUDE, None)
    if prelude is None:
        simple_query(connection, "BEGIN")
        return
    if pooled:
        info[BEGIN_RESULT] = prelude.begin_postgresql_pooled(connection)
    else:
        info[BEGIN_RESULT] = prelude.begin_postgresql(connection, _prepared(fairy))
    if prelude.read_only:
        info[_UNWAITED_END] = True


def commit_unwaited(fairy: Any, connection_of: Callable[[Any], Any]) -> bool:
    """COMMIT ``fairy``'s transaction here if that needs no wait; False: the caller commits as usual.

    A transaction its prelude began ``READ ONLY`` (a readonly briefcase session's) cannot have
    written anything, so the answer to its COMMIT tells the application nothing: it is sent and
    the connection goes back to the pool without waiting for it, one round trip fewer per
    readonly session (docs/dev/0023-readonly-sessions-end-unwaited.md). The answer is read before
    anything else is sent on the connection: by the next BEGIN (:func:`pg_begin`), or by the
    pool before it hands the connection out again (:func:`finish_pending_record`). True too when
    the transaction's end is on its way already: nothing to send. ``connection_of``: the
    connection to send on, from ``fairy`` (asked only then: every commit passes here).
    """
    info = fairy.info
    if info.pop(_UNWAITED_END, False):
        connection = connection_of(fairy)
        pgconn = connection.pgconn
        pgconn.send_query(b"COMMIT")
        info[_PENDING_END] = True
        if pgconn.flush():  # not all of it went out at once (a full socket buffer): psycopg's send loop waits
            connection.wait(pg_generators.send(pgconn))
        return True
    return _PENDING_END in info


def rollback_needed(fairy: Any, driver: Any) -> bool:
    """Whether ``fairy`` has a transaction for psycopg's ``rollback()`` to end (sent and waited for).

    Not when its end is on its way already (:func:`commit_unwaited`: the pool's reset after a
    readonly session), nor when libpq says no transaction is open (the reset after every
    committed one: psycopg would send nothing either, after its lock and generator). A readonly
    transaction that ends in a rollback (an error in the session) takes psycopg's way, which
    also forgets the statements psycopg prepared, as after any ROLLBACK. ``driver``: what has
    ``fairy``'s libpq connection (``pgconn``).
    """
    try:
        info = fairy.info
    except NotImplementedError:  # SQLAlchemy's ad-hoc proxy of a brand-new connection (its first_connect)
        info = None
    if info is not None:
        if _PENDING_END in info:
            return False
        info.pop(_UNWAITED_END, None)
    return bool(driver.pgconn.transaction_status != pq.TransactionStatus.IDLE)


def finish_pending_end(connection: Any, info: dict[Any, Any]) -> None:
    """Read the answer of a transaction end :func:`commit_unwaited` sent; raise it if it is an error.

    By the time a connection is used again the answer has usually arrived: it is taken from the
    socket without a wait (``consume_input``), and psycopg's wait (a poll, or on the async
    engines a turn of the event loop) is only for an answer still on its way.
    """
    del info[_PENDING_END]
    pgconn = connection.pgconn
    pgconn.consume_input()
    results = []
    while not pgconn.is_busy():
        result = pgconn.get_result()
        if result is None:
            break
        results.append(result)
    else:
        results += connection.wait(pg_generators.fetch_many(pgconn))
    for result in results:
        if result.status == pq.ExecStatus.FATAL_ERROR:
            raise pg_errors.error_from_result(result, encoding=_encoding(pgconn))


def finish_pending_record(record: Any, facade: Callable[[Any], Any] | None = None) -> None:
    """:attr:`mdb.budget.BudgetPool.reuse` of the PostgreSQL engines: an idle connection's unwaited
    end (:func:`commit_unwaited`) is read before the pool hands the connection out again. ``facade``:
    what the async engines see their AsyncConnection through (the driver connection as it is: sync)."""
    info = record.info
    if _PENDING_END in info:
        finish_pending_end(record.driver_connection if facade is None else facade(record), info)


def sqlite_begin(fairy: Any, begin: str, shared: dict[Hashable, tuple[Any, Rows]]) -> None:
    """The BEGIN of mdb's SQLite dialects (sync and aiosqlite): ``begin``, then the prelude set on ``fairy``.

    ``begin`` is ``BEGIN IMMEDIATE`` for writers (SQLite's write lock taken up front, so two
    writers queue on the busy timeout instead of deadlocking when both upgrade from a read
    lock) and ``BEGIN`` for readers. ``shared``: the dialect's (its engine's) part of the
    :class:`KnownRows` the prelude gets.
    """
    info = fairy.info
    known: KnownRows | None = info.get(_KNOWN)
    if known is None:  # a new connection
        known = info[_KNOWN] = KnownRows(shared)
    cursor = known.cursor
    if cursor is None:
        # The DBAPI connection's cursor, not the driver's: for pysqlite they are one object, and
        # for aiosqlite (mdb.aio) it is SQLAlchemy's adapter, whose cursor has this same sync API.
        cursor = known.cursor = fairy.dbapi_connection.cursor()
    prelude: BeginPrelude | None = info.pop(PRELUDE, None)
    try:
        if prelude is None:
            cursor.execute(begin)
        else:
            info[BEGIN_RESULT] = prelude.begin_sqlite(cursor, begin, known)
    except BaseException:
        # A statement cut off before its last row holds its read snapshot (and with it the WAL)
        # until its cursor is closed: this one is done, the next BEGIN makes another.
        known.cursor = None
        cursor.close()
        raise


def sqlite_end(connection: sqlite3.Connection, statement: str) -> None:
    """End the open transaction of ``connection`` with ``statement`` (``COMMIT`` or ``ROLLBACK``), if one is open.

    What sqlite3's ``commit()`` and ``rollback()`` do, through the connection's statement cache:
    those methods parse their statement again on every call (Python 3.11-3.13 prepare, step and
    finalize it), and SQLite's parser, cold among a session's other work, made ending a read
    transaction cost ~8 µs of a ~190 µs point read; a cached statement only steps (measured:
    docs/dev/measured-sessions.md, "Eighth pass"). Nothing open (SQLite rolled back on its own
    after an error, or nothing began): nothing sent, as those methods do.

    A ``COMMIT`` that fails (a deferred foreign key, a busy database) leaves SQLite's transaction
    open, for the caller to retry; SQLAlchemy has given the transaction up by then and never
    rolls it back, so the pooled connection carried it, with its write lock, into the next
    session, whose ``BEGIN`` then failed ("cannot start a transaction within a transaction").
    So it is rolled back here and the ``COMMIT``'s error raised.
    """
    if not connection.in_transaction:
        return
    try:
        connection.execute(statement)
    except BaseException:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise


SQLITE_WRITE_BEGIN = "BEGIN IMMEDIATE"
SQLITE_READ_BEGIN = "BEGIN"


class PGTransactions(DefaultDialect):
    """BEGIN, COMMIT and ROLLBACK of mdb's PostgreSQL dialects, sync and async: one implementation
    (:func:`pg_begin`, :func:`commit_unwaited`, :func:`rollback_needed`), each dialect saying only
    how it reaches psycopg's connection (:meth:`mdb_connection`). First among a dialect's bases."""

    mdb_pooled = False

    @staticmethod
    def mdb_connection(fairy: Any) -> Any:
        """What the prelude, BEGIN and an unwaited COMMIT send on: psycopg's sync Connection is
        the DBAPI connection itself (an attribute, where ``driver_connection`` is three calls)."""
        return fairy.dbapi_connection

    def do_begin(self, dbapi_connection: Any) -> None:
        pg_begin(dbapi_connection, self.mdb_pooled, self.mdb_connection(dbapi_connection))

    def do_commit(self, dbapi_connection: Any) -> None:
        if not commit_unwaited(dbapi_connection, self.mdb_connection):
            super().do_commit(dbapi_connection)

    def do_rollback(self, dbapi_connection: Any) -> None:
        if rollback_needed(dbapi_connection, self.mdb_connection(dbapi_connection)):
            super().do_rollback(dbapi_connection)


class MdbPGDialect(PGTransactions, PGDialect_psycopg):
    """psycopg 3 with mdb's BEGIN (``postgresql+mdb``): SQLAlchemy's extension point for a driver's behaviour.

    Why a dialect and not a ``begin`` event listener: an engine with any connection event makes
    every Connection build its own event dispatch and consult it around every statement; a
    no-op ``begin`` listener alone cost the plain point read ~20 µs of CPU (measured).

    Maps keep their ``postgresql+psycopg`` URLs; the engine factory connects with this dialect
    (:func:`mdb_url`). ``mdb_pooled``: the URL reaches a transaction-pooling pooler (the prelude
    sends nothing prepared). ``mdb_instance``, ``mdb_user``, ``mdb_budget``: what
    :func:`_initialize_shared` shares the server's initialization by and caps the budget of;
    None: SQLAlchemy's own ``initialize``. ``driver`` stays ``psycopg``: the driver is psycopg's.
    """

    supports_statement_cache = True
    mdb_scatter = True
    """:mod:`mdb.scatter` may send a fan-out's statement on its connections itself."""

    def __init__(self, mdb_pooled: bool = False, mdb_instance: str | None = None, mdb_user: str | None = None,
                 mdb_budget: ConnectionBudget | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.mdb_pooled = mdb_pooled
        self.mdb_instance = mdb_instance
        self.mdb_user = mdb_user
        self.mdb_budget = mdb_budget
        self.mdb_server_key: tuple[object, ...] | None = None
        """What :func:`_pg_server_key` read on this dialect's first connection."""


    def initialize(self, connection: Connection) -> None:
        if self.mdb_instance is None:
            super().initialize(connection)
        else:
            _initialize_shared(self, connection, super().initialize)

    @classmethod
    def get_async_dialect_cls(cls, url: URL) -> type[Dialect]:
        # By registry name, not by import: the async dialects live a layer above (mdb.aio.engines).
        dialect: type[Dialect] = dialect_registry.load("postgresql.mdb_async")
        return dialect


class MdbSQLiteDialect(SQLiteDialect_pysqlite):
    """sqlite3 with mdb's BEGIN (``sqlite+mdb``); ``mdb_begin``: ``BEGIN`` (readers) or ``BEGIN IMMEDIATE`` (writers)."""

    supports_statement_cache = True

    def __init__(self, mdb_begin: str = SQLITE_WRITE_BEGIN, **kw: Any) -> None:
        super().__init__(**kw)
        self.mdb_begin = mdb_begin
        self.mdb_known_rows: dict[Hashable, tuple[Any, Rows]] = {}
        """What preludes keep of their reads on this engine's database (:class:`KnownRows`)."""

    def do_begin(self, dbapi_connection: Any) -> None:
        sqlite_begin(dbapi_connection, self.mdb_begin, self.mdb_known_rows)

    def do_commit(self, dbapi_connection: Any) -> None:
        connection = dbapi_connection.dbapi_connection
        if connection.in_transaction:  # (sqlite_end asks too: not calling it when nothing is open, as at every pool return)
            sqlite_end(connection, "COMMIT")

    def do_rollback(self, dbapi_connection: Any) -> None:
        connection = dbapi_connection.dbapi_connection
        if connection.in_transaction:
            sqlite_end(connection, "ROLLBACK")

    @classmethod
    def get_async_dialect_cls(cls, url: URL) -> type[Dialect]:
        # By registry name, not by import: the async dialects live a layer above (mdb.aio.engines).
        dialect: type[Dialect] = dialect_registry.load("sqlite.mdb_aiosqlite")
        return dialect


MDB_DRIVER = "mdb"
"""The driver name of mdb's dialects: ``postgresql+mdb``, ``sqlite+mdb`` (their async variants are
picked by ``create_async_engine`` from the same URL)."""
_MDB_DRIVERS = {"postgresql": "psycopg", "sqlite": "pysqlite"}
"""backend -> the driver whose dialect mdb's dialect extends."""

dialect_registry.register("postgresql.mdb", "mdb.engines", "MdbPGDialect")
dialect_registry.register("sqlite.mdb", "mdb.engines", "MdbSQLiteDialect")
dialect_registry.register("postgresql.mdb_async", "mdb.aio.engines", "MdbPGDialectAsync")
dialect_registry.register("sqlite.mdb_aiosqlite", "mdb.aio.engines", "MdbSQLiteDialectAsync")


def mdb_url(url: URL) -> URL:
    """``url`` (a map's ``postgresql+psycopg`` or ``sqlite`` URL) on mdb's dialect of the same driver.

    A URL on another driver is returned as it is (the map loader refuses those).
    """
    backend = url.get_backend_name()
    driver = url.get_driver_name()
    if _MDB_DRIVERS.get(backend) == driver:
        return url.set(drivername=f"{backend}+{MDB_DRIVER}")
    return url


_INITIALIZED: dict[tuple[object, ...], dict[str, Any] | None] = {}
"""What ``dialect.initialize`` set, per dialect class, instance, server version, user and
``standard_conforming_strings``; None: this kind of server must be initialized per engine."""
_initialized_lock = threading.Lock()


def _pg_server_key(dialect: Any, instance: str, dbapi_connection: Any) -> tuple[object, ...]:
    """What the results of ``initialize`` depend on, read from the ParameterStatus messages
    libpq received when it connected (no query): the server's version and string-escaping
    setting and who is logged in, on which instance, through which dialect class and driver."""
    info = dbapi_connection.info
    return (type(dialect), instance, info.server_version, info.user,
            info.parameter_status("standard_conforming_strings"), info.parameter_status("server_encoding"))


_COMPILED: LRUCache[Any, Any] = LRUCache(COMPILED_CACHE_SIZE)
"""The compiled-statement cache of every PostgreSQL engine (SQLAlchemy's ``compiled_cache``
execution option). Its keys hold the dialect instance, so only engines that share a dialect
(:func:`_adopt_template`) share entries; per engine, each of 128 shards compiled every
statement again (the reflection queries of a schema apply: ~5 ms each)."""

_DIALECTS: dict[tuple[str, str | None, bool], tuple[tuple[object, ...], Dialect]] = {}
"""Per (instance, login user, through a transaction pooler): the server key and the initialized
dialect of the first engine there, which the next engines of that instance execute with."""


_CAPACITY: dict[tuple[object, ...], int] = {}
"""Per server key (:func:`_pg_server_key`): the connections the server accepts from non-superusers."""

_CAPACITY_SQL = (
    "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int"
    " - coalesce(current_setting('reserved_connections', true)::int, 0)"
)


def _adopt_template(pg: Engine, instance: str, user: str | None, pooled: bool) -> Engine:
    """Let ``pg`` execute with the initialized dialect of the first engine of its instance, if there is one.

    ``dialect.initialize`` runs on an engine's first connection and asks the server its
    version, default schema, isolation level, string escaping and whether hstore exists: 3-5
    queries, each the first of a fresh backend (~15 ms per shard database, measured: most of
    a cold fan-out at 128 shards). Every database of one instance answers the same for the
    same login, so what the first engine's initialize set (the attributes it changed) is
    copied onto the next engines of that key (:func:`_pg_server_key`, in
    :func:`_initialize_shared`), and those engines execute with the first one's dialect, whose
    statements are compiled already (:data:`_COMPILED`: its keys hold the dialect instance).
    The key holds the server version: when an engine's server turns out to differ from the
    first one's (an instance upgraded under a running process), it is initialized afresh and
    goes back to its own dialect.

    Never shared: a dialect that found hstore (its type OID is per database). A database
    whose ``ALTER DATABASE ... SET search_path`` or default isolation level differs from its
    instance's first database gets the first database's values (mdb sets neither).
    """
    with _initialized_lock:
        template = _DIALECTS.get((instance, user, pooled))
    if template is not None:
        _use_dialect(pg, template[1])
    return pg


def _initialize_shared(own: MdbPGDialect, connection: Connection, original: Callable[[Connection], None]) -> None:
    """``own.initialize`` (:class:`MdbPGDialect`): SQLAlchemy's ``original`` once per server key, copied after.

    On the same first connection, per server key, it reads how many connections the server
    accepts from non-superusers, which becomes the dialect's budget's default cap for the
    instance (not behind a transaction pooler, whose client limit is its own).
    """
    instance = own.mdb_instance or ""
    key = _pg_server_key(own, instance, connection.connection.dbapi_connection)
    own.mdb_server_key = key
    with _initialized_lock:
        known = key in _INITIALIZED
        state = _INITIALIZED.get(key)
    if state is not None:
        vars(own).update(state)
    else:
        before = dict(vars(own))
        original(connection)
        if not known:
            after = vars(own)
            changed = {name: value for name, value in after.items() if name not in before or before[name] is not value}
            shareable = not getattr(own, "_has_native_hstore", False)
            with _initialized_lock:
                _INITIALIZED.setdefault(key, changed if shareable else None)
                if shareable:
                    _DIALECTS.setdefault((instance, own.mdb_user, own.mdb_pooled), (key, own))
    engine = connection.engine
    template = engine.dialect
    if template is not own and (getattr(template, "mdb_server_key", None) != key or state is None):
        _use_dialect(engine, own)  # another kind of server than the first of its instance
    budget = own.mdb_budget
    if budget is not None and not own.mdb_pooled:
        with _initialized_lock:
            capacity = _CAPACITY.get(key)
        if capacity is None:
            capacity = int(connection.exec_driver_sql(_CAPACITY_SQL).scalar_one())
            with _initialized_lock:
                _CAPACITY[key] = capacity
        # The default per-instance cap: what the server accepts (a smaller cap set in the map
        # or on the Store wins). One process alone then waits for its own connections or
        # closes idle ones instead of meeting "too many clients" (docs/operations.md).
        budget.cap(instance, max(1, capacity))


def _use_dialect(pg: Engine, dialect: Dialect) -> None:
    """Make ``pg`` execute with ``dialect`` (connections it opens later; its pool closes and
    resets connections through it too). Both are :class:`MdbPGDialect` with the same pooler setting
    (the template's key holds it), so the same BEGIN.

    The one place mdb sets an engine's dialect after creation: the compiled-statement cache is
    keyed by the dialect instance, and SQLAlchemy has no supported way to hand ``create_engine``
    an initialized dialect (docs/dev/0011-mdb-dialects.md)."""
    pg.dialect = dialect
    pg.pool._dialect = dialect


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
        begin = SQLITE_READ_BEGIN if readonly else SQLITE_WRITE_BEGIN
        if database in (None, "", ":memory:"):
            sqlite = create_engine(mdb_url(parsed), poolclass=NullPool, mdb_begin=begin)
        else:
            sqlite = create_engine(mdb_url(parsed), mdb_begin=begin, **_pool_args(settings))
        event.listen(sqlite, "connect", sqlite_setup)
        return sqlite
    if parsed.get_backend_name() == "postgresql":
        # A connect_timeout written in the URL is the more specific setting and stays.
        connect_args: dict[str, Any] = {} if "connect_timeout" in parsed.query else {"connect_timeout": settings.connect_timeout}
        if pooled:  # psycopg's automatic prepare (named statements of a server session) is off too
            connect_args["prepare_threshold"] = None
        instance = instance_of(parsed) or ""
        pg = create_engine(mdb_url(parsed), isolation_level="AUTOCOMMIT", connect_args=connect_args, poolclass=BudgetPool,
                           execution_options={"compiled_cache": _COMPILED}, mdb_pooled=pooled, mdb_instance=instance,
                           mdb_user=parsed.username, mdb_budget=budget, **_pool_args(settings))
        _budgeted(pg, instance, settings, budget)
        pool = pg.pool
        assert isinstance(pool, BudgetPool)
        pool.reuse = finish_pending_record
        return _adopt_template(pg, instance, parsed.username, pooled)
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
        self._backends: dict[str, str] = {}
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

    def sql_dialect(self, server: str) -> SqlDialect:
        """The :class:`~mdb.dialects.SqlDialect` of a server: what its database can do (one writer per
        file, streaming replicas, ...), asked instead of its backend's name."""
        return sql_dialect(self.backend(server))

    def backend(self, server: str) -> str:
        """The server's SQL backend name (``postgresql``, ``sqlite``); kept per server, since a
        fan-out asks it of every shard and parsing the URL each time cost more than that shard's plan."""
        backend = self._backends.get(server)
        if backend is None:
            backend = self._backends[server] = sqlalchemy_url(self.spec(server).primary).get_backend_name()
        return backend

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
        separate_reader = spec.replica is not None or self.sql_dialect(server).one_writer_per_file
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
            self._backends.clear()
            for key in [k for k in self._engines if k[0] not in live]:
                self._engines.pop(key).dispose()

    def dispose(self) -> None:
        with self._lock:
            for engine in self._engines.values():
                engine.dispose()
            self._engines.clear()
            self._by_server.clear()
