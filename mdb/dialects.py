"""What differs between the SQL servers mdb runs on, in one strategy object per dialect.

Features ask a :class:`SqlDialect` for a capability (an upsert, a lock, a timeout, a snapshot)
instead of branching on ``dialect.name``: SQLAlchemy keeps its dialect differences in dialect
classes the same way, and a third SQL server would be one more class here, not a hunt through
the features. SQLite is the embedded default (one writer per file, no server-side timeouts or
advisory locks, widths not enforced); PostgreSQL is production.

The objects are stateless singletons; :func:`sql_dialect` picks one for a connection, an engine,
a SQLAlchemy dialect, a URL or a backend name, and refuses any other server with one line.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import Table, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Dialect, Engine
from sqlalchemy.sql.elements import ColumnElement

from mdb.errors import MdbError

__all__ = ["PostgresDialect", "SqlDialect", "SqliteDialect", "UnknownDialect", "find_sql_dialect", "sql_dialect"]


class SqlDialect:
    """The capabilities mdb needs from a SQL server; the defaults are the embedded (SQLite) ones.

    ``enforces_widths``: VARCHAR(n) and NUMERIC(p, s) reject wider values (a schema check must
    compare widths). ``server_side_timeouts``: statement and lock timeouts exist (else the
    callers' checks between phases are the only bound). ``advisory_locks``: named locks that
    several sessions of one server can share or exclude; without them (SQLite) one writer per
    file already serialises what they would. ``copy``: ``COPY ... TO/FROM STDOUT`` streams.
    ``one_writer_per_file``: the database is a file that lets one writer in at a time (parallel
    movers would wait on each other; readers get an engine of their own that never takes the
    write lock). ``streams_replicas``: a ``replica:`` URL is a streaming standby whose lag the
    throttle can watch.
    """

    name: ClassVar[str]
    enforces_widths: ClassVar[bool] = False
    server_side_timeouts: ClassVar[bool] = False
    advisory_locks: ClassVar[bool] = False
    copy: ClassVar[bool] = False
    terminates_sessions: ClassVar[bool] = False
    one_writer_per_file: ClassVar[bool] = False
    streams_replicas: ClassVar[bool] = False

    def insert(self, table: Table) -> Any:
        """An INSERT that supports ``on_conflict_do_update`` / ``on_conflict_do_nothing``."""
        raise NotImplementedError

    def bytewise(self, expr: ColumnElement[Any]) -> ColumnElement[Any]:
        """A string expression compared by its UTF-8 bytes, the order a fan-out merges shard
        results in (SQLite's default BINARY collation already is that order)."""
        return expr

    def gdid_literal(self, hex_digits: str) -> str:
        """A 12-byte GDID as an SQL literal of the binary column type."""
        return f"X'{hex_digits}'"

    def snapshot(self, conn: Connection, *, read_only: bool = False) -> None:
        """Make the transaction just begun on ``conn`` read one snapshot (SQLite's transaction already does)."""

    def statement_timeout(self, conn: Connection, ms: int, *, also: str = "") -> None:
        """``SET LOCAL statement_timeout`` (plus ``also``, more SET LOCALs, in the same round trip) where it exists."""

    def lock_timeout(self, conn: Connection, ms: int) -> None:
        """``SET LOCAL lock_timeout`` where it exists: a lock wait ends with an error instead of queueing."""

    def advisory_xact_lock(self, conn: Connection, key: int) -> None:
        """Wait for a transaction-scoped exclusive advisory lock (where there are none, the
        server's one writer at a time already serialises the transactions it would)."""

    def try_advisory_xact_lock(self, conn: Connection, key: int, *, shared: bool) -> bool:
        """Take a transaction-scoped advisory lock without waiting; True where there are none to take."""
        return True

    def try_advisory_lock(self, conn: Connection, key: int, *, shared: bool) -> bool:
        """Take a session-scoped advisory lock without waiting (undo with :meth:`advisory_unlock`)."""
        return True

    def advisory_unlock(self, conn: Connection, key: int, *, shared: bool) -> None:
        """Release what :meth:`try_advisory_lock` took."""

    def backend_pid(self, conn: Connection) -> int | None:
        """The server process of this session (to end sessions blocking it), or None where there is none."""
        return None

    def blocking_pids(self, conn: Connection, pid: int) -> list[int]:
        """The server processes whose locks session ``pid`` waits for (``terminates_sessions`` servers)."""
        return []

    def terminate(self, conn: Connection, pid: int) -> None:
        """End server process ``pid``'s session (its transaction rolls back); ``terminates_sessions`` servers."""
        raise NotImplementedError(f"{self.name} cannot end another session")

    def normalise_url(self, url: URL) -> URL:
        """``url`` as mdb connects with it (the driver it picks, options moved where they are masked)."""
        return url

    def database_file(self, url: URL) -> str | None:
        """The database file ``url`` names, as written; None where the database is not a file of
        its own (a server, an in-memory database, a ``file:`` URI)."""
        return None

    def url_problem(self, url: URL) -> str | None:
        """Why a map may not name ``url`` (after the server's name and masked URL), or None."""
        return None

    def instance(self, url: URL) -> str | None:
        """The server instance whose connection limit ``url``'s database shares (``host:port``), or None where
        there is no such limit to budget (an embedded file)."""
        return None


class PostgresDialect(SqlDialect):
    name = "postgresql"
    enforces_widths = True
    server_side_timeouts = True
    advisory_locks = True
    copy = True
    terminates_sessions = True
    streams_replicas = True

    def insert(self, table: Table) -> Any:
        return postgresql.insert(table)

    def gdid_literal(self, hex_digits: str) -> str:
        return f"'\\x{hex_digits}'::bytea"

    def bytewise(self, expr: ColumnElement[Any]) -> ColumnElement[Any]:
        return expr.collate("C")  # the database's collation may be locale-aware

    def snapshot(self, conn: Connection, *, read_only: bool = False) -> None:
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ" + (", READ ONLY" if read_only else ""))

    def statement_timeout(self, conn: Connection, ms: int, *, also: str = "") -> None:
        conn.exec_driver_sql(f"SET LOCAL statement_timeout = {int(ms)}" + (f"; {also}" if also else ""))

    def lock_timeout(self, conn: Connection, ms: int) -> None:
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(ms)}ms'")

    def advisory_xact_lock(self, conn: Connection, key: int) -> None:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})

    def try_advisory_xact_lock(self, conn: Connection, key: int, *, shared: bool) -> bool:
        function = "pg_try_advisory_xact_lock_shared" if shared else "pg_try_advisory_xact_lock"
        return bool(conn.execute(text(f"SELECT {function}(:key)"), {"key": key}).scalar())

    def try_advisory_lock(self, conn: Connection, key: int, *, shared: bool) -> bool:
        function = "pg_try_advisory_lock_shared" if shared else "pg_try_advisory_lock"
        return bool(conn.execute(text(f"SELECT {function}(:key)"), {"key": key}).scalar())

    def advisory_unlock(self, conn: Connection, key: int, *, shared: bool) -> None:
        function = "pg_advisory_unlock_shared" if shared else "pg_advisory_unlock"
        conn.execute(text(f"SELECT {function}(:key)"), {"key": key})

    def backend_pid(self, conn: Connection) -> int | None:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())

    def blocking_pids(self, conn: Connection, pid: int) -> list[int]:
        return [int(p) for p in conn.execute(text("SELECT unnest(pg_blocking_pids(:pid))"), {"pid": pid}).scalars()]

    def terminate(self, conn: Connection, pid: int) -> None:
        conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})

    def normalise_url(self, url: URL) -> URL:
        if url.drivername in ("postgresql", "postgres"):
            url = url.set(drivername="postgresql+psycopg")
        if "password" in url.query:
            # libpq's ?password= means the same as the userinfo password (and wins over it, as the
            # dialect applies query args last). Kept in the query, SQLAlchemy would print it in
            # repr(engine) and str(url); as the URL's password it is masked there.
            value = url.query["password"]
            password = value[-1] if isinstance(value, tuple) else value
            url = url.difference_update_query(["password"]).set(password=password)
        return url

    def instance(self, url: URL) -> str | None:
        host = url.host or url.query.get("host") or "localhost"
        if isinstance(host, tuple):  # ?host=a&host=b: libpq tries them in order; budget them as one
            host = ",".join(host)
        return f"{host}:{url.port or 5432}"


class SqliteDialect(SqlDialect):
    name = "sqlite"
    one_writer_per_file = True

    def insert(self, table: Table) -> Any:
        return sqlite.insert(table)

    def database_file(self, url: URL) -> str | None:
        database = url.database
        if not database or database == ":memory:" or database.startswith("file:"):
            return None
        return database

    def url_problem(self, url: URL) -> str | None:
        if url.database in (None, "", ":memory:"):
            # An in-memory database is a new, empty one on every connection: nothing written stays.
            return "a SQLite server needs a file path (sqlite:///PATH); an in-memory database keeps nothing"
        return None


_DIALECTS: dict[str, SqlDialect] = {d.name: d for d in (PostgresDialect(), SqliteDialect())}
_DIALECTS["postgres"] = _DIALECTS["postgresql"]  # the scheme libpq accepts too (mdb.urls.sqlalchemy_url renames it)


def find_sql_dialect(of: Connection | Engine | Dialect | URL | str) -> SqlDialect | None:
    """The strategy for ``of`` like :func:`sql_dialect`, or None for a server mdb has none for (a MongoDB URL)."""
    try:
        return sql_dialect(of)
    except UnknownDialect:
        return None


class UnknownDialect(MdbError):
    """A SQL server mdb has no :class:`SqlDialect` for."""


def sql_dialect(of: Connection | Engine | Dialect | URL | str) -> SqlDialect:
    """The strategy for ``of`` (a connection, engine, SQLAlchemy dialect, URL or backend name)."""
    if isinstance(of, (Connection, Engine)):
        name = of.dialect.name
    elif isinstance(of, Dialect):
        name = of.name
    elif isinstance(of, URL):
        name = of.get_backend_name()
    else:
        name = of
    try:
        return _DIALECTS[name]
    except KeyError:
        raise UnknownDialect(f"mdb runs on PostgreSQL or SQLite, not {name!r}") from None
