"""The PgBouncer fixture: a real transaction-mode pooler, and the skip-or-fail policy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from mdb.testing.pgbouncer import PgBouncer


def _connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    u = make_url(url)
    return psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database, autocommit=True, prepare_threshold=None)


def test_the_fixture_shares_server_sessions_between_clients_per_transaction(
    pg_url: str, pgbouncer: Callable[..., PgBouncer]
) -> None:
    """Two client connections, a pool of 1: both run on one server session, and session state
    set by one transaction is visible to the other client (what mdb must never rely on)."""
    bouncer = pgbouncer([pg_url], pool_size=1)
    (pooled,) = bouncer.pooled_urls
    assert make_url(pooled).database == make_url(pg_url).database and make_url(pooled).port == bouncer.port
    with _connect(pooled) as first, _connect(pooled) as second:
        first.execute("SET application_name = 'left-behind'")
        pids = {conn.execute("SELECT pg_backend_pid()").fetchone() for conn in (first, second)}
        assert len(pids) == 1
        assert second.execute("SHOW application_name").fetchone() == ("left-behind",)
    (pool,) = [p for p in bouncer.show("POOLS") if p["database"] == make_url(pg_url).database]
    assert pool["pool_mode"] == "transaction"


@pytest.mark.parametrize(("ci", "outcome"), [("true", {"errors": 1}), ("", {"skipped": 1})], ids=["ci", "not-ci"])
def test_unavailable_pgbouncer_fails_in_ci_and_skips_elsewhere(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str, outcome: dict[str, int]
) -> None:
    """A one-test suite with the shared fixtures plugin as its conftest, on a machine where no pgbouncer binary can be found."""
    pytester.makeconftest((Path(__file__).parents[1] / "support" / "plugin.py").read_text())
    pytester.makepyfile("def test_needs_pgbouncer(pgbouncer):\n    pass\n")
    monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("MDB_PGBOUNCER", str(pytester.path / "no-such-pgbouncer"))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(**outcome)
    result.stdout.fnmatch_lines(["*PgBouncer is unavailable: no pgbouncer binary*"])
