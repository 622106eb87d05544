"""Spare servers (issue 29 item 5): fsck and balance scan them, ``mdb drain`` empties one.

After a reshard takes an area from 4 shards to 2, the two servers left out are spares that
still have the area's tables. A differing copy planted on one is reported by ``mdb fsck``
(it used to say "clean") and shown by ``mdb balance``; ``mdb drain SERVER --check`` says per
area whether it still holds data; ``mdb drain SERVER`` moves the briefcases routed to it (its
relocations) home as a job in CENTRAL that ``mdb moves resume`` finishes after a SIGKILL, and refuses a server
still in a partition's shard list. Plus: a duplicated briefcase is counted once by fsck and
balance, and ``rebalance --plan`` drops a plan under ``--min-improvement`` and says when a move
crosses partitions.
"""

from __future__ import annotations

import pytest
import json
import signal
from collections.abc import Callable
from pathlib import Path

from support.moves import Cluster, create_user, locations, make_cluster, run_cli, snapshot
from sqlalchemy import update

from mdb.demo.models import User
from mdb.fleet.balance import balance
from mdb.fleet.fsck import Finding, FsckReport, fsck
from mdb.fleet.rebalance import plan_rebalance
from mdb.gdid import GDID
from mdb.moves.copy import copy_rows
from mdb.moves.move import area_tables, move_briefcase
from mdb.moves.reshard import reshard

SHARDS = ["u1", "u2", "u3", "u4"]
USERS = [GDID(0, 0, i) for i in range(1, 13)]


def shrunk(urls: list[str], tmp_path: Path) -> Cluster:
    """12 users on 4 shards, then resharded onto u1, u2: u3 and u4 are spares with the area's tables."""
    cluster = make_cluster(dict(zip(["c", *SHARDS], urls)), tmp_path, [("0:0:0", SHARDS)])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g, orders=1, lines=1)
        reshard(store, "user", GDID(0, 0, 0), ["u1", "u2"], map_path=cluster.path)
        store.refresh()
        assert list(store.router.area_servers("user")) == ["u1", "u2"]
    return cluster


def _own(report: FsckReport) -> list[Finding]:
    """Findings about the briefcases' rows. CENTRAL is not this file's subject: its briefcases are made
    without index entries, and fsck in-process checks every index any imported module declared (in a
    full test run, the demo's and the tests'), while the CLI imports only the map's models."""
    return [f for f in report.findings if not f.kind.startswith("central_")]


@pytest.mark.slow  # 48 s measured at load ~15 on 2 cores: docs/testing.md
def test_fsck_and_balance_see_a_differing_copy_on_a_spare(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = shrunk(tmp_sqlite_urls(5), tmp_path)
    g = USERS[0]
    with cluster.store() as store:
        owner = store.router.locate("user", g).server
        with store.transaction(owner) as src, store.transaction("u3") as dst:
            copy_rows(src, dst, area_tables(store, "user"), g)
        with store.transaction("u3") as conn:
            conn.execute(update(User).where(User.user_id == g).values(name="changed on the spare"))
        report = fsck(store, "user", repair=True)
        assert "u3" in report.servers and "u4" in report.servers
        assert [(f.kind, f.server, f.gdid, f.action) for f in _own(report)] == [("misplaced", "u3", g, "reported")]
        assert report.briefcases == len(USERS), "the copy on the spare is not a second briefcase"
        assert sorted(locations(store, SHARDS)[g]) == sorted([owner, "u3"]), "a differing copy is never deleted"
        spare = {s.server: s for s in balance(store, "user").servers}
        assert spare["u3"].spare and spare["u3"].stray_briefcases == 1 and spare["u3"].briefcases == 0
    run = run_cli(["fsck", str(cluster.path), "user"])
    assert run.returncode == 1 and "misplaced" in run.stdout and "u3" in run.stdout, run.stdout
    shown = run_cli(["balance", str(cluster.path), "user"])
    assert shown.returncode == 0 and "u3 (spare)" in shown.stdout, shown.stdout
    where = run_cli(["where", str(cluster.path), "user", str(g)])  # a copy no move made: fsck's, not resume's
    assert "u3: holds" in where.stdout and "run `mdb fsck MAP user`" in where.stdout, where.stdout


def test_a_duplicated_briefcase_is_counted_once(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = make_cluster(dict(zip(["c", "u1", "u2"], tmp_sqlite_urls(3))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g, orders=1, lines=1)
        g = USERS[0]
        owner = store.router.locate("user", g).server
        other = "u2" if owner == "u1" else "u1"
        with store.transaction(owner) as src, store.transaction(other) as dst:
            copy_rows(src, dst, area_tables(store, "user"), g)
        assert fsck(store, "user").briefcases == len(USERS)
        report = balance(store, "user")
        assert report.briefcases == len(USERS)
        per = {s.server: s for s in report.servers}
        assert per[other].stray_briefcases == 1 and per[owner].stray_briefcases == 0
        assert sum(s.briefcases for s in report.servers) == len(USERS)


@pytest.mark.slow  # 69 s measured at load ~15 on 2 cores: docs/testing.md
def test_drain_moves_a_spares_briefcases_home_resumably(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = shrunk(tmp_sqlite_urls(5), tmp_path)
    moved = USERS[:3]
    with cluster.store() as store:
        for g in moved:
            move_briefcase(store, "user", g, "u3")
        before = snapshot(store, SHARDS)
    path = str(cluster.path)

    check = run_cli(["drain", path, "u3", "--check", "--json"])
    assert check.returncode == 1, check.stderr
    answer = json.loads(check.stdout)
    assert answer["holds_data"] and answer["roles"] == []
    assert [(a["area"], a["briefcases"], a["stray"]) for a in answer["areas"]] == [("user", 3, 0)]
    empty = run_cli(["drain", path, "u4", "--check"])
    assert empty.returncode == 0 and "u4: holds no data" in empty.stdout, empty.stdout

    refused = run_cli(["drain", path, "u1"])
    assert refused.returncode == 2 and "shard 0 of area 'user'" in refused.stderr, refused.stderr

    # One briefcase at a time (--batch-pause 0): killed inside the first single move of the drain's job.
    killed = run_cli(["drain", path, "u3", "--batch-pause", "0"], env={"MDB_FAULT_POINT": "batch.after_precopy"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "draining u3: 3 briefcase(s) to move home" in killed.stdout, killed.stdout
    busy = run_cli(["drain", path, "u3"])
    assert busy.returncode != 0 and "mdb moves resume" in busy.stderr, (busy.stdout, busy.stderr)
    resumed = run_cli(["moves", "resume", path])  # rolls the interrupted move back, then finishes the drain's job
    assert resumed.returncode == 0 and "drain completed: 3 of 3 planned briefcase(s) moved" in resumed.stdout, resumed.stdout

    done = run_cli(["drain", path, "u3"])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "draining u3: 0 briefcase(s) to move home" in done.stdout and "u3: holds no data" in done.stdout, done.stdout
    with cluster.store() as store:
        store.refresh()
        assert snapshot(store, SHARDS) == before, "nothing lost, nothing doubled"
        held = locations(store, SHARDS)
        for g in moved:
            assert held[g] == [store.router.default_placement("user", g).server] == [store.router.locate("user", g).server]
        assert _own(fsck(store, "user")) == []
    assert run_cli(["drain", path, "u3", "--check"]).returncode == 0


@pytest.mark.slow  # 33 s measured at load ~15 on 2 cores: docs/testing.md
def test_rebalance_drops_a_plan_under_the_minimum_improvement_and_names_partition_crossings(
    tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path,
) -> None:
    # two partitions of one shard each; every briefcase of the first is large
    cluster = make_cluster(dict(zip(["c", "u1", "u2"], tmp_sqlite_urls(3))), tmp_path, [("0:0:0", ["u1"]), ("0:0:100", ["u2"])])
    with cluster.store() as store:
        for i in range(1, 9):
            create_user(store, GDID(0, 0, i), orders=4, lines=3)
        for i in range(101, 105):
            create_user(store, GDID(0, 0, i), orders=1, lines=1)
        plan = plan_rebalance(store, "user")
        assert plan.moves and plan.dropped is None
        assert plan.cross_partition == plan.moves, "every move leaves its partition's only shard"
        strict = plan_rebalance(store, "user", min_improvement=10.0)
        assert strict.moves == [] and strict.dropped is not None and strict.after == strict.before
    run = run_cli(["rebalance", str(cluster.path), "user", "--plan"])
    assert run.returncode == 0 and "outside its partition's shard list" in run.stdout, run.stdout
    high = run_cli(["rebalance", str(cluster.path), "user", "--plan", "--min-improvement", "1000"])
    assert high.returncode == 0 and "under the minimum improvement" in high.stdout, high.stdout
    dropped = json.loads(run_cli(["rebalance", str(cluster.path), "user", "--plan", "--min-improvement", "1000", "--json"]).stdout)
    assert dropped["moves"] == [] and "nothing planned" in dropped["dropped"], dropped
