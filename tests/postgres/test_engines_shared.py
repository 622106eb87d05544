"""One initialized dialect shared by the engines of one PostgreSQL instance (issue 19, cold start).

Real PostgreSQL: the second database of an instance executes with the first one's initialized
dialect (and so its compiled statements) without asking the server again; a different server
key or an hstore database is initialized per engine, on its own dialect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

from mdb.engines import EngineRegistry
from mdb import engines as engines_module
from mdb.budget import instance_of
from mdb.partition_map import EngineSpec, ServerSpec

pytestmark = pytest.mark.postgres

SHARED = ("server_version_info", "default_schema_name", "default_isolation_level", "_backslash_escapes",
          "max_identifier_length", "supports_identity_columns")


@pytest.fixture
def initializations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The databases whose engine ran SQLAlchemy's own ``initialize`` (the server round trips)."""
    ran: list[str] = []
    original: Callable[..., None] = PGDialect_psycopg.initialize

    def counting(self: Any, connection: Any) -> None:
        ran.append(connection.connection.dbapi_connection.info.dbname)
        original(self, connection)

    monkeypatch.setattr(PGDialect_psycopg, "initialize", counting)
    monkeypatch.setattr(engines_module, "_INITIALIZED", {})
    monkeypatch.setattr(engines_module, "_DIALECTS", {})
    yield ran


def _registry(urls: list[str]) -> EngineRegistry:
    return EngineRegistry({f"s{i}": ServerSpec(primary=url) for i, url in enumerate(urls)})


def _select_one(registry: EngineRegistry, server: str) -> int:
    with registry.engine(server).begin() as conn:
        return int(conn.execute(sa.text("SELECT 1")).scalar_one())


def test_second_database_of_an_instance_reuses_the_initialization(
        pg_databases: Callable[[int], list[str]], initializations: list[str]) -> None:
    urls = [pg_databases(1)[0] for _ in range(3)]  # one pool server: the same instance
    registry = _registry(urls)
    try:
        for server in ("s0", "s1", "s2"):
            assert _select_one(registry, server) == 1
        assert len(initializations) == 1  # the first engine only
        first = registry.engine("s0").dialect
        for server in ("s1", "s2"):
            engine = registry.engine(server)
            assert engine.dialect is first  # one dialect: statements compiled once for the instance
            assert engine.pool._dialect is first
            assert engine.get_execution_options()["compiled_cache"] is engines_module._COMPILED
        assert first.server_version_info is not None and first.server_version_info >= (10,)
    finally:
        registry.dispose()


def test_another_server_key_is_initialized_again(
        pg_databases: Callable[[int], list[str]], initializations: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    keyed: Callable[..., tuple[object, ...]] = engines_module._pg_server_key
    # as if every database were on another server version: nothing may be shared
    monkeypatch.setattr(engines_module, "_pg_server_key",
                        lambda d, i, conn: (*keyed(d, i, conn), conn.info.dbname))
    urls = [pg_databases(1)[0] for _ in range(2)]
    registry = _registry(urls)
    try:
        assert _select_one(registry, "s0") == _select_one(registry, "s1") == 1
        assert sorted(initializations) == sorted(sa.make_url(u).database for u in urls)
        second = registry.engine("s1")
        assert second.dialect is not registry.engine("s0").dialect  # back on its own dialect
        assert second.pool._dialect is second.dialect
        for name in SHARED:
            assert getattr(second.dialect, name) is not None or name == "default_isolation_level", name
        assert _select_one(registry, "s1") == 1
    finally:
        registry.dispose()


def test_hstore_databases_are_initialized_per_engine(
        pg_databases: Callable[[int], list[str]], initializations: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    counting = PGDialect_psycopg.initialize

    def with_hstore(self: Any, connection: Any) -> None:
        counting(self, connection)
        self._has_native_hstore = True  # the OID registered is the first database's: never copy it

    monkeypatch.setattr(PGDialect_psycopg, "initialize", with_hstore)
    urls = [pg_databases(1)[0] for _ in range(2)]
    registry = _registry(urls)
    try:
        assert _select_one(registry, "s0") == _select_one(registry, "s1") == 1
        assert len(initializations) == 2
        assert registry.engine("s1").dialect is not registry.engine("s0").dialect
    finally:
        registry.dispose()


def test_the_server_capacity_is_the_default_instance_cap(pg_databases: Callable[[int], list[str]]) -> None:
    urls = [pg_databases(1)[0] for _ in range(2)]
    with sa.create_engine(sa.make_url(urls[0]).set(drivername="postgresql+psycopg")).connect() as admin:
        capacity = int(admin.exec_driver_sql(engines_module._CAPACITY_SQL).scalar_one())
        max_connections = int(admin.exec_driver_sql("SHOW max_connections").scalar_one())
    assert 1 <= capacity <= max_connections
    registry = _registry(urls)
    capped = EngineRegistry({"s0": ServerSpec(primary=urls[1], engine=EngineSpec(max_connections_per_instance=3))})
    try:
        assert _select_one(registry, "s0") == _select_one(registry, "s1") == 1
        instance = instance_of(sa.make_url(urls[0]))
        assert instance is not None
        assert registry.budget._instance_cap(instance) == capacity
        assert _select_one(capped, "s0") == 1
        assert capped.budget._instance_cap(instance) == 3  # a smaller cap from the map wins
    finally:
        registry.dispose()
        capped.dispose()
