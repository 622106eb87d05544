"""Engine registry: lazy, one engine per URL, SQLite set up for concurrency, secrets masked."""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from mdb import MdbError, RoutingError, load_map, parse_map
from mdb.engines import EngineRegistry
from mdb.budget import BudgetPool
from mdb.engines import SQLITE_BUSY_TIMEOUT_MS, sqlite_setup
from mdb.urls import sqlalchemy_url
from mdb.partition_map import EngineSpec, ServerSpec

SECRET = "Hunter2-secret"
EXAMPLE = Path(__file__).resolve().parents[2] / "partition_maps" / "example.yaml"


def sqlite_servers(tmp_path: Path) -> dict[str, ServerSpec]:
    return {
        "a": ServerSpec(primary=f"sqlite:///{tmp_path / 'a.db'}"),
        "b": ServerSpec(primary=f"sqlite:///{tmp_path / 'b.db'}"),
        "a-alias": ServerSpec(primary=f"sqlite:///{tmp_path / 'a.db'}"),
        "nested": ServerSpec(primary=f"sqlite:///{tmp_path / 'deep' / 'er' / 'n.db'}"),
    }


@pytest.fixture
def registry(tmp_path: Path) -> EngineRegistry:
    reg = EngineRegistry(sqlite_servers(tmp_path))
    yield reg
    reg.dispose()


def test_engines_are_created_lazily(registry: EngineRegistry, tmp_path: Path) -> None:
    assert "open=0" in repr(registry)
    assert not (tmp_path / "a.db").exists()
    assert registry.server_names == ["a", "b", "a-alias", "nested"]
    registry.engine("a")
    assert "open=1" in repr(registry)
    assert not (tmp_path / "b.db").exists()  # b was never asked for


def test_one_engine_per_url(registry: EngineRegistry) -> None:
    a = registry.engine("a")
    assert registry.engine("a") is a
    assert registry.engine("a-alias") is a  # same URL, same pool
    assert registry.engine("b") is not a
    assert "open=2" in repr(registry)


def test_one_engine_under_concurrency(registry: EngineRegistry) -> None:
    barrier = threading.Barrier(8)
    got: list[sa.Engine] = []

    def worker() -> None:
        barrier.wait()
        got.append(registry.engine("b"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len({id(e) for e in got}) == 1


def test_sqlite_parent_directories_are_created(registry: EngineRegistry, tmp_path: Path) -> None:
    with registry.engine("nested").connect() as conn:
        conn.execute(sa.text("SELECT 1"))
    assert (tmp_path / "deep" / "er" / "n.db").exists()


@pytest.mark.parametrize("readonly", [False, True])
def test_sqlite_pragmas(registry: EngineRegistry, tmp_path: Path, readonly: bool) -> None:
    engine = registry.engine("a", readonly=readonly)
    with engine.connect() as conn:
        assert conn.execute(sa.text("PRAGMA journal_mode")).scalar_one().lower() == "wal"
        assert conn.execute(sa.text("PRAGMA busy_timeout")).scalar_one() == SQLITE_BUSY_TIMEOUT_MS
        assert SQLITE_BUSY_TIMEOUT_MS >= 1000
        assert conn.execute(sa.text("PRAGMA foreign_keys")).scalar_one() == 1
    # WAL is a property of the file: a plain sqlite3 connection sees it too
    raw = sqlite3.connect(tmp_path / "a.db")
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        raw.close()


def test_every_pooled_connection_is_set_up(registry: EngineRegistry) -> None:
    # readers (deferred BEGIN) can hold several connections at once; writers queue on BEGIN IMMEDIATE
    engine = registry.engine("b", readonly=True)
    conns = [engine.connect() for _ in range(3)]
    try:
        for conn in conns:
            assert conn.execute(sa.text("PRAGMA busy_timeout")).scalar_one() == SQLITE_BUSY_TIMEOUT_MS
    finally:
        for conn in conns:
            conn.close()


def test_sqlite_transactions_commit_and_roll_back(registry: EngineRegistry, tmp_path: Path) -> None:
    engine = registry.engine("a")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x INTEGER)"))
        conn.execute(sa.text("INSERT INTO t VALUES (1)"))
    with engine.connect() as conn:
        conn.execute(sa.text("INSERT INTO t VALUES (2)"))
        conn.rollback()  # must really roll back: the driver is in autocommit mode behind our BEGIN
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO t VALUES (3)"))
        raise RuntimeError("abort")
    raw = sqlite3.connect(tmp_path / "a.db")
    try:
        assert raw.execute("SELECT x FROM t ORDER BY x").fetchall() == [(1,)]
    finally:
        raw.close()


class _CountingSqlite(sqlite3.Connection):
    """sqlite3's connection, counting calls of the methods that parse their statement on every call."""

    parsed_ends = 0

    def commit(self) -> None:
        type(self).parsed_ends += 1
        super().commit()

    def rollback(self) -> None:
        type(self).parsed_ends += 1
        super().rollback()


def test_sqlite_transactions_end_through_the_statement_cache(tmp_path: Path) -> None:
    # mdb's SQLite dialect ends a transaction with a cached COMMIT/ROLLBACK statement, never
    # sqlite3's commit()/rollback() (which parse theirs every time), and sends nothing when no
    # transaction is open, as those methods do.
    _CountingSqlite.parsed_ends = 0
    engine = sa.create_engine(f"sqlite+mdb:///{tmp_path / 'c.db'}", connect_args={"factory": _CountingSqlite})
    sa.event.listen(engine, "connect", sqlite_setup)
    sent: list[str] = []
    try:
        with engine.connect() as conn:
            conn.connection.dbapi_connection.set_trace_callback(sent.append)  # type: ignore[union-attr]
            with conn.begin():
                conn.execute(sa.text("CREATE TABLE t (x INTEGER)"))
                conn.execute(sa.text("INSERT INTO t VALUES (1)"))
            conn.begin()
            conn.execute(sa.text("INSERT INTO t VALUES (2)"))
            conn.rollback()
            conn.begin()
            conn.execute(sa.text("INSERT INTO t VALUES (3)"))
            conn.exec_driver_sql("ROLLBACK")  # as SQLite ends a transaction on some errors by itself
            conn.commit()  # nothing open: nothing sent, no error
        assert [s for s in sent if s in ("COMMIT", "ROLLBACK")] == ["COMMIT", "ROLLBACK", "ROLLBACK"]
        assert _CountingSqlite.parsed_ends == 0
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT x FROM t")).scalars().all() == [1]
    finally:
        engine.dispose()


def test_a_sqlite_commit_that_fails_raises_and_keeps_nothing(registry: EngineRegistry, tmp_path: Path) -> None:
    # A deferred foreign key checked at COMMIT: the COMMIT statement fails, and SQLite would keep
    # the transaction open, which SQLAlchemy never rolls back (neither its rollback() after the
    # failed commit nor the close sends anything): the pooled connection kept it, and the next
    # BEGIN on it failed. The dialect ends it: nothing is kept, the next transaction runs.
    engine = registry.engine("a")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE parent (id INTEGER PRIMARY KEY)"))
        conn.execute(sa.text("CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER "
                             "REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)"))
    for ending in ("rollback", "close"):
        with engine.connect() as conn:
            driver = conn.connection.dbapi_connection
            conn.begin()
            conn.execute(sa.text("INSERT INTO child VALUES (1, 42)"))  # no parent 42: refused at COMMIT
            with pytest.raises(sa.exc.IntegrityError, match="FOREIGN KEY constraint failed"):
                conn.commit()
            assert not driver.in_transaction  # type: ignore[union-attr]
            if ending == "rollback":
                conn.rollback()
                with conn.begin():
                    conn.execute(sa.text("INSERT INTO parent VALUES (7)"))
        with engine.begin() as conn:  # the pool's one connection again (SQLite's pool keeps it)
            assert conn.connection.dbapi_connection is driver
            conn.execute(sa.text("INSERT INTO parent VALUES (8)" if ending == "close" else "SELECT 1"))
    raw = sqlite3.connect(tmp_path / "a.db")
    try:
        assert raw.execute("SELECT count(*) FROM child").fetchone() == (0,)
        assert raw.execute("SELECT id FROM parent ORDER BY id").fetchall() == [(7,), (8,)]
    finally:
        raw.close()


def test_sqlite_write_transactions_take_the_write_lock_at_begin(registry: EngineRegistry, tmp_path: Path) -> None:
    engine = registry.engine("a")
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (x INTEGER)"))
    other = sqlite3.connect(tmp_path / "a.db", timeout=0, isolation_level=None)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one()  # only a read so far
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
            conn.rollback()
        # a read-only engine does not block writers
        with registry.engine("a", readonly=True).connect() as conn:
            conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one()
            other.execute("BEGIN IMMEDIATE")
            other.execute("ROLLBACK")
    finally:
        other.close()


def test_unknown_server(registry: EngineRegistry) -> None:
    for call in (registry.engine, registry.spec, registry.masked_url, registry.has_replica):
        with pytest.raises(RoutingError, match="'ghost'") as info:
            call("ghost")
        assert isinstance(info.value, MdbError)


def pg_servers() -> dict[str, ServerSpec]:
    return {
        "pg": ServerSpec(
            primary=f"postgresql://mdb:{SECRET}@127.0.0.1:1/app",
            replica=f"postgresql+psycopg://ro:{SECRET}@127.0.0.1:1/app_replica",
        ),
        "pg2": ServerSpec(primary=f"postgresql+psycopg://mdb:{SECRET}@127.0.0.1:1/other?password={SECRET}"),
    }


def test_masked_urls_and_repr_hide_passwords(caplog: pytest.LogCaptureFixture) -> None:
    reg = EngineRegistry(pg_servers())
    caplog.set_level(logging.DEBUG, logger="mdb")
    try:
        assert reg.masked_url("pg") == "postgresql://mdb:***@127.0.0.1:1/app"
        assert reg.masked_url("pg", readonly=True) == "postgresql+psycopg://ro:***@127.0.0.1:1/app_replica"
        assert SECRET not in reg.masked_url("pg2")
        engines = [reg.engine("pg"), reg.engine("pg", readonly=True), reg.engine("pg2")]  # no connection yet
        for text in (repr(reg), *(repr(e) for e in engines), *(str(e.url) for e in engines), caplog.text):
            assert SECRET not in text
        assert "created engine" in caplog.text  # the log line exists and is masked
        with pytest.raises(RoutingError) as info:
            reg.engine("nope")
        assert SECRET not in str(info.value)
    finally:
        reg.dispose()


def test_connection_errors_do_not_leak_passwords() -> None:
    reg = EngineRegistry(pg_servers())
    try:
        with pytest.raises(sa.exc.OperationalError) as info:
            with reg.engine("pg").connect():
                pass
        assert SECRET not in str(info.value) and SECRET not in repr(info.value)
    finally:
        reg.dispose()


def test_postgres_urls_use_psycopg3() -> None:
    reg = EngineRegistry(pg_servers())
    try:
        assert sqlalchemy_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
        assert sqlalchemy_url("postgres://u@h/db").drivername == "postgresql+psycopg"
        assert sqlalchemy_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
        assert reg.engine("pg").dialect.driver == "psycopg"
        assert reg.backend("pg") == "postgresql" and not reg.sql_dialect("pg").one_writer_per_file
    finally:
        reg.dispose()


def test_replica_selection() -> None:
    reg = EngineRegistry(pg_servers())
    try:
        assert reg.has_replica("pg") and not reg.has_replica("pg2")
        primary, replica = reg.engine("pg"), reg.engine("pg", readonly=True)
        assert primary is not replica
        assert primary.url.database == "app" and replica.url.database == "app_replica"
        assert replica.url.username == "ro"
        # no replica: readers share the primary's pool
        assert reg.engine("pg2", readonly=True) is reg.engine("pg2")
    finally:
        reg.dispose()


def test_update_keeps_unchanged_urls_and_disposes_removed(tmp_path: Path) -> None:
    servers = sqlite_servers(tmp_path)
    reg = EngineRegistry(servers)
    try:
        a, b = reg.engine("a"), reg.engine("b")
        reg.update({"a": servers["a"], "c": ServerSpec(primary=f"sqlite:///{tmp_path / 'c.db'}")})
        assert reg.engine("a") is a
        assert reg.engine("c") is not b
        with pytest.raises(RoutingError):
            reg.engine("b")
        assert reg.server_names == ["a", "c"]
    finally:
        reg.dispose()


def test_for_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "example.yaml"  # the example map's SQLite paths are relative: next to the map file
    copy.write_text(EXAMPLE.read_text())
    reg = EngineRegistry.for_map(load_map(copy))
    try:
        assert sorted(reg.server_names) == sorted(["central-a"] + [f"user-{i}" for i in range(1, 10)])
        assert reg.sql_dialect("user-1").one_writer_per_file and reg.backend("user-1") == "sqlite"
        with reg.engine("user-1").connect() as conn:
            assert conn.execute(sa.text("PRAGMA journal_mode")).scalar_one().lower() == "wal"
        assert (tmp_path / "mdb-data" / "user-1.db").exists()
    finally:
        reg.dispose()


@pytest.mark.postgres
def test_postgres_engine_transactions(pg_url: str) -> None:
    reg = EngineRegistry({"pg": ServerSpec(primary=pg_url)})
    try:
        engine = reg.engine("pg")
        assert engine.dialect.driver == "psycopg"
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (x integer)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1)"))
        with engine.connect() as conn:
            conn.execute(sa.text("INSERT INTO t VALUES (2)"))
            assert conn.execute(sa.text("SELECT count(*) FROM t")).scalar_one() == 2
            conn.rollback()  # a real transaction, not autocommitted statements
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT x FROM t")).scalars().all() == [1]
        with engine.begin() as conn:
            # now() is the transaction's start time: equal across statements only inside one transaction
            first = conn.execute(sa.text("SELECT now()")).scalar_one()
            conn.execute(sa.text("SELECT pg_sleep(0.02)"))
            assert conn.execute(sa.text("SELECT now()")).scalar_one() == first
    finally:
        reg.dispose()


def test_engines_carry_no_connection_events(pg_url: str, tmp_path: Path) -> None:
    """mdb begins transactions through the dialect's ``do_begin``, not a ``begin`` listener: an
    engine with any connection event makes every Connection dispatch events around every
    statement (measured: 10-29 µs of CPU per point read). A listener added here would undo that."""
    reg = EngineRegistry({"pg": ServerSpec(primary=pg_url), "lite": ServerSpec(primary=f"sqlite:///{tmp_path / 'l.db'}")})
    try:
        for server in ("pg", "lite"):
            for readonly in (False, True):
                engine = reg.engine(server, readonly)
                with engine.begin() as conn:
                    conn.execute(sa.text("SELECT 1"))
                    assert conn.in_transaction()
                assert not engine._has_events, f"{server} engine (readonly={readonly}) has connection event listeners"
    finally:
        reg.dispose()


def test_password_query_arg_still_reaches_the_driver() -> None:
    for raw in (f"postgresql://u@h/db?password={SECRET}&sslmode=require", f"postgresql://u:old@h/db?sslmode=require&password={SECRET}"):
        url = sqlalchemy_url(raw)
        _, kwargs = url.get_dialect()().create_connect_args(url)
        assert kwargs["password"] == SECRET and kwargs["sslmode"] == "require"
        assert SECRET not in repr(url) and SECRET not in str(url)


# -- engine settings from the map ------------------------------------------------------------------

ENGINE_MAP = """
version: 1
engine_defaults: {{pool_size: 3, pool_recycle: 600}}
servers:
  pg:   {{primary: "postgresql+psycopg://u:{secret}@127.0.0.1:1/db", engine: {{pool_size: 4, max_overflow: 1, pool_timeout: 2.5}}}}
  lite: {{primary: "sqlite:///{tmp}/lite.db"}}
areas:
  central: {{kind: central, shards: [pg]}}
"""


def pool_settings(engine: sa.Engine) -> tuple[int, int, float, float]:
    pool = engine.pool
    assert isinstance(pool, (sa.pool.QueuePool, BudgetPool))  # PostgreSQL: the budgeted pool (mdb.budget)
    return pool.size(), pool._max_overflow, pool.timeout(), pool._recycle


def test_map_engine_settings_reach_the_pools(tmp_path: Path) -> None:
    """A server's ``engine:`` fields win over ``engine_defaults:``, unset ones take mdb's defaults."""
    pmap = parse_map(ENGINE_MAP.format(secret=SECRET, tmp=tmp_path), "engines.yaml")
    reg = EngineRegistry.for_map(pmap)
    try:
        assert pool_settings(reg.engine("pg")) == (4, 1, 2.5, 600)  # own fields, recycle from the defaults
        assert pool_settings(reg.engine("lite")) == (3, 20, 30.0, 600)  # defaults, then mdb's
        assert pool_settings(reg.engine("lite", readonly=True)) == (3, 20, 30.0, 600)
        assert SECRET not in repr(pmap.servers["pg"]) and "pool_size=4" in repr(pmap.servers["pg"])
    finally:
        reg.dispose()
    mem = EngineRegistry({"mem": ServerSpec(primary="sqlite://")})  # a map refuses it; the registry still copes
    assert isinstance(mem.engine("mem").pool, sa.pool.NullPool)  # an in-memory database has no pool to size
    mem.dispose()
    plain = EngineRegistry({"pg": ServerSpec(primary="postgresql+psycopg://u@127.0.0.1:1/db")})
    assert pool_settings(plain.engine("pg")) == (10, 20, 30.0, -1)  # no settings at all: mdb's defaults
    plain.dispose()


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ("{pool_size: 0}", "servers.pg.engine.pool_size: Input should be greater than or equal to 1"),
        ("{max_overflow: -1}", "servers.pg.engine.max_overflow: Input should be greater than or equal to 0"),
        ("{pool_timeout: 0}", "servers.pg.engine.pool_timeout: Input should be greater than 0"),
        ("{connect_timeout: 0}", "servers.pg.engine.connect_timeout: Input should be greater than or equal to 1"),
        ("{pool_size: many}", "servers.pg.engine.pool_size: Input should be a valid integer"),
        ("{pool_sise: 3}", "servers.pg.engine.pool_sise: unknown key 'pool_sise'"),
    ],
)
def test_bad_engine_settings_are_map_errors_naming_the_field(engine: str, message: str) -> None:
    text = f'version: 1\nservers:\n  pg: {{primary: "sqlite:///x.db", engine: {engine}}}\nareas:\n  central: {{kind: central, shards: [pg]}}\n'
    with pytest.raises(MdbError) as caught:
        parse_map(text, "bad.yaml")
    assert str(caught.value) == f"bad.yaml:3: {message}"


@pytest.mark.postgres
def test_postgres_connections_carry_a_connect_timeout(pg_url: str) -> None:
    """mdb's default (10 s) unless the map or the URL says otherwise; the URL is the more specific."""
    reg = EngineRegistry({
        "default": ServerSpec(primary=pg_url),
        "mapped": ServerSpec(primary=pg_url + "?application_name=m", engine=EngineSpec(connect_timeout=4)),
        "in-url": ServerSpec(primary=pg_url + "?connect_timeout=7", engine=EngineSpec(connect_timeout=4)),
    })
    try:
        for server, expected in (("default", "10"), ("mapped", "4"), ("in-url", "7")):
            with reg.engine(server).connect() as conn:
                assert conn.connection.dbapi_connection.info.get_parameters()["connect_timeout"] == expected, server
    finally:
        reg.dispose()


BLACKHOLE_CHILD = """
import sys
from mdb.errors import ServerUnavailableError
from mdb.partition_map import load_map
from mdb.store import Store
store = Store(load_map(sys.argv[1]), types=[])
try:
    with store.transaction("dead"):
        pass
except ServerUnavailableError as exc:
    print("unavailable:", exc)
"""


def test_a_host_that_never_answers_fails_within_connect_timeout(tmp_path: Path) -> None:
    """A listening socket that never answers stands for a powered-off host behind a firewall:
    without a connect timeout the command would wait for the OS (minutes). The child gets a
    generous bound; on the old code (no timeout) it is killed there and the test fails."""
    import socket
    import subprocess
    import sys

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # accepted by the kernel, never by anyone: the startup packet gets no reply
        port = hole.getsockname()[1]
        (tmp_path / "map.yaml").write_text(
            f'version: 1\nservers:\n  dead: {{primary: "postgresql+psycopg://mdb:{SECRET}@127.0.0.1:{port}/x", '
            f"engine: {{connect_timeout: 2}}}}\nareas:\n  central: {{kind: central, shards: [dead]}}\n"
        )
        done = subprocess.run([sys.executable, "-c", BLACKHOLE_CHILD, str(tmp_path / "map.yaml")],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("unavailable: server 'dead' is unavailable:") and "timeout" in done.stdout
    assert SECRET not in done.stdout + done.stderr
