"""The dialect strategies (mdb.dialects): what each server kind can do, on the real servers."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, select
from sqlalchemy.engine import make_url

from mdb.dialects import PostgresDialect, SqliteDialect, sql_dialect
from mdb.errors import MdbError
from mdb.gdid import GDID


def test_picks_the_strategy_from_any_handle(tmp_sqlite_urls: Callable[[int], list[str]]) -> None:
    engine = create_engine(tmp_sqlite_urls(1)[0])
    with engine.connect() as conn:
        assert isinstance(sql_dialect(conn), SqliteDialect)
    assert sql_dialect(engine) is sql_dialect(engine.dialect) is sql_dialect("sqlite")
    assert isinstance(sql_dialect(make_url("postgresql+psycopg://u@h/db")), PostgresDialect)
    engine.dispose()


def test_an_unsupported_server_is_one_clear_line() -> None:
    with pytest.raises(MdbError, match=r"PostgreSQL or SQLite, not 'mysql'"):
        sql_dialect(make_url("mysql://u@h/db"))


def _upsert_twice(url: str) -> list[tuple[int, str]]:
    engine = create_engine(url)
    table = Table("t", MetaData(), Column("k", Integer, primary_key=True), Column("v", String(10)))
    table.create(engine)
    try:
        with engine.begin() as conn:
            dialect = sql_dialect(conn)
            for value in ("a", "b"):
                stmt = dialect.insert(table).values(k=1, v=value)
                conn.execute(stmt.on_conflict_do_update(index_elements=[table.c.k], set_={"v": stmt.excluded.v}))
            return [tuple(row) for row in conn.execute(select(table))]
    finally:
        engine.dispose()


def test_upsert_on_sqlite_and_postgresql(tmp_sqlite_urls: Callable[[int], list[str]], pg_url: str) -> None:
    assert _upsert_twice(tmp_sqlite_urls(1)[0]) == [(1, "b")]
    assert _upsert_twice(pg_url) == [(1, "b")]


def test_gdid_literal_reads_back_the_same_bytes(tmp_sqlite_urls: Callable[[int], list[str]], pg_url: str) -> None:
    gdid = GDID(3, 7, 123456789)
    for url in (tmp_sqlite_urls(1)[0], pg_url):
        engine = create_engine(url)
        with engine.connect() as conn:
            literal = sql_dialect(conn).gdid_literal(gdid.hex)
            assert bytes(conn.exec_driver_sql(f"SELECT {literal}").scalar_one()) == bytes(gdid)
        engine.dispose()


def test_postgresql_advisory_locks_exclude_and_share(pg_url: str) -> None:
    engine = create_engine(pg_url)
    dialect = sql_dialect(engine)
    key = 0x6D6462746573
    with engine.connect() as a, engine.connect() as b:
        with a.begin(), b.begin():
            assert dialect.try_advisory_xact_lock(a, key, shared=True)
            assert dialect.try_advisory_xact_lock(b, key, shared=True)  # shared with shared
            assert not dialect.try_advisory_lock(b, key, shared=False)  # exclusive refused while shared held
        assert dialect.try_advisory_lock(a, key, shared=False)  # both transactions ended: free again
        a.commit()  # a session lock outlives its transaction
        with b.begin():
            assert not dialect.try_advisory_xact_lock(b, key, shared=True)
        dialect.advisory_unlock(a, key, shared=False)
        a.commit()
        with b.begin():
            assert dialect.try_advisory_xact_lock(b, key, shared=True)
        assert dialect.backend_pid(a) != dialect.backend_pid(b)
    engine.dispose()


def test_sqlite_has_no_locks_to_take_and_no_server_session(tmp_sqlite_urls: Callable[[int], list[str]]) -> None:
    engine = create_engine(tmp_sqlite_urls(1)[0])
    dialect = sql_dialect(engine)
    with engine.connect() as conn:
        assert dialect.try_advisory_xact_lock(conn, 1, shared=False)
        assert dialect.backend_pid(conn) is None
        dialect.statement_timeout(conn, 10)  # nothing to set: the callers' checks between phases bound it
        dialect.lock_timeout(conn, 10)
    assert not dialect.enforces_widths and PostgresDialect.enforces_widths
    engine.dispose()


def test_urls_are_normalised_by_their_dialect() -> None:
    from mdb.dialects import find_sql_dialect
    from mdb.urls import sqlalchemy_url

    url = sqlalchemy_url("postgresql://u@h:6432/db?password=s3cret&sslmode=require")
    assert url.drivername == "postgresql+psycopg"
    assert url.password == "s3cret" and "password" not in url.query and "s3cret" not in repr(url)
    assert sqlalchemy_url("sqlite:///f.db").drivername == "sqlite"
    assert find_sql_dialect(make_url("mongodb://h/x")) is None
    assert PostgresDialect().instance(url) == "h:6432"
    assert SqliteDialect().instance(make_url("sqlite:///f.db")) is None


@pytest.mark.parametrize(("url", "file"), [("sqlite:///rel/f.db", "rel/f.db"), ("sqlite://", None), ("sqlite:///:memory:", None),
                                           ("postgresql+psycopg://u@h/db", None)])
def test_only_an_embedded_database_is_a_file(url: str, file: str | None) -> None:
    from mdb.partition_map import sqlite_file

    assert sqlite_file(url) == file
