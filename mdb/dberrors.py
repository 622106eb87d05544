"""Turning driver errors into mdb errors that name the server and hide secrets."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.exc import DBAPIError

from mdb.errors import MdbError, SchemaError, ServerUnavailableError, TransactionConflictError
from mdb.urls import mask_secrets

__all__ = ["describe", "translate", "translated"]

_MISSING_TABLE = ("does not exist", "no such table", "UndefinedTable")
_MISSING_COLUMN = ("no such column", "has no column named")
"""SQLite's words for a column the table lacks (PostgreSQL's is the UndefinedColumn class): the
table differs from its model, which ``mdb schema check`` lists in full."""
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


_STATEMENT_TABLE = re.compile(r'^\s*(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM|SELECT\b.*?\bFROM)\s+"?([A-Za-z_][\w$]*)', re.I | re.S)


def _statement_table(statement: str | None) -> str | None:
    """The table a failed statement writes (or first reads), for an error that should name it.

    SQLite's "no such column: memo" does not say which table lacks it; the statement does.
    """
    found = _STATEMENT_TABLE.match(statement or "")
    return found.group(1) if found else None


def describe(exc: BaseException) -> str:
    """The driver's own message (first line), masked; without SQLAlchemy's SQL echo."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return mask_secrets(text[0] if text else type(orig).__name__)


def translate(server: str, exc: BaseException) -> MdbError | None:
    """An mdb error for a driver error on ``server``, or None when it is the caller's own error."""
    if not isinstance(exc, DBAPIError):
        return None
    detail = describe(exc)
    lowered = str(getattr(exc, "orig", exc)).lower()
    if exc.connection_invalidated or any(s in lowered for s in _UNREACHABLE):
        return ServerUnavailableError(server, detail)
    if type(exc.orig).__name__ == "UndefinedColumn" or any(s in lowered for s in _MISSING_COLUMN):
        table = _statement_table(exc.statement)
        where = f"server {server!r}, table {table!r}" if table else f"server {server!r}"
        return SchemaError(f"{where}: {detail} (check the table against its model: `mdb schema check MAP`)")
    if any(s.lower() in lowered for s in _MISSING_TABLE) or type(exc.orig).__name__ == "UndefinedTable":
        return SchemaError(f"server {server!r}: {detail} (run `mdb schema apply MAP`)")
    if getattr(exc.orig, "sqlstate", None) in _CONFLICT_SQLSTATES:
        return TransactionConflictError(server, detail)
    return None


@contextmanager
def translated(server: str) -> Iterator[None]:
    """Re-raise a driver error from the block as the mdb error :func:`translate` gives, if any.

    The one way mdb turns "connection refused" or "no such table" into an error that names the
    server and hides the URL; anything else (the caller's own errors) passes through unchanged.
    """
    try:
        yield
    except DBAPIError as exc:
        mapped = translate(server, exc)
        if mapped is not None:
            raise mapped from None
        raise
