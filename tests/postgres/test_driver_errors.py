"""Translated driver errors keep the SQLSTATE and the driver's error, and never show a secret.

``mdb.dberrors.translated`` turns a driver error into an mdb error naming the server; the
error keeps ``.sqlstate`` and chains the driver's error as ``__cause__`` (masked when its text,
the statement's parameters included, would show a password), so a traceback stays useful.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from mdb import DuplicateRowError, SchemaError, ServerUnavailableError
from mdb.dberrors import DriverError, translated

SECRET = "Tr0ub4dor-and-3"


def _raised(engine: sa.Engine, statement: str, **params: object) -> BaseException:
    with pytest.raises(Exception) as info:
        with translated("s1"), engine.begin() as conn:
            conn.execute(sa.text(statement), params)
    return info.value


def _printed(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.fixture
def sqlite(tmp_path: Path) -> sa.Engine:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 's1.db'}")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (id INTEGER PRIMARY KEY, note TEXT)"))
        conn.execute(sa.text("INSERT INTO t VALUES (1, 'one')"))
    return engine


def test_a_duplicate_chains_the_driver_error_itself_when_its_text_holds_no_secret(sqlite: sa.Engine) -> None:
    err = _raised(sqlite, "INSERT INTO t (id, note) VALUES (:id, :note)", id=1, note="again")
    assert isinstance(err, DuplicateRowError) and "id=1" in str(err)
    assert err.sqlstate is None  # SQLite has no SQLSTATE
    assert isinstance(err.__cause__, DBAPIError) and "UNIQUE constraint failed: t.id" in str(err.__cause__)


@pytest.mark.parametrize("secret_form", [f"postgresql://app:{SECRET}@db.internal/app", f"host=db password={SECRET}"])
def test_a_cause_whose_text_would_show_a_password_is_chained_masked(sqlite: sa.Engine, secret_form: str) -> None:
    err = _raised(sqlite, "INSERT INTO missing (note) VALUES (:note)", note=secret_form)
    assert isinstance(err, SchemaError) and "missing" in str(err)
    assert isinstance(err.__cause__, DriverError) and "no such table: missing" in str(err.__cause__)
    printed = _printed(err)
    assert SECRET not in printed and "***" in printed and "OperationalError" in printed


def test_a_refused_connection_keeps_the_driver_error_and_hides_the_url_password() -> None:
    engine = sa.create_engine(f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/app", connect_args={"connect_timeout": 2})
    try:
        err = _raised(engine, "SELECT 1")
    finally:
        engine.dispose()
    assert isinstance(err, ServerUnavailableError) and err.server == "s1"
    assert err.__cause__ is not None and SECRET not in _printed(err)


def test_a_postgresql_error_keeps_its_sqlstate(pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id INTEGER PRIMARY KEY)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
        duplicate = _raised(engine, "INSERT INTO t VALUES (1)")
        missing = _raised(engine, "SELECT missing_column FROM t")
    finally:
        engine.dispose()
    assert isinstance(duplicate, DuplicateRowError) and duplicate.sqlstate == "23505"
    assert isinstance(duplicate.__cause__, DBAPIError) and getattr(duplicate.__cause__.orig, "sqlstate", None) == "23505"
    assert isinstance(missing, SchemaError) and missing.sqlstate == "42703"
