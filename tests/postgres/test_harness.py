"""The real-PostgreSQL harness does what the other tests rely on it for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from mdb.testing.postgres import PostgresServer


@contextmanager
def engine(url: str) -> Iterator[Engine]:
    eng = sa.create_engine(url)
    try:
        yield eng
    finally:
        eng.dispose()


def scalar(url: str, statement: str) -> Any:
    with engine(url) as eng, eng.connect() as conn:
        return conn.execute(sa.text(statement)).scalar()


def table_exists(url: str, table: str) -> bool:
    return scalar(url, f"SELECT to_regclass('public.{table}') IS NOT NULL") is True


def test_databases_are_on_distinct_servers_and_isolated(pg_databases: Callable[[int], list[str]]) -> None:
    urls = pg_databases(4)
    assert len({make_url(url).port for url in urls}) == 4
    assert all(url.startswith("postgresql+psycopg://postgres@127.0.0.1:") for url in urls)
    with engine(urls[0]) as eng, eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE only_here (id int PRIMARY KEY)"))
    assert table_exists(urls[0], "only_here")
    assert not any(table_exists(url, "only_here") for url in urls[1:])
    ports = {scalar(url, "SELECT current_setting('port')::int") for url in urls}
    assert ports == {make_url(url).port for url in urls}


def test_servers_run_with_the_test_settings(pg_url: str) -> None:
    settings = {
        name: scalar(pg_url, f"SELECT current_setting('{name}')")
        for name in ("fsync", "synchronous_commit", "full_page_writes", "max_prepared_transactions")
    }
    assert settings == {
        "fsync": "off", "synchronous_commit": "off", "full_page_writes": "off",
        "max_prepared_transactions": "64",
    }
    assert int(scalar(pg_url, "SELECT current_setting('max_connections')")) >= 100


def test_every_call_gives_fresh_databases(pg_databases: Callable[[int], list[str]]) -> None:
    first, second = pg_databases(2), pg_databases(2)
    assert len(set(first + second)) == 4
    for url in first + second:
        assert scalar(url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == 0


@pytest.mark.parametrize("round_", [1, 2])
def test_a_table_made_by_an_earlier_test_is_gone(pg_url: str, round_: int) -> None:
    assert not table_exists(pg_url, "left_behind")
    with engine(pg_url) as eng, eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE left_behind (id int)"))


def test_databases_are_dropped_even_with_connections_open(pg_cluster: Any, pg_databases: Any) -> None:
    (url,) = pg_databases(1)
    eng = sa.create_engine(url)
    conn = eng.connect()  # left open: teardown must still drop the database
    try:
        pg_databases.drop_all()
        server = next(s for s in pg_cluster.servers if s.port == make_url(url).port)
        with server.connect() as admin:
            name = make_url(url).database
            assert admin.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (name,)).fetchone() == (0,)
    finally:
        conn.close()
        eng.dispose()


def test_a_stopped_server_refuses_connections_and_can_start_again(
    pg_server_factory: Callable[[], PostgresServer],
) -> None:
    server = pg_server_factory()
    url = server.create_database("kept")
    with engine(url) as eng, eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE t (id int)"))
        conn.execute(sa.text("INSERT INTO t VALUES (1)"))

    server.stop()
    assert not server.is_running
    with pytest.raises(sa.exc.OperationalError):
        scalar(url, "SELECT 1")

    server.start()
    assert server.url("kept") == url  # same port after a restart
    assert scalar(url, "SELECT count(*) FROM t") == 1


def test_an_immediate_stop_cuts_open_connections(pg_server_factory: Callable[[], PostgresServer]) -> None:
    server = pg_server_factory()
    with engine(server.url()) as eng, eng.connect() as conn:
        assert conn.execute(sa.text("SELECT 1")).scalar() == 1
        server.stop(immediate=True)
        with pytest.raises(sa.exc.OperationalError):
            conn.execute(sa.text("SELECT 1"))
    assert not server.is_running


def test_the_replica_replicates_and_refuses_writes(pg_replica_pair: Any) -> None:
    primary_url, replica_url, wait_for_replay = pg_replica_pair
    assert make_url(primary_url).port != make_url(replica_url).port
    assert make_url(primary_url).database == make_url(replica_url).database
    assert scalar(primary_url, "SELECT pg_is_in_recovery()") is False
    assert scalar(replica_url, "SELECT pg_is_in_recovery()") is True

    with engine(primary_url) as eng, eng.begin() as conn:
        conn.execute(sa.text("CREATE TABLE replicated (id int PRIMARY KEY, name text)"))
        conn.execute(sa.text("INSERT INTO replicated VALUES (1, 'one'), (2, 'two')"))
    wait_for_replay()
    assert scalar(replica_url, "SELECT string_agg(name, ',' ORDER BY id) FROM replicated") == "one,two"

    with engine(replica_url) as eng, eng.connect() as conn:
        with pytest.raises(sa.exc.DBAPIError, match="read-only transaction"):
            conn.execute(sa.text("INSERT INTO replicated VALUES (3, 'three')"))


def test_the_replica_pair_database_is_fresh(pg_replica_pair: Any) -> None:
    assert not table_exists(pg_replica_pair.primary_url, "replicated")
    assert not table_exists(pg_replica_pair.replica_url, "replicated")


def test_wait_for_replay_covers_asynchronous_commits(pg_replica_pair: Any) -> None:
    """With synchronous_commit=off a commit may sit unflushed; waiting must still see it."""
    with engine(pg_replica_pair.primary_url) as primary, engine(pg_replica_pair.replica_url) as replica:
        with primary.begin() as conn:
            conn.execute(sa.text("CREATE TABLE counter (n int)"))
        for n in range(30):
            with primary.begin() as conn:
                conn.execute(sa.text("INSERT INTO counter VALUES (:n)"), {"n": n})
            pg_replica_pair.wait_for_replay()
            with replica.connect() as conn:
                assert conn.execute(sa.text("SELECT count(*) FROM counter")).scalar() == n + 1


def test_sqlite_urls_are_absolute_and_distinct(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    urls = tmp_sqlite_urls(2) + tmp_sqlite_urls(1)
    assert len(set(urls)) == 3
    for url in urls:
        path = Path(make_url(url).database or "")
        assert url.startswith("sqlite:////") and path.is_absolute() and path.parent == tmp_path
        with engine(url) as eng, eng.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id int)"))
        assert path.exists()


def test_postgres_fixtures_mark_the_test(request: pytest.FixtureRequest, pg_url: str) -> None:
    assert request.node.get_closest_marker("postgres") is not None


def test_no_postgres_marker_without_postgres_fixtures(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("postgres") is None


@pytest.mark.parametrize(("ci", "outcome"), [("true", {"errors": 1}), ("", {"skipped": 1})], ids=["ci", "not-ci"])
def test_unavailable_postgres_fails_in_ci_and_skips_elsewhere(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str, outcome: dict[str, int]
) -> None:
    """A one-test suite with the shared fixtures plugin as its conftest, on a machine where no binaries can be found."""
    pytester.makeconftest((Path(__file__).parents[1] / "support" / "plugin.py").read_text())
    pytester.makepyfile("def test_needs_pg(pg_url):\n    pass\n")
    monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("MDB_PG_BINDIR", str(pytester.path / "no-such-dir"))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(**outcome)
    result.stdout.fnmatch_lines(["*PostgreSQL is unavailable: no PostgreSQL server binaries*"])
