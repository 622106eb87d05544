"""Turning driver errors into mdb errors that name the server and hide secrets.

PostgreSQL errors are classified by SQLSTATE; the driver's words are read only where it gives
no code (SQLite, and libpq before a connection exists). A translated error keeps the code as
``.sqlstate`` and the driver's error as ``__cause__``: the original when its text (message,
statement, parameters) holds nothing that looks like a secret, else a :class:`DriverError`
with that text masked. A traceback of a translated error therefore never shows a password.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.exc import DBAPIError

from mdb.budget import is_capacity_refusal
from mdb.errors import (
    AuthenticationError, CapacityError, DuplicateRowError, MapError, MdbError, QueryError, SchemaError, ServerUnavailableError,
    TransactionConflictError,
)
from mdb.gdid import GDID
from mdb.urls import mask_secrets

__all__ = ["DriverError", "describe", "is_lock_timeout", "raise_translated", "sqlstate_of", "translate", "translated"]

_MISSING_TABLE = ("no such table",)  # SQLite; PostgreSQL says it by SQLSTATE
_PG_UNDEFINED_TABLE = "42P01"
_PG_UNDEFINED_FUNCTION = "42883"
_PREPARED_SQLSTATES = frozenset({"42P05", "26000"})
"""duplicate_prepared_statement, invalid_sql_statement_name: a prepared statement met another server session."""
_MISSING_COLUMN = ("no such column", "has no column named")
"""SQLite's words for a column the table lacks (PostgreSQL's is the UndefinedColumn class): the
table differs from its model, which ``mdb schema check`` lists in full."""
_AUTH_SQLSTATES = ("28P01", "28000")
"""invalid_password and invalid_authorization_specification (unknown role, no pg_hba.conf entry)."""
_AUTH_FAILED = (
    "password authentication failed",
    "authentication failed for user",
    "no password supplied",
    "no pg_hba.conf entry",
    "pg_hba.conf rejects connection",
)
_AUTH_ROLE = re.compile(r'role "[^"]*" does not exist')
"""A connection's words for refused credentials: checked before the "connection failed" of
:data:`_UNREACHABLE`, which the same message starts with (the server answered; it said no)."""
_LOCK_NOT_AVAILABLE = "55P03"
"""PostgreSQL's lock_not_available: ``lock_timeout`` (or NOWAIT) ended a wait for a lock."""
_UNREACHABLE_SQLSTATES = ("57P01", "57P02", "57P03", "57P05", "25P03")
"""The server ended or refused the session: admin_shutdown, crash_shutdown, cannot_connect_now,
idle_session_timeout, idle_in_transaction_session_timeout; besides class 08 (connection_exception)."""
_PG_UNDEFINED_COLUMN = "42703"
_PG_READ_ONLY = "25006"
"""read_only_sql_transaction: a write in a readonly briefcase session (``READ ONLY`` on PostgreSQL) or on a replica."""
_UNREACHABLE = (
    "connection refused",
    "could not connect",
    "connection failed",
    "server closed the connection",
    "terminating connection",
    "unable to open database file",
    "the database system is shutting down",
    "the database system is starting up",
    "no such host",
    "timeout expired",
    "connection is lost",
    "consuming input failed",
    "connection timeout",
)
# PostgreSQL aborts one transaction of a deadlock (40P01) or a serialization conflict (40001);
# the transaction did nothing, so it is retryable as a whole.
_CONFLICT_SQLSTATES = ("40P01", "40001")
# SQLite's SQLITE_BUSY/SQLITE_LOCKED once the busy timeout ran out: another writer held the file.
# The statement did nothing and the caller's transaction is rolled back, so it is retryable too.
_SQLITE_BUSY = ("database is locked", "database table is locked")
_SQLITE_BUSY_CODES = ("SQLITE_BUSY", "SQLITE_LOCKED")
"""sqlite3's name for the result code (``sqlite_errorname``); the words above are the fallback."""
_SQLITE_UNIQUE_CODES = ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")
_CONNINFO_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'|\S+)", re.I)
"""libpq's ``key=value`` form (``password=...``), which :func:`mdb.urls.mask_secrets` does not know."""


class DriverError(Exception):
    """A driver error's text masked of secrets: the ``__cause__`` of a translated error whose
    original text could show one (the original stays out of the traceback)."""

    def __init__(self, kind: str, text: str, sqlstate: str | None) -> None:
        super().__init__(f"({kind}) {text}")
        self.kind = kind
        self.sqlstate = sqlstate


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error (or of the DBAPIError wrapping it); None when it has none."""
    code = getattr(getattr(exc, "orig", None) or exc, "sqlstate", None)
    return code if isinstance(code, str) else None


def _mask(text: str) -> str:
    return _CONNINFO_PASSWORD.sub(lambda m: f"{m['head']}***", mask_secrets(text))


def _cause(exc: DBAPIError) -> BaseException:
    """What a translated error chains: ``exc`` itself, or a masked stand-in when its text would show a secret."""
    text = str(exc)
    masked = _mask(text)
    if masked == text:
        return exc
    return DriverError(f"{type(exc.orig).__module__}.{type(exc.orig).__qualname__}", masked, sqlstate_of(exc))


_STATEMENT_TABLE = re.compile(r'^\s*(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM|SELECT\b.*?\bFROM)\s+"?([A-Za-z_][\w$]*)', re.I | re.S)


def _statement_table(statement: str | None) -> str | None:
    """The table a failed statement writes (or first reads), for an error that should name it.

    SQLite's "no such column: memo" does not say which table lacks it; the statement does.
    """
    found = _STATEMENT_TABLE.match(statement or "")
    return found.group(1) if found else None


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL's "canceling statement due to lock timeout" (nothing was changed)."""
    return isinstance(exc, DBAPIError) and sqlstate_of(exc) == _LOCK_NOT_AVAILABLE


def _is_auth_failure(sqlstate: str | None, lowered: str) -> bool:
    return (sqlstate in _AUTH_SQLSTATES or any(s in lowered for s in _AUTH_FAILED)
            or _AUTH_ROLE.search(lowered) is not None)


def describe(exc: BaseException) -> str:
    """The driver's own message (first line), masked; without SQLAlchemy's SQL echo."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return mask_secrets(text[0] if text else type(orig).__name__)


_PG_UNIQUE = "23505"
_PG_KEY = re.compile(r"Key \((?P<cols>.*)\)=\((?P<vals>.*)\) already exists")
_PG_BYTEA_GDID = re.compile(r"^\\x([0-9a-fA-F]{24})$")
_SQLITE_UNIQUE = "UNIQUE constraint failed: "


def _pg_value(text: str) -> str:
    """A key value as PostgreSQL's detail shows it; a 12-byte bytea is a GDID: show its text form."""
    m = _PG_BYTEA_GDID.match(text)
    return str(GDID.from_bytes(bytes.fromhex(m.group(1)))) if m else text


def _param_value(value: Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)) and len(value) == 12:
        return str(GDID.from_bytes(bytes(value)))
    return str(value)


_INSERT_COLUMNS = re.compile(r"^\s*INSERT\s+INTO\s+\S+\s*\((?P<cols>[^)]*)\)\s*VALUES", re.IGNORECASE)


def _insert_params(exc: DBAPIError) -> dict[str, Any]:
    """column -> value of a failed one-row INSERT (named or positional parameters); else empty."""
    if isinstance(exc.params, dict):
        return exc.params
    m = _INSERT_COLUMNS.match(exc.statement or "")
    if m is None or not isinstance(exc.params, tuple):
        return {}  # not an INSERT, or executemany: which row collided is unknown
    cols = [c.strip().strip('"') for c in m.group("cols").split(",")]
    return dict(zip(cols, exc.params)) if len(cols) == len(exc.params) else {}


def _duplicate(server: str, exc: DBAPIError) -> DuplicateRowError | None:
    """A unique/primary-key violation as a DuplicateRowError naming server, table and key; else None.

    PostgreSQL says the table and ``Key (cols)=(values)``; SQLite only ``table.column`` names, so
    the values come from the statement's parameters when it inserted one row.
    """
    orig = exc.orig
    if sqlstate_of(exc) == _PG_UNIQUE:
        diag = getattr(orig, "diag", None)
        table = getattr(diag, "table_name", None)
        m = _PG_KEY.search(getattr(diag, "message_detail", None) or "")
        if m is None:
            return DuplicateRowError(server, table, f"constraint {getattr(diag, 'constraint_name', None)!r}")
        cols, vals = m.group("cols").split(", "), m.group("vals").split(", ")
        if len(cols) != len(vals):
            return DuplicateRowError(server, table, f"({m.group('cols')})=({m.group('vals')})")
        return DuplicateRowError(server, table, ", ".join(f"{c}={_pg_value(v)}" for c, v in zip(cols, vals)))
    text = str(orig)
    if getattr(orig, "sqlite_errorname", None) not in _SQLITE_UNIQUE_CODES or not text.startswith(_SQLITE_UNIQUE):
        return None
    qualified = text[len(_SQLITE_UNIQUE):].split(", ")
    table = qualified[0].rsplit(".", 1)[0] if "." in qualified[0] else None
    cols = [q.rsplit(".", 1)[-1] for q in qualified]
    params = _insert_params(exc)
    if all(c in params for c in cols):
        return DuplicateRowError(server, table, ", ".join(f"{c}={_param_value(params[c])}" for c in cols))
    return DuplicateRowError(server, table, f"key ({', '.join(cols)})")


def translate(server: str, exc: BaseException) -> MdbError | None:
    """An mdb error for a driver error on ``server``, or None when it is the caller's own error.

    The error carries the driver's SQLSTATE (``.sqlstate``) and the driver's error as its
    ``__cause__``, masked where its text would show a secret (:class:`DriverError`).
    """
    if not isinstance(exc, DBAPIError):
        return None
    mapped = _classify(server, exc)
    if mapped is not None:
        mapped.sqlstate = sqlstate_of(exc)
        mapped.__cause__ = _cause(exc)
    return mapped


def _classify(server: str, exc: DBAPIError) -> MdbError | None:
    duplicate = _duplicate(server, exc)  # first: exact (SQLSTATE / result code), and key values may hold any text
    if duplicate is not None:
        return duplicate
    detail = describe(exc)
    sqlstate = sqlstate_of(exc)
    if sqlstate in _CONFLICT_SQLSTATES:  # exact, like the duplicate check
        return TransactionConflictError(server, detail)
    if is_capacity_refusal(exc.orig):  # before the text rules: "connection failed: ... too many clients"
        return CapacityError(f"server {server!r} refused a connection: it is full, not down (retry later, or "
                             f"lower the connection budget, docs/operations.md): {detail}", server=server)
    lowered = str(exc.orig).lower()
    if _is_auth_failure(sqlstate, lowered):  # before the text rules: "connection failed: ... password authentication failed"
        return AuthenticationError(server, detail)
    if getattr(exc.orig, "sqlite_errorname", None) in _SQLITE_BUSY_CODES or any(s in lowered for s in _SQLITE_BUSY):
        return TransactionConflictError(server, detail)
    if (exc.connection_invalidated or (sqlstate is not None and sqlstate.startswith("08")) or sqlstate in _UNREACHABLE_SQLSTATES
            or (sqlstate is None and any(s in lowered for s in _UNREACHABLE))):
        return ServerUnavailableError(server, detail)
    if sqlstate == _PG_UNDEFINED_COLUMN or (sqlstate is None and any(s in lowered for s in _MISSING_COLUMN)):
        table = _statement_table(exc.statement)
        where = f"server {server!r}, table {table!r}" if table else f"server {server!r}"
        return SchemaError(f"{where}: {detail} (check the table against its model: `mdb schema check MAP`)")
    if sqlstate == _PG_READ_ONLY:
        return QueryError(f"server {server!r}: {detail} (a readonly briefcase session, or a replica, cannot write: "
                          "open the session with readonly=False to write)")
    if sqlstate in _PREPARED_SQLSTATES:
        return MapError(f"server {server!r}: {detail}: its connections reach a transaction-pooling pooler (PgBouncer) "
                        "that the map does not declare: add `pooler: transaction` to this server in the map (docs/operations.md)")
    # Only a missing table, or a missing function of mdb's own (mdb_check_read, ...), is cured by
    # `schema apply`; another "function/type ... does not exist" is the statement's own mistake.
    if sqlstate == _PG_UNDEFINED_TABLE or (sqlstate == _PG_UNDEFINED_FUNCTION and "mdb_" in lowered) or (
        sqlstate is None and any(s in lowered for s in _MISSING_TABLE)
    ):
        # Not a bare "run schema apply": a missing table is also what a mistyped URL that reaches
        # another (empty) database looks like, and schema apply refuses that (server identity).
        return SchemaError(f"server {server!r}: {detail} (if the map's URL for {server!r} reaches the right database, "
                           "`mdb schema apply MAP` creates it)")
    return None


class translated:  # noqa: N801 (used as a function: ``with translated(server):``)
    """Re-raise a driver error from the block as the mdb error :func:`translate` gives, if any.

    The one way mdb turns "connection refused" or "no such table" into an error that names the
    server and hides the URL; anything else (the caller's own errors) passes through unchanged.
    A class rather than a ``@contextmanager`` generator: every briefcase session enters two,
    and the generator's machinery was ~10 of the Python calls mdb adds to a session (measured).
    """

    __slots__ = ("server",)

    def __init__(self, server: str) -> None:
        self.server = server

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        # Returns None: the block's own exception, if not translated, goes on unchanged.
        if exc is not None:
            raise_translated(self.server, exc)


def raise_translated(server: str, exc: BaseException) -> None:
    """Raise the mdb error :func:`translate` gives for ``exc`` on ``server``, if any; else return
    (the caller lets ``exc`` go on). What ``with translated(server)`` does on the way out, for a
    path that handles its exception itself (the session's own context manager, its open)."""
    if isinstance(exc, DBAPIError):
        mapped = translate(server, exc)
        if mapped is not None:
            raise mapped from mapped.__cause__  # the driver's error, masked (translate)
