"""One SELECT on many PostgreSQL connections from ONE thread: send it to each, then read each.

Why (issue 34, docs/dev/0022-scatter-gather-fan-out.md): a warm fan-out on a thread pool spent
330-620 us of client CPU per shard (SQLAlchemy's execution context, psycopg's cursor, the GIL
handed between the pool's threads), and that CPU, serialized by the GIL, bounded its wall time
on any number of cores. Here a shard costs a pool checkout, libpq's send of a query converted
once, and the load of its rows (~60 us measured), and every server works on its query while
the next shards are sent.

It sends exactly what SQLAlchemy would: the statement is compiled once per dialect, its
parameters go through their types' bind processors and are dumped by psycopg once per adapter
map, and the rows come back through psycopg's loaders and the result columns' result processors
(``CursorResult`` does the same). A statement this cannot send exactly (an expanding ``IN``
parameter, a literal-execute one) gets None from :func:`compile_read` and runs the SQLAlchemy way.

The async fan-out sends the same way (:mod:`mdb.aio.fanout`): run in SQLAlchemy's greenlet on
the event loop, each wait for an answer is awaited there (``await_``), so the loop serves other
tasks meanwhile; the code is one for both, as psycopg_pool's is.

Errors are not interpreted here: a shard whose checkout, send or result fails is returned as
its exception, its connection invalidated (never back to the pool in an unknown state), and the
caller runs that shard again the SQLAlchemy way, which translates the error or replaces a dead
connection (:func:`mdb.fanout.fan_out`).
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg import generators as pg_generators
from psycopg import pq
from psycopg._queries import PostgresQuery
from psycopg.adapt import Transformer
from sqlalchemy.engine import Dialect, Engine, Row
from sqlalchemy.engine.result import IteratorResult, SimpleResultMetaData
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.selectable import Select
from sqlalchemy.util import await_

from mdb.budget import BudgetPool
from mdb.engines import prepared_names

__all__ = ["CompiledRead", "ShardObserver", "compile_key", "compile_read", "has_idle_connection", "read_many"]

ShardObserver = Callable[[int, float, float], None]
"""Told of each shard read successfully: (its index, started and ended ``perf_counter`` times).
Failed ones are not told: the caller runs them again and observes that run."""


PREPARED_PREFIX = "mdb_fo_"
"""Names of the fan-out statements prepared on a connection (beside the ownership check's)."""
MAX_PREPARED = 64
"""Fan-out statements prepared per connection at most (bounded server memory); later ones go unnamed."""


_NO_SUCH_STATEMENT = b"26000"  # invalid_sql_statement_name
_ALREADY_PREPARED = b"42P05"  # duplicate_prepared_statement


class ResultError(Exception):
    """The server answered a shard's statement with an error (the caller runs it again the
    SQLAlchemy way, which raises the error as it would have: translated, naming the server)."""


class CompiledRead:
    """A SELECT compiled for one PostgreSQL dialect: the SQL and bound parameters every shard
    receives, and how its rows are read back (keys, result processors)."""

    __slots__ = ("sql", "params", "keys", "objects", "_types", "_dialect", "_query", "_processors", "_name")

    def __init__(self, sql: str, params: dict[str, Any], keys: list[str], objects: list[tuple[Any, ...]],
                 types: list[Any], dialect: Dialect) -> None:
        self.sql = sql
        self.params = params
        self.keys = keys
        self.objects = objects
        """Per result column, the objects it stands for (its Column, label...): what rows are keyed by besides :attr:`keys`."""
        self._types = types
        self._dialect = dialect
        self._query: PostgresQuery | None = None
        self._name: bytes | None = None
        self._processors: dict[tuple[int, ...], list[Callable[[Any], Any] | None]] = {}

    def query(self, connection: Any) -> PostgresQuery:
        """The query converted by psycopg (its dumpers), once: every connection of one dialect
        dumps alike (SQLAlchemy opens each with the dialect's adapter map as its context)."""
        query = self._query
        if query is None:
            query = self._query = PostgresQuery(Transformer.from_context(connection))
            query.convert(self.sql, self.params)
        return query

    def name(self, query: PostgresQuery) -> bytes | None:
        """The server-side name this statement is prepared under (its SQL and parameter types
        hashed: the same statement gets the same name in every fan-out); None behind a
        transaction-pooling pooler, where nothing prepared may be relied on."""
        if self._name is None and not getattr(self._dialect, "mdb_pooled", True):
            digest = hashlib.blake2b(query.query + repr(query.types).encode(), digest_size=8).hexdigest()
            self._name = f"{PREPARED_PREFIX}{digest}".encode()
        return self._name

    def load(self, connection: Any, result: pq.abc.PGresult) -> list[tuple[Any, ...]]:
        """The rows of ``result``, through psycopg's loaders and the columns' result processors."""
        loader = Transformer.from_context(connection)
        loader.set_pgresult(result)
        rows = loader.load_rows(0, result.ntuples, tuple)
        oids = tuple(result.ftype(i) for i in range(result.nfields))
        processors = self._processors.get(oids)
        if processors is None:
            if len(oids) != len(self._types):
                raise ResultError(f"the statement selects {len(self._types)} columns, the server returned {len(oids)}")
            processors = self._processors[oids] = [
                t.dialect_impl(self._dialect).result_processor(self._dialect, oid) for t, oid in zip(self._types, oids)
            ]
        if any(processors):
            return [tuple(v if p is None else p(v) for p, v in zip(processors, row)) for row in rows]
        return rows

    def rows(self, tuples: Sequence[tuple[Any, ...]]) -> list[Row[Any]]:
        """``tuples`` as SQLAlchemy rows, keyed as a ``CursorResult`` of the statement keys them
        (by name and by the selected column objects)."""
        result: IteratorResult[Any] = IteratorResult(SimpleResultMetaData(self.keys, extra=self.objects), iter(tuples))
        return list(result.all())


def compile_read(statement: Select[Any], dialect: Dialect) -> CompiledRead | None:
    """``statement`` compiled for ``dialect`` to be sent by :func:`read_many`; None when it must
    run the SQLAlchemy way (not one of mdb's psycopg dialects, sync or async, which say so with
    ``mdb_scatter``; or parameters SQLAlchemy expands while it executes)."""
    if not getattr(dialect, "mdb_scatter", False):
        return None
    compiled = statement.compile(dialect=dialect)
    if compiled.post_compile_params or compiled.literal_execute_params:
        return None
    params: dict[str, Any] = {}
    for name, value in compiled.construct_params().items():
        bind = compiled.binds.get(name)
        if bind is None:  # an escaped or renamed parameter: leave it to SQLAlchemy
            return None
        process = bind.type.dialect_impl(dialect).bind_processor(dialect)
        params[name] = value if process is None else process(value)
    # What a CursorResult keys its rows by, and the types whose result processors it applies:
    # the compiler's result columns (SQLAlchemy's own source for both).
    columns = compiled._result_columns
    return CompiledRead(
        compiled.string, params, [c.keyname for c in columns], [tuple(c.objects) for c in columns],
        [c.type for c in columns], dialect,
    )


def compile_key(dialect: Dialect) -> tuple[Any, ...]:
    """What a SELECT's compiled form depends on, among mdb's psycopg dialects: the class (sync or
    async), the server's version and string-escape setting, the pooler setting (what may be
    prepared) and the parameter style. Dialects with one key compile a statement alike, so a
    fan-out compiles it once per key, not once per dialect instance: each async engine builds a
    dialect of its own (the sync registry shares one per server), and keyed by instance a warm
    async fan-out over 32 shards spent 60% of its client time compiling (measured)."""
    return (type(dialect), dialect.server_version_info, getattr(dialect, "_backslash_escapes", None),
            getattr(dialect, "mdb_pooled", None), dialect.paramstyle)


def has_idle_connection(engine: Engine) -> bool:
    """Would a checkout from ``engine``'s pool reuse an idle connection as it is (no connect on
    this thread: not one due for ``pool_recycle`` either)? mdb's PostgreSQL engines pool with
    :class:`~mdb.budget.BudgetPool`, which can tell; any other pool is not asked."""
    pool = engine.pool
    return isinstance(pool, BudgetPool) and pool.idle_ready()


def read_many(
    targets: Sequence[tuple[Engine, CompiledRead]], window: int, observe: ShardObserver | None = None,
) -> list[list[tuple[Any, ...]] | Exception]:
    """Each ``(engine, read)``'s read, sent to all before any is read: per target its rows, or
    the exception its checkout, send or result raised (that connection invalidated).

    ``window`` caps the statements in flight at once, as the thread pool's workers do (then the
    oldest is read before the next is sent), so a process holds no more connections and loads
    the servers no more than it did with threads.
    Each statement runs without BEGIN: the engines run in driver autocommit, so it is a
    transaction of its own on the server (one snapshot of committed data). For an async engine,
    ``targets`` holds its ``sync_engine`` and this runs in SQLAlchemy's greenlet (``greenlet_spawn``).
    """
    outcomes: list[list[tuple[Any, ...]] | Exception] = [[] for _ in targets]
    in_flight: deque[_InFlight] = deque()
    limit = max(1, window)
    try:
        for i, (engine, read) in enumerate(targets):
            while len(in_flight) >= limit:
                _finish(in_flight, outcomes, observe)
            item = _InFlight(i, read, time.perf_counter())
            in_flight.append(item)  # before the checkout: interrupted in it or in the send, it is invalidated below
            try:
                item.fairy = engine.raw_connection()
                _send(item)
            except Exception as exc:
                in_flight.pop()
                outcomes[i] = exc
                if item.fairy is not None:
                    item.fairy.invalidate(exc)
        while in_flight:
            _finish(in_flight, outcomes, observe)
    except BaseException:
        # Interrupted (Ctrl-C in a wait or a send): the connections in flight may have a query running.
        for item in in_flight:
            if item.fairy is not None:
                item.fairy.invalidate()
        raise
    return outcomes


class _InFlight:
    """One shard's read between its send and its rows."""

    __slots__ = ("index", "read", "started", "fairy", "preparing", "by_name")

    def __init__(self, index: int, read: CompiledRead, started: float) -> None:
        self.index = index
        self.read = read
        self.started = started
        self.fairy: PoolProxiedConnection | None = None
        self.preparing: bytes | None = None
        """The name of the statement being prepared: its PREPARE is in flight, the query not yet."""
        self.by_name = False
        """The query in flight executes a statement prepared earlier on this connection."""


def _send(item: _InFlight) -> None:
    """Send the item's statement: executed by its prepared name, or prepared first (the query
    follows once the PREPARE is answered, in :func:`_finish`), or unnamed behind a pooler.

    Prepared because the server's parse and plan of each shard's statement took half a warm
    fan-out's time on 2 cores (a count over 128 shards: 29 -> 15 ms, measured); at most
    :data:`MAX_PREPARED` per connection, later ones go unnamed. A prepared statement that a
    schema change made stale fails its shard once; that connection is then dropped.
    """
    assert item.fairy is not None
    connection: Any = item.fairy.driver_connection
    query = item.read.query(connection)
    pgconn = connection.pgconn
    name = item.read.name(query)
    known = prepared_names(item.fairy).known if name is not None else None
    item.by_name = False
    if known is None or name is None:
        pgconn.send_query_params(query.query, query.params, param_types=query.types, param_formats=query.formats)
    elif name.decode() in known:
        pgconn.send_query_prepared(name, query.params, param_formats=query.formats)
        item.by_name = True
    elif sum(1 for n in known if n.startswith(PREPARED_PREFIX)) >= MAX_PREPARED:
        pgconn.send_query_params(query.query, query.params, param_types=query.types, param_formats=query.formats)
    else:
        pgconn.send_prepare(name, query.query, param_types=query.types)
        item.preparing = name
    pgconn.flush()  # the rest, if the socket was full, goes in _finish's execute() (psycopg's own send loop)


def _finish(in_flight: deque[_InFlight], outcomes: list[list[tuple[Any, ...]] | Exception], observe: ShardObserver | None) -> None:
    """Read the oldest item's answer: its rows, or (its PREPARE answered) send its query and queue it again."""
    item = in_flight.popleft()
    fairy = item.fairy
    assert fairy is not None
    connection: Any = fairy.driver_connection
    try:
        results = _wait(connection, pg_generators.execute(connection.pgconn))
        last = results[-1] if results else None
        sqlstate = last.error_field(pq.DiagnosticField.SQLSTATE) if last is not None else None
        wanted = pq.ExecStatus.COMMAND_OK if item.preparing is not None else pq.ExecStatus.TUPLES_OK
        if item.by_name and sqlstate == _NO_SUCH_STATEMENT:
            # Dropped behind our back (psycopg sends DEALLOCATE ALL after a ROLLBACK on a connection
            # where it prepared statements itself; so do DISCARD ALL and a pooler): what this
            # connection holds is unknown now (mdb.ownership asks the server next time). Unnamed, again.
            prepared_names(fairy).known = None
            _send(item)
            in_flight.append(item)
            return
        # On the connection already though not on record (mdb.ownership re-reads only its own names
        # after a PREPARE failed half-way): the name is the statement's hash, so it is this statement.
        if last is None or (last.status != wanted and not (item.preparing is not None and sqlstate == _ALREADY_PREPARED)):
            message = last.error_message.decode(errors="replace") if last is not None else "no result"
            raise ResultError(message.strip())
        if item.preparing is not None:
            known = prepared_names(fairy).known
            if known is not None:
                known.add(item.preparing.decode())
            item.preparing = None
            _send(item)
            in_flight.append(item)
            return
        outcomes[item.index] = item.read.load(connection, last)
    except Exception as exc:
        outcomes[item.index] = exc
        fairy.invalidate(exc)
        return
    except BaseException:
        fairy.invalidate()
        raise
    fairy.close()
    if observe is not None:
        observe(item.index, item.started, time.perf_counter())


def _wait(connection: Any, gen: Any) -> Any:
    """Run a psycopg generator to its end: psycopg's own wait (interrupts cancel the query), on
    the event loop for an async connection (from the greenlet :func:`read_many` runs in there)."""
    if isinstance(connection, psycopg.AsyncConnection):
        return await_(connection.wait(gen))
    return connection.wait(gen)
