"""The engines' BEGIN hook: a typed prelude set on a connection runs once, with BEGIN, and its rows are taken.

The hook (:func:`mdb.engines.set_prelude`, :func:`mdb.engines.take_result`) is the one way
code hands the engine work to do right after BEGIN; what the work is lives with its owner
(the ownership check's SQL in :mod:`mdb.ownership`). These tests drive the hook with preludes
of their own, so they pin the engine's side of the contract, not the check's.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from mdb.engines import BeginPrelude, EngineRegistry, KnownRows, PreparedNames, Rows, prelude_of, set_prelude, take_result
from mdb.ownership import Prelude
from mdb.partition_map import ServerSpec


class Recording:
    """A prelude that records how the engine called it and returns one row naming the call."""

    read_only = False

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def begin_postgresql(self, connection: psycopg.Connection[Any], prepared: PreparedNames) -> Rows | None:
        self.calls.append("postgresql")
        connection.execute("BEGIN")
        return [("postgresql",)]

    def begin_postgresql_pooled(self, connection: psycopg.Connection[Any]) -> Rows | None:
        self.calls.append("postgresql_pooled")
        connection.execute("BEGIN")
        return [("postgresql_pooled",)]

    def begin_sqlite(self, cursor: sqlite3.Cursor, begin: str, known: KnownRows) -> Rows | None:
        self.calls.append(begin)
        cursor.execute(begin)
        if self.fail:
            raise RuntimeError("the prelude failed")
        return [("sqlite",)]


def _hook(prelude: BeginPrelude) -> BeginPrelude:
    return prelude  # mypy: Recording and ownership.Prelude both satisfy the engines' protocol


@pytest.fixture
def registry(tmp_path: Path) -> Any:
    reg = EngineRegistry({"s": ServerSpec(primary=f"sqlite:///{tmp_path / 's.db'}")})
    yield reg
    reg.dispose()


@pytest.mark.parametrize(("readonly", "begin"), [(False, "BEGIN IMMEDIATE"), (True, "BEGIN")])
def test_sqlite_prelude_runs_once_with_begin(registry: EngineRegistry, readonly: bool, begin: str) -> None:
    prelude = Recording()
    with registry.engine("s", readonly=readonly).connect() as conn:
        set_prelude(conn, _hook(prelude))
        assert prelude_of(conn) is prelude
        conn.begin()
        assert prelude.calls == [begin]
        assert prelude_of(conn) is None  # taken by that BEGIN
        assert take_result(conn) == [("sqlite",)]
        assert take_result(conn) is None  # taken once
        conn.rollback()
        conn.begin()  # the next transaction of the same pooled connection runs no prelude
        assert prelude.calls == [begin] and take_result(conn) is None
        conn.rollback()


def test_a_failed_prelude_is_not_run_by_the_next_transaction(registry: EngineRegistry) -> None:
    failing = Recording(fail=True)
    with registry.engine("s").connect() as conn:
        set_prelude(conn, failing)
        with pytest.raises(RuntimeError, match="the prelude failed"):
            conn.begin()
    with registry.engine("s").connect() as conn:  # the same pooled DBAPI connection
        conn.begin()
        assert failing.calls == ["BEGIN IMMEDIATE"] and take_result(conn) is None
        conn.rollback()


@pytest.mark.postgres
def test_postgres_prelude_prepares_once_and_survives_deallocate(pg_url: str) -> None:
    """The ownership check's :class:`~mdb.ownership.Prelude` through the hook, with a statement of its own."""
    probe = Prelude(("EXECUTE mdb_test_probe(41)",), {"mdb_test_probe": "(integer) AS SELECT $1 + 1"},
                    unprepared=("SELECT 41 + 1",))
    reg = EngineRegistry({"pg": ServerSpec(primary=pg_url)})
    try:
        engine = reg.engine("pg")
        for _ in range(2):
            with engine.connect() as conn:
                set_prelude(conn, _hook(probe))
                conn.begin()
                assert take_result(conn) == [(42,)]
                prepared = conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_prepared_statements WHERE name = 'mdb_test_probe'"
                ).scalar_one()
                assert prepared == 1
                assert conn.in_transaction()
                conn.rollback()
        with engine.connect() as conn:
            conn.exec_driver_sql("DEALLOCATE mdb_test_probe")  # dropped behind the prelude's back
            conn.commit()
            set_prelude(conn, probe)
            conn.begin()
            assert take_result(conn) == [(42,)]  # prepared again, once
            conn.rollback()
    finally:
        reg.dispose()


@pytest.mark.postgres
def test_postgres_pooled_engine_sends_the_unprepared_form(pg_url: str) -> None:
    """Behind a transaction pooler nothing is prepared: the prelude's unprepared statements run."""
    probe = Prelude(("EXECUTE mdb_test_absent(1)",), {"mdb_test_absent": "(integer) AS SELECT $1"},
                    unprepared=("SELECT 'unprepared'",))
    reg = EngineRegistry({"pg": ServerSpec(primary=pg_url, pooler="transaction")})
    try:
        with reg.engine("pg").connect() as conn:
            set_prelude(conn, probe)
            conn.begin()
            assert take_result(conn) == [("unprepared",)]
            assert conn.exec_driver_sql("SELECT count(*) FROM pg_prepared_statements").scalar_one() == 0
            conn.rollback()
            recording = Recording()
            set_prelude(conn, recording)
            conn.begin()
            assert recording.calls == ["postgresql_pooled"] and take_result(conn) == [("postgresql_pooled",)]
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            conn.rollback()
    finally:
        reg.dispose()




@pytest.mark.postgres
def test_a_transaction_without_a_prelude_begins_in_the_simple_protocol(pg_url: str) -> None:
    """A plain transaction's BEGIN (``store.transaction``, a Session on a Store's engine) is sent as
    the briefcase BEGIN is, one simple-protocol message: nothing prepared for it on the server,
    where psycopg's ``execute`` auto-prepares a statement from its fifth use (and spends a cursor)."""
    reg = EngineRegistry({"pg": ServerSpec(primary=pg_url)})
    try:
        engine = reg.engine("pg")
        with engine.connect() as conn:
            for _ in range(12):
                with conn.begin():
                    assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
            prepared = conn.exec_driver_sql("SELECT statement FROM pg_prepared_statements").scalars().all()
            conn.rollback()
        assert not [s for s in prepared if s.strip().upper() == "BEGIN"], prepared
        assert any(s.strip() == "SELECT 1" for s in prepared), f"the probe needs psycopg's auto-prepare on: {prepared}"
    finally:
        reg.dispose()


@pytest.mark.postgres
def test_an_async_transaction_without_a_prelude_begins_in_the_simple_protocol(pg_url: str) -> None:
    """The same for the async engines (``AsyncStore.transaction``): one BEGIN path for both."""
    from mdb.aio.engines import create_async

    async def run() -> list[str]:
        engine = create_async(pg_url, readonly=False)
        try:
            async with engine.connect() as conn:
                for _ in range(12):
                    async with conn.begin():
                        assert (await conn.execute(sa.text("SELECT 1"))).scalar_one() == 1
                found = (await conn.exec_driver_sql("SELECT statement FROM pg_prepared_statements")).scalars().all()
                await conn.rollback()
                return list(found)
        finally:
            await engine.dispose()

    prepared = asyncio.run(run())
    assert not [s for s in prepared if s.strip().upper() == "BEGIN"], prepared
    assert any(s.strip() == "SELECT 1" for s in prepared), f"the probe needs psycopg's auto-prepare on: {prepared}"

@pytest.mark.postgres
@pytest.mark.parametrize(("url_of", "pooled", "call"), [
    (lambda pg, tmp: pg, False, "postgresql"),
    (lambda pg, tmp: pg, True, "postgresql_pooled"),
    (lambda pg, tmp: f"sqlite:///{tmp / 'plain.db'}", False, "BEGIN IMMEDIATE"),
])
def test_the_begin_hook_is_a_registered_dialect_any_engine_can_name(
        pg_url: str, tmp_path: Path, url_of: Any, pooled: bool, call: str) -> None:
    """The prelude runs from the do_begin of mdb's registered dialect class (dev/0010), not from a
    method patched onto one engine's dialect: an engine created by name outside the registry runs it too."""
    from mdb.engines import MdbPGDialect, MdbSQLiteDialect, mdb_url
    from mdb.urls import sqlalchemy_url

    url = mdb_url(sqlalchemy_url(url_of(pg_url, tmp_path)))
    kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "mdb_pooled": pooled} if url.get_backend_name() == "postgresql" else {}
    engine = sa.create_engine(url, **kwargs)
    try:
        assert url.drivername.endswith("+mdb")
        assert isinstance(engine.dialect, MdbPGDialect if url.get_backend_name() == "postgresql" else MdbSQLiteDialect)
        assert "do_begin" not in vars(engine.dialect)  # a method of the class, not of this instance
        prelude = Recording()
        with engine.connect() as conn:
            set_prelude(conn, prelude)
            conn.begin()
            assert prelude.calls == [call]
            assert take_result(conn) == [(call if url.get_backend_name() == "postgresql" else "sqlite",)]
            conn.rollback()
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_registry_engines_keep_the_maps_driver_but_connect_through_mdbs_dialects(pg_url: str, tmp_path: Path) -> None:
    from mdb.engines import MdbPGDialect, MdbSQLiteDialect

    reg = EngineRegistry({"pg": ServerSpec(primary=pg_url), "lite": ServerSpec(primary=f"sqlite:///{tmp_path / 'l.db'}")})
    try:
        pg, lite = reg.engine("pg"), reg.engine("lite", readonly=True)
        assert isinstance(pg.dialect, MdbPGDialect) and pg.dialect.driver == "psycopg"
        assert isinstance(lite.dialect, MdbSQLiteDialect) and lite.dialect.mdb_begin == "BEGIN"
        assert reg.spec("pg").primary == pg_url  # the map's URL is not rewritten
    finally:
        reg.dispose()
