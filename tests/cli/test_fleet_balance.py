"""``mdb balance`` (issue 17 part B): per-server briefcases, rows and bytes of an area, skew, largest briefcases.

The figures are checked against an independent count: ``mdb.moves.copy.measure`` of each
briefcase on the server that holds it (what a move would carry), summed per server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from support.moves import Cluster, locations, run_cli

from mdb.fleet.balance import balance
from mdb.moves.copy import measure
from mdb.moves.move import area_tables
from support.templates import Databases
from support.fleet import SHARDS, SKEWED_USERS, build_skewed, cloned_skewed

USERS = SKEWED_USERS


@pytest.fixture
def skewed(pg_databases: Databases, tmp_path: Path) -> Cluster:
    return cloned_skewed(pg_databases, tmp_path)


def _independent(cluster: Cluster) -> dict[str, tuple[int, int, int]]:
    """server -> (briefcases, rows, bytes), one `measure` per briefcase where its root row is."""
    out = {s: (0, 0, 0) for s in SHARDS}
    with cluster.store() as store:
        tables = area_tables(store, "user")
        for gdid, (server,) in locations(store, SHARDS).items():
            with store.transaction(server) as conn:
                sizes = measure(conn, tables, gdid)
            n, r, b = out[server]
            out[server] = (n + 1, r + sum(x for x, _ in sizes.values()), b + sum(y for _, y in sizes.values()))
    return out


@pytest.mark.slow  # 36 s measured at load ~15 on 2 cores: docs/testing.md
def test_balance_counts_agree_with_per_briefcase_measurement_and_show_the_skew(skewed: Cluster) -> None:
    expected = _independent(skewed)
    with skewed.store() as store:
        report = balance(store, "user", top=3)
    got = {s.server: (s.briefcases, s.rows, s.bytes) for s in report.servers}
    assert got == expected
    assert all(s.disk_bytes is not None and s.disk_bytes > 0 for s in report.servers)
    skew = report.skew("bytes")
    assert max(skew, key=lambda k: skew[k]) == "u1" and skew["u1"] > 0.5, skew
    assert [srv for srv, _ in report.largest()] == ["u1"] * 3, "the largest briefcases are u1's 10-order ones"


@pytest.mark.slow  # 92 s measured at load ~15 on 2 cores: docs/testing.md
def test_balance_cli_json_and_table(skewed: Cluster) -> None:
    run = run_cli(["balance", str(skewed.path), "user", "--json", "--top", "2"])
    assert run.returncode == 0, run.stderr
    (area,) = json.loads(run.stdout)["areas"]
    assert [s["server"] for s in area["servers"]] == SHARDS
    assert area["max_skew"]["bytes"] > 0.5 and len(area["largest"]) == 2
    table = run_cli(["balance", str(skewed.path)])
    assert table.returncode == 0 and "max skew by bytes" in table.stdout and "█" in table.stdout, table.stdout
    bad = run_cli(["balance", str(skewed.path), "nosuch"])
    assert bad.returncode == 2 and "unknown area 'nosuch'" in bad.stderr, bad.stderr


def test_balance_on_sqlite(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = build_skewed(tmp_sqlite_urls(5), tmp_path)
    expected = _independent(cluster)
    with cluster.store() as store:
        report = balance(store, "user")
    assert {s.server: (s.briefcases, s.rows, s.bytes) for s in report.servers} == expected
    assert all(s.disk_bytes for s in report.servers), "SQLite pages of the area's tables (dbstat)"


def test_the_scan_streams_through_server_side_cursors(skewed: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded memory: while the first briefcase is handed out, the rest are still in open cursors on the server."""
    from sqlalchemy import text

    import mdb.backends.sqlscan as scan

    monkeypatch.setattr(scan, "STREAM_BATCH", 2)
    with skewed.store() as store, store.transaction("u1") as conn:
        sizes = scan.briefcase_sizes(conn, [(at.table, at.key) for at in area_tables(store, "user")])
        first = next(sizes)
        cursors = conn.execute(text("SELECT count(*) FROM pg_cursors")).scalar_one()
        rest = list(sizes)
    # tables with more rows than a batch still have their cursor open (a client-side read would show 0)
    assert cursors >= 4, cursors
    assert [b.gdid for b in [first, *rest]] == sorted(g for g in USERS if g.counter % 4 == 0)
