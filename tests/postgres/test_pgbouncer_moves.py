"""Writers during moves and a reshard behind a transaction-mode PgBouncer (issue 14): the writer
test of tests/postgres/test_moves_online.py through a pool of 3 server connections per database.
The tools run on ``direct:`` URLs, as docs/operations.md prescribes (a move holds a lock that
pooled sessions queue on). The SIGKILL-at-every-step suites run through PgBouncer as the
``pgbouncer`` case of tests/faults/test_moves_faults.py.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from support.moves import add_transaction, create_user, locations
from support.pgbouncer import PooledCluster, make_pooled_cluster
from support.online import SERVERS as ONLINE_SERVERS
from support.online import USERS as ONLINE_USERS
from support.online import _transactions

from mdb.errors import RetryableError
from mdb.gdid import GDID
from mdb.moves.move import move_briefcase
from mdb.moves.reshard import reshard
from mdb.testing.pgbouncer import PgBouncer


@pytest.fixture
def online_cluster(pg_databases: Callable[[int], list[str]], pgbouncer: Callable[..., PgBouncer], tmp_path: Path) -> PooledCluster:
    direct = dict(zip(["c", *ONLINE_SERVERS], pg_databases(4), strict=True))
    cluster = make_pooled_cluster(pgbouncer, direct, tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in ONLINE_USERS:
            create_user(store, g, orders=1, lines=2)
    return cluster


@pytest.mark.slow  # 23 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_writers_through_pgbouncer_during_moves_and_a_reshard_lose_and_double_nothing(online_cluster: PooledCluster) -> None:
    """Six writer threads (twice the pool) write through PgBouncer while the tools, on direct
    URLs, move briefcases and reshard their partition: every acknowledged write is there once,
    on the server its briefcase lives on."""
    cluster = online_cluster
    stop = threading.Event()
    acked: list[tuple[GDID, int]] = []
    errors: Counter[str] = Counter()
    lock = threading.Lock()

    def writer(base: int) -> None:
        with cluster.store() as store:
            n = 0
            while not stop.is_set():
                g, tid = ONLINE_USERS[n % len(ONLINE_USERS)], base + n
                n += 1
                try:
                    add_transaction(store, g, tid, n)
                except RetryableError:
                    continue
                except Exception as exc:  # counted and asserted on below: a writer must never fail otherwise
                    with lock:
                        errors[f"{type(exc).__name__}: {str(exc)[:160]}"] += 1
                    continue
                with lock:
                    acked.append((g, tid))

    threads = [threading.Thread(target=writer, args=(base * 1_000_000,)) for base in range(1, 7)]
    for t in threads:
        t.start()
    try:
        with cluster.tools() as admin:
            while len(acked) < 20:
                threading.Event().wait(0.01)
            for g in ONLINE_USERS[:3]:
                move_briefcase(admin, "user", g, "x")
            move_briefcase(admin, "user", ONLINE_USERS[0], admin.router.default_placement("user", ONLINE_USERS[0]).server)
            outcome = reshard(admin, "user", GDID(0, 0, 0), ["u1", "u2", "x"], parallel=2, map_path=cluster.path)
            assert outcome.map_version is not None and outcome.moved > 0 and outcome.plan.moves
            n = len(acked)
            while len(acked) < n + 20:
                threading.Event().wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == Counter()

    found = _transactions(cluster)
    assert all(n == 1 for n in found.values()), "a transaction row is duplicated"
    with cluster.store() as store:
        store.refresh()
        homes = locations(store, ONLINE_SERVERS)
        for g, servers in homes.items():
            assert servers == [store.router.locate("user", g).server]
        by_tid = {tid: (server, uid) for server, uid, tid in found}
        for g, tid in acked:
            assert tid in by_tid, f"acknowledged write {g}/{tid} is lost"
            assert by_tid[tid] == (homes[g][0], g), f"write {tid} is on {by_tid[tid]}, briefcase on {homes[g]}"
