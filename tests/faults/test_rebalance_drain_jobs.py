"""Rebalance, drain and a cancel's move-back as jobs in CENTRAL (issue 32), on real PostgreSQL.

Each command is SIGKILLed in the middle of its job (at a batch's fault point, or after its
first move back), and then something else finishes the job: ``mdb worker`` processes (which
adopt the job whose driver is gone and claim its work items), ``mdb moves resume``, or a
``mdb moves cancel`` (which stops a rebalance, leaving its finished moves where they are). The
oracle: every briefcase exactly once, on the server a fresh router sends it to, every row equal
to the snapshot taken before, and nothing unfinished in the journal.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.templates import Databases
from support.fleet import SHARDS, cloned_skewed
from support.moves import Cluster, locations, run_cli, snapshot
from support.reshard import SERVERS, USERS, cluster  # noqa: F401
from support.workers import no_process_left, spawn, stop, worker  # noqa: F401

from mdb.gdid import GDID
from mdb.moves.freeze import frozen_by
from mdb.moves.journal import Journal
from mdb.moves.move import move_briefcase

pytestmark = pytest.mark.slow  # processes killed at fault points, then workers or resume: tens of seconds per test (docs/testing.md)

SMALL_ITEMS = {"MDB_ITEM_BRIEFCASES": "2"}
"""A handful of briefcases per job here: cut into several items, so a kill lands between and inside them."""


@pytest.fixture(autouse=True)
def _no_process_left(no_process_left: None) -> Iterator[None]:  # noqa: F811
    yield


def _state(cluster: Cluster, servers: list[str]) -> tuple[dict[str, Counter[tuple[Any, ...]]], dict[GDID, list[str]]]:
    with cluster.store() as store:
        return snapshot(store, servers), locations(store, servers)


def _check(cluster: Cluster, servers: list[str], rows: dict[str, Counter[tuple[Any, ...]]]) -> dict[GDID, str]:
    """Every briefcase once, where a fresh router sends it; every row as before; the journal has nothing unfinished."""
    with cluster.store() as store:
        store.refresh()
        assert snapshot(store, servers) == rows, "rows lost or doubled"
        homes: dict[GDID, str] = {}
        for g, held in locations(store, servers).items():
            assert len(held) == 1 and store.router.locate("user", g).server == held[0], (g, held)
            homes[g] = held[0]
        assert Journal(store).entries(unfinished=True) == []
        return homes


def _job(cluster: Cluster, kind: str) -> dict[str, Any]:
    """The job's row as ``mdb moves status --json`` shows it (in flight)."""
    shown = run_cli(["moves", "status", str(cluster.path), "--json"])
    assert shown.returncode == 0, shown.stderr
    (job,) = [e for e in json.loads(shown.stdout)["in_flight"] if e["kind"] == kind]
    return dict(job)


def _counted(cluster: Cluster, kind: str) -> bool:
    """An unfinished job of ``kind`` counts at least one briefcase moved in its journal row."""
    with cluster.store() as store:
        return any(e.briefcases_done for e in Journal(store).entries(unfinished=True) if e.kind == kind)


def _finish_with_workers(cluster: Cluster, n: int, env: dict[str, str]) -> list[tuple[int, str]]:
    """Start ``n`` workers, wait until the journal has nothing unfinished, stop them; their exit codes and output."""
    pool = [worker(cluster, env) for _ in range(n)]
    deadline = time.monotonic() + 300
    while True:
        with cluster.store() as store:
            if not Journal(store).entries(unfinished=True):
                break
        assert time.monotonic() < deadline, "the workers did not finish the interrupted job"
        assert all(p.poll() is None for p in pool), [p.communicate() for p in pool if p.poll() is not None]
        time.sleep(0.2)
    stopped = stop(pool)
    assert all(rc in (0, 130, 143, -signal.SIGTERM) for rc, _ in stopped), stopped
    return stopped


@pytest.mark.timeout(600)
@pytest.mark.parametrize("finisher", ["workers", "cancel"])
def test_a_rebalance_killed_mid_job_is_finished_by_workers_or_stopped_by_cancel(
    pg_databases: Databases, tmp_path: Path, finisher: str,
) -> None:
    skewed = cloned_skewed(pg_databases, tmp_path)
    rows, _ = _state(skewed, SHARDS)
    shown = run_cli(["rebalance", str(skewed.path), "user", "--plan", "--json"])
    assert shown.returncode == 0, shown.stderr
    planned = {GDID.parse(m["gdid"]): m["target"] for m in json.loads(shown.stdout)["moves"]}
    assert len(planned) >= 3, planned  # several items, so the kill lands with one done and one in hand
    # Killed in its second batch, with that batch's pre-copy committed on the target (the first one moved).
    killed = run_cli(["rebalance", str(skewed.path), "user", "--apply"],
                     env={**SMALL_ITEMS, "MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_SKIP": "1"})
    assert killed.returncode == -signal.SIGKILL, (killed.stdout, killed.stderr)
    job = _job(skewed, "rebalance")
    assert job["driver"].startswith("interrupted") and job["briefcases_total"] == len(planned), job
    if finisher == "workers":
        stopped = _finish_with_workers(skewed, 2, SMALL_ITEMS)
        assert any(f"driving rebalance {job['move_id']}" in out for _, out in stopped), stopped
        homes = _check(skewed, SHARDS, rows)
        assert {g: homes[g] for g in planned} == planned, "a planned move is missing"
    else:
        done = run_cli(["moves", "cancel", str(skewed.path), job["move_id"]])
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert "stopped at step 'moves': 1 interrupted move(s) rolled back" in done.stdout, done.stdout
        homes = _check(skewed, SHARDS, rows)
        assert sum(homes[g] == t for g, t in planned.items()) >= 1, "the finished move was not left where it went"
        with skewed.store() as store:
            (entry,) = [e for e in Journal(store).entries() if e.kind == "rebalance"]
            assert entry.status == "cancelled", entry


@pytest.mark.timeout(600)
def test_a_worker_on_another_host_claims_a_running_rebalances_items(pg_databases: Databases, tmp_path: Path) -> None:
    skewed = cloned_skewed(pg_databases, tmp_path)
    rows, _ = _state(skewed, SHARDS)
    slow = {**SMALL_ITEMS, "MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_ACTION": "sleep:2"}  # items stay in flight a while
    helper = worker(skewed, {**slow, "MDB_HOST_NAME": "host-b"})
    applied = run_cli(["rebalance", str(skewed.path), "user", "--apply"], env=slow, timeout=300)
    assert applied.returncode == 0, (applied.stdout, applied.stderr)
    ((rc, said),) = stop([helper])
    assert rc in (0, 130, 143), (rc, said)
    job_id = applied.stdout.split("(job ")[1].split(")")[0]
    assert f" of job {job_id}: " in said, said  # the worker claimed at least one item of the command's job
    _check(skewed, SHARDS, rows)


@pytest.mark.timeout(600)
def test_sigterm_of_a_rebalance_gives_its_items_back_and_resume_finishes_it(
    pg_databases: Databases, tmp_path: Path,
) -> None:
    skewed = cloned_skewed(pg_databases, tmp_path)
    rows, _ = _state(skewed, SHARDS)
    slow = {**SMALL_ITEMS, "MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_ACTION": "sleep:2"}  # every batch: time to stop it in one
    proc = spawn(["rebalance", str(skewed.path), "user", "--apply"], slow)
    deadline = time.monotonic() + 120
    while not _counted(skewed, "rebalance"):  # a batch moved and the job's row counts it: stopped in a later one
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, out, err)
    assert "interrupted (its work items given back)" in err and "Traceback" not in err, err
    job = _job(skewed, "rebalance")
    assert job["driver"].startswith("interrupted") and 0 < job["briefcases_done"] < job["briefcases_total"], job
    shown = run_cli(["moves", "status", str(skewed.path), "--json"])
    held = [w for w in json.loads(shown.stdout)["workers"] if w["holder"] is not None and w["holder"]["alive"]]
    assert held == [], "an item is still held by a live process after the command stopped"
    resumed = run_cli(["moves", "resume", str(skewed.path)], env=SMALL_ITEMS)
    assert resumed.returncode == 0 and "rebalance completed" in resumed.stdout, (resumed.stdout, resumed.stderr)
    _check(skewed, SHARDS, rows)


@pytest.mark.timeout(600)
def test_a_drain_killed_past_a_batch_commit_point_is_finished_by_resume(cluster: Cluster) -> None:  # noqa: F811
    relocated = USERS[:8]
    with cluster.store() as store:
        for g in relocated:
            move_briefcase(store, "user", g, "x")
    rows, _ = _state(cluster, SERVERS)
    path = str(cluster.path)
    # Killed in its second batch past the commit point: resume must finish that batch forward, then move the rest.
    killed = run_cli(["drain", path, "x"], env={**SMALL_ITEMS, "MDB_FAULT_POINT": "batch.after_commit_point", "MDB_FAULT_SKIP": "1"})
    assert killed.returncode == -signal.SIGKILL, (killed.stdout, killed.stderr)
    assert "draining x: 8 briefcase(s) to move home" in killed.stdout, killed.stdout
    job = _job(cluster, "drain")
    assert job["driver"].startswith("interrupted") and job["briefcases_done"] >= 2, job
    resumed = run_cli(["moves", "resume", path], env=SMALL_ITEMS)
    assert resumed.returncode == 0, (resumed.stdout, resumed.stderr)
    assert f"{job['move_id']} (drain): drain completed: 8 of 8 planned briefcase(s) moved" in resumed.stdout, resumed.stdout
    homes = _check(cluster, SERVERS, rows)
    with cluster.store() as store:
        store.refresh()
        assert all(homes[g] == store.router.default_placement("user", g).server != "x" for g in relocated)
        assert not store.router.relocations
    assert run_cli(["drain", path, "x", "--check"]).returncode == 0


@pytest.mark.timeout(600)
def test_a_cancels_move_back_killed_mid_job_is_finished_by_a_worker(cluster: Cluster) -> None:  # noqa: F811
    rows, homes_before = _state(cluster, SERVERS)
    map_text = cluster.path.read_text(encoding="utf-8")
    path = str(cluster.path)
    # Every briefcase bound for x moved (batched, in items), then the reshard killed before its freeze.
    killed = run_cli(["reshard", path, "user", "--partition", "0:0:0", "--shards", "u1,u2,x"],
                     env={**SMALL_ITEMS, "MDB_FAULT_POINT": "reshard.after_moves"})
    assert killed.returncode == -signal.SIGKILL, (killed.stdout, killed.stderr)
    with cluster.store() as store:
        (reshard,) = [e for e in Journal(store).entries(unfinished=True) if e.kind == "reshard"]
    assert reshard.briefcases_done >= 4, reshard
    # The cancel killed after its first batch moved back: the rest of its move-back is left in the job.
    cancel = run_cli(["moves", "cancel", path, reshard.move_id], env={**SMALL_ITEMS, "MDB_FAULT_POINT": "cancel.after_first_move_back"})
    assert cancel.returncode == -signal.SIGKILL, (cancel.stdout, cancel.stderr)
    job = _job(cluster, "reshard")
    assert job["step"] == "cancel" and job["driver"].startswith("interrupted"), job
    stopped = _finish_with_workers(cluster, 2, SMALL_ITEMS)
    said = "\n".join(out for _, out in stopped)
    # The worker's closing line ("cancel completed: ...") comes after the journal row is finished, which
    # is when the workers are stopped: it may not be printed yet. What it says is checked below, in the data.
    assert f"driving reshard {reshard.move_id} from step 'cancel'" in said, said
    assert cluster.path.read_text(encoding="utf-8") == map_text, "the map file changed"
    homes = _check(cluster, SERVERS, rows)
    assert {g: [s] for g, s in homes.items()} == homes_before, "a briefcase was not moved back"
    with cluster.store() as store:
        store.refresh()
        assert [list(p[2]) for p in store.router.partitions("user")] == [["u1", "u2"]]
        assert not store.router.relocations
        assert all(frozen_by(store, "user", GDID(0, 0, 0), s) is None for s in ("u1", "u2"))
        (entry,) = [e for e in Journal(store).entries() if e.kind == "reshard"]
        assert entry.status == "cancelled", entry
