"""Moves and reshards while the application keeps writing, and stale Stores after a move.

Writers in threads of this process and in a separate process add transactions to briefcases
the whole time; a write counts only when its commit returned. Afterwards every acknowledged
write is present exactly once, on the server that holds its briefcase, which is where a fresh
Store routes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from support import forkserver
from support.moves import ROOT, Cluster, add_transaction, locations, run_cli
from sqlalchemy import func, select

from mdb.demo.models import Transaction, User, UserBriefcase
from mdb.errors import MdbError, RetryableError
from mdb.gdid import GDID
from mdb.moves import move_briefcase
from mdb.moves.journal import JournalEntry
from mdb.moves.reshard import reshard
from mdb.moves.status import status_of
from support.online import SERVERS, USERS, _transactions, cluster  # noqa: F401 (fixtures: cluster)


WRITER = r"""
import sys, itertools
sys.path.insert(0, "tests")
from pathlib import Path
from support.moves import add_transaction
from mdb.demo.models import UserBriefcase
from mdb.errors import RetryableError
from mdb.gdid import GDID
from mdb.store import Store
path, stop, base = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
users = [GDID(0, 0, i) for i in range(1, 9)]
with Store.from_yaml(path, types=[UserBriefcase]) as store:
    for n in itertools.count():
        if stop.exists():
            break
        g, tid = users[n % len(users)], base + n
        try:
            add_transaction(store, g, tid, n)
        except RetryableError:
            continue
        print(f"{g} {tid}", flush=True)
"""


@pytest.mark.slow  # 49 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_writers_in_threads_and_a_process_during_moves_and_a_reshard(cluster: Cluster, tmp_path: Path) -> None:
    stop = threading.Event()
    acked: list[tuple[GDID, int]] = []
    lock = threading.Lock()
    retried = Counter[str]()

    def writer(base: int) -> None:
        with cluster.store() as store:
            n = 0
            while not stop.is_set():
                g, tid = USERS[n % len(USERS)], base + n
                n += 1
                try:
                    add_transaction(store, g, tid, n)
                except RetryableError as exc:
                    retried[type(exc).__name__] += 1
                    continue
                with lock:
                    acked.append((g, tid))

    stop_file = tmp_path / "stop"
    proc = forkserver.popen([sys.executable, "-c", WRITER, str(cluster.path), str(stop_file), "3000000"],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    threads = [threading.Thread(target=writer, args=(base,)) for base in (1_000_000, 2_000_000)]
    for t in threads:
        t.start()
    try:
        with cluster.store() as admin:
            while len(acked) < 20:
                threading.Event().wait(0.01)
            for g in USERS[:3]:  # single moves, to the spare and back again
                move_briefcase(admin, "user", g, "x")
            move_briefcase(admin, "user", USERS[0], admin.router.default_placement("user", USERS[0]).server)
            outcome = reshard(admin, "user", GDID(0, 0, 0), ["u1", "u2", "x"], parallel=2, map_path=cluster.path)
            assert outcome.map_version is not None and outcome.moved > 0 and outcome.plan.moves
            n = len(acked)
            while len(acked) < n + 20:
                threading.Event().wait(0.01)
    finally:
        stop.set()
        stop_file.touch()
        for t in threads:
            t.join()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    for line in out.splitlines():
        text, tid = line.split()
        acked.append((GDID.parse(text), int(tid)))
    assert len({tid for _, tid in acked if tid >= 3_000_000}) > 0, "the writer process acknowledged nothing"

    found = _transactions(cluster)
    assert all(n == 1 for n in found.values()), "a transaction row is duplicated"
    with cluster.store() as store:
        store.refresh()
        homes = locations(store, SERVERS)
        for g, servers in homes.items():
            assert servers == [store.router.locate("user", g).server]
        by_tid = {tid: (server, uid) for server, uid, tid in found}
        for g, tid in acked:
            assert tid in by_tid, f"acknowledged write {g}/{tid} is lost"
            assert by_tid[tid] == (homes[g][0], g), f"write {tid} is on {by_tid[tid]}, briefcase on {homes[g]}"
        assert len(by_tid) == len(set(by_tid))


def test_a_stale_store_is_redirected_and_never_touches_the_old_location(cluster: Cluster) -> None:
    g = USERS[0]
    with cluster.store() as stale, cluster.store() as admin:
        old = stale.router.locate("user", g).server  # relocation cache loaded now, and kept
        target = next(s for s in SERVERS if s != old)
        move_briefcase(admin, "user", g, target)
        assert stale.router.locate("user", g).server == old  # still stale
        with stale.briefcase(UserBriefcase, g, readonly=True) as s:
            assert s.get(User, g) is not None
            assert s.placement.server == target
        add_transaction(stale, g, 77, 1)
        with admin.transaction(old) as conn:
            for table in UserBriefcase.tables:
                n = conn.execute(select(func.count()).select_from(table).where(UserBriefcase.key_column(table) == g)).scalar_one()
                assert n == 0, f"{table.name} has rows of the moved briefcase on the old server"
        with admin.transaction(target) as conn:
            assert conn.execute(select(func.count()).select_from(Transaction).where(Transaction.user_id == g)).scalar_one() == 1


@pytest.mark.slow  # 204 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_cli_move_dry_run_where_status_and_move_back(cluster: Cluster) -> None:
    g = USERS[1]
    with cluster.store() as store:
        home = store.router.locate("user", g).server
    target = next(s for s in SERVERS if s != home)
    dry = run_cli(["move", str(cluster.path), "user", str(g), "--to", target, "--dry-run", "--json"])
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["status"] == "dry-run" and plan["tables"]["users"]["rows"] == 1 and plan["tables"]["order_line_items"]["rows"] == 2
    assert locations_of(cluster, g) == [home]
    moved = run_cli(["move", str(cluster.path), "user", str(g), "--to", target])
    assert moved.returncode == 0, moved.stderr
    where = json.loads(run_cli(["where", str(cluster.path), "user", str(g), "--json"]).stdout)
    assert where["routed_to"] == target and where["holders"] == {target: 5} and where["relocation"] == target
    assert where["states"][home]["state"] == "gone" and where["consistent"]
    status = json.loads(run_cli(["moves", "status", str(cluster.path), "--json"]).stdout)
    done = status["recent"][0]
    assert status["in_flight"] == [] and done["status"] == "done"
    assert (done["briefcases_done"], done["briefcases_total"]) == (1, 1) and done["rows_done"] == done["rows_total"] == 5
    back = run_cli(["move", str(cluster.path), "user", str(g), "--to", home])  # the rollback of a move
    assert back.returncode == 0, back.stderr
    where = json.loads(run_cli(["where", str(cluster.path), "user", str(g), "--json"]).stdout)
    assert where["routed_to"] == home and where["relocation"] is None and where["holders"] == {home: 5}
    nobody = run_cli(["where", str(cluster.path), "user", "0:0:999999"])
    assert nobody.returncode == 1 and "no server holds any row of this briefcase" in nobody.stdout, nobody.stdout  # not found: exit 1
    bad = run_cli(["move", str(cluster.path), "user", str(g), "--to", "nope"])
    assert bad.returncode == 2 and "unknown server 'nope'" in bad.stderr


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_max_pause_is_refused_before_anything_runs(bad: float) -> None:
    with pytest.raises(MdbError, match="max pause must be at least 0 seconds"):
        move_briefcase(None, "user", GDID(0, 0, 1), "x", max_pause=bad)  # no Store needed: refused first
    with pytest.raises(MdbError, match="max pause must be at least 0 seconds"):
        reshard(None, "user", GDID(0, 0, 0), ["a", "b"], max_pause=bad)


def test_status_rates_are_over_the_moves_own_run_time() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    running = JournalEntry("m1", "move", "user", "copy", "running", rows_total=300, rows_done=100, started_at=t0, updated_at=t0)
    status = status_of(running, t0 + timedelta(seconds=10))
    assert (status.rate_rows, status.eta_seconds) == (10.0, 20.0)
    done = replace(running, step="done", status="done", rows_done=300, updated_at=t0 + timedelta(seconds=3))
    for later in (1, 3600):  # a finished move's rate does not fall as time passes
        assert status_of(done, t0 + timedelta(seconds=later)).rate_rows == 100.0
    instant = replace(done, updated_at=t0)  # SQLite timestamps have whole seconds
    assert status_of(instant, t0 + timedelta(seconds=5)).rate_rows is None


def locations_of(cluster: Cluster, g: GDID) -> list[str]:
    with cluster.store() as store:
        return locations(store, SERVERS)[g]
