"""A reshard's dry run streams the partition: its memory does not grow with the briefcases.

20,000 then 200,000 briefcases (root rows only, filled with COPY) on two real PostgreSQL shards:
the plan's totals are exact, the peak of Python memory allocated while planning ten times the
briefcases is about the same, and below what holding the keys alone as a list takes.
"""

from __future__ import annotations

import pytest
import tracemalloc
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from support.moves import make_cluster
from sqlalchemy.engine import make_url

from mdb.gdid import GDID
from mdb.moves.reshard import reshard

N = 200_000


def _fill(url: str, users: list[GDID]) -> None:
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    at = datetime(2026, 1, 1, tzinfo=UTC)
    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy("COPY users (user_id, email, name, created_at) FROM STDIN") as copy:
            for g in users:
                copy.write_row((bytes(g), "e", "n", at))


def _dry_run_peak(cluster, n: int):  # type: ignore[no-untyped-def]
    """(plan, peak bytes of Python memory allocated while planning) of a dry run."""
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        with cluster.store() as store:
            outcome = reshard(store, "user", GDID(0, 0, 0), ["a", "b", "x"], dry_run=True, map_path=cluster.path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return outcome.plan, peak - base


@pytest.mark.slow  # 398 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_a_dry_run_of_200k_briefcases_is_exact_in_bounded_memory(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    urls = dict(zip(["c", "a", "b", "x"], pg_databases(4)))
    cluster = make_cluster(urls, tmp_path, [("0:0:0", ["a", "b"])])
    users = [GDID(0, 0, i) for i in range(1, N + 1)]
    tracemalloc.start()
    held = [GDID(0, 0, i) for i in range(1, N + 1)]  # what one object per briefcase costs, at the least
    per_briefcase, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del held
    small = N // 10
    for i, server in enumerate(["a", "b"]):
        _fill(urls[server], [g for g in users[:small] if g.sharding_value % 2 == i])
    _dry_run_peak(cluster, small)  # warm: imports, reflection caches
    _, peak_small = _dry_run_peak(cluster, small)
    for i, server in enumerate(["a", "b"]):
        _fill(urls[server], [g for g in users[small:] if g.sharding_value % 2 == i])
    plan, peak = _dry_run_peak(cluster, N)

    pairs = Counter((["a", "b"][g.sharding_value % 2], ["a", "b", "x"][g.sharding_value % 3]) for g in users)
    expected = {pair: (n, n) for pair, n in pairs.items() if pair[0] != pair[1]}  # one row (users) per briefcase
    moving = sum(n for n, _ in expected.values())
    assert (plan.briefcases_in_partition, plan.briefcases_to_move) == (N, moving)
    assert plan.rows_per_table()["users"] == moving and plan.moves == []
    assert plan.pairs() == expected  # each briefcase from the server it is on
    # Ten times the briefcases, about the same peak; and under what the keys alone would take.
    assert peak < peak_small * 1.5 + 1_000_000, f"{small}: {peak_small / 1e6:.1f} MB, {N}: {peak / 1e6:.1f} MB"
    assert peak < per_briefcase, f"planning peaked at {peak / 1e6:.1f} MB; {N} GDIDs take {per_briefcase / 1e6:.1f} MB"
