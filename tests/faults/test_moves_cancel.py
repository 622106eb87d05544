"""`mdb moves cancel` (issue 11 item 12): a reshard is undone and the old map stays in force.

Real reshards on real PostgreSQL: one SIGKILLed with a move half done (cancelled, moving the
finished ones back or leaving them), one still running in another process (asked to stop, then
cancelled), and one past its map apply (refused: it can only be finished). Every table must
equal its snapshot from before, every briefcase must be exactly once where routing sends it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from support import forkserver
from support.moves import ROOT, Cluster, create_user, locations, make_cluster, run_cli, snapshot

from mdb.gdid import GDID
from mdb.moves.freeze import frozen_by
from mdb.moves.journal import Journal

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

SERVERS = ["u1", "u2", "x"]
USERS = [GDID(0, 0, i) for i in range(1, 9)]
RESHARD = ["reshard", "--partition", "0:0:0", "--shards", "u1,u2,x"]


@pytest.fixture
def cluster(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Cluster:
    cluster = make_cluster(dict(zip(["c", *SERVERS], pg_databases(4))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g, orders=1, lines=2)
    return cluster


def _reshard_args(cluster: Cluster) -> list[str]:
    """One briefcase per cutover, so a kill lands between single moves; a cancel of batches: tests/faults/test_reshard_batches.py."""
    return [RESHARD[0], str(cluster.path), "user", *RESHARD[1:], "--batch-pause", "0"]


def _state(cluster: Cluster) -> tuple[dict, dict[GDID, list[str]]]:
    with cluster.store() as store:
        return snapshot(store, SERVERS), locations(store, SERVERS)


def _the_reshard(cluster: Cluster) -> str:
    with cluster.store() as store:
        (reshard,) = [e for e in Journal(store).entries() if e.kind == "reshard"]
    return reshard.move_id


def _check_cancelled(cluster: Cluster, before: tuple[dict, dict[GDID, list[str]]], map_text: str, *, moved_back: bool) -> dict[GDID, list[str]]:
    rows, homes = before
    assert cluster.path.read_text(encoding="utf-8") == map_text, "the map file changed"
    with cluster.store() as store:
        store.refresh()
        assert [list(p[2]) for p in store.router.partitions("user")] == [["u1", "u2"]], "the old map is not in force"
        assert snapshot(store, SERVERS) == rows, "rows differ from the snapshot taken before the reshard"
        now = locations(store, SERVERS)
        for g, servers in now.items():
            assert len(servers) == 1 and store.router.locate("user", g).server == servers[0], (g, servers)
        if moved_back:
            assert now == homes and not store.router.relocations
        for server in ("u1", "u2"):
            assert frozen_by(store, "user", GDID(0, 0, 0), server) is None
        journal = Journal(store)
        assert journal.entries(unfinished=True) == []
        (reshard,) = [e for e in journal.entries() if e.kind == "reshard"]
        assert reshard.status == "cancelled", reshard
    return now


@pytest.mark.parametrize("mode", ["--move-back", "--leave"])
def test_cancel_a_killed_reshard(cluster: Cluster, mode: str) -> None:
    before = _state(cluster)
    map_text = cluster.path.read_text(encoding="utf-8")
    # Killed with two moves finished and the third one copied but not past its commit point.
    run = run_cli(_reshard_args(cluster), env={"MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_SKIP": "2"})
    assert run.returncode == -signal.SIGKILL, (run.stdout, run.stderr)
    reshard_id = _the_reshard(cluster)
    done = run_cli(["moves", "cancel", str(cluster.path), reshard_id, mode])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "1 interrupted move(s) rolled back, 2 finished" in done.stdout, done.stdout
    now = _check_cancelled(cluster, before, map_text, moved_back=mode == "--move-back")
    if mode == "--leave":
        with cluster.store() as store:
            store.refresh()
            assert len(store.router.relocations) == 2, "the two finished moves are not left as relocations"
        assert sum(now[g] != before[1][g] for g in now) == 2
    again = run_cli(["moves", "cancel", str(cluster.path), reshard_id])
    assert again.returncode == 2 and "already finished (cancelled)" in again.stderr, again.stderr


def test_a_killed_cancel_is_finished_by_resume(cluster: Cluster) -> None:
    before = _state(cluster)
    map_text = cluster.path.read_text(encoding="utf-8")
    run = run_cli(_reshard_args(cluster), env={"MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_SKIP": "2"})
    assert run.returncode == -signal.SIGKILL, (run.stdout, run.stderr)
    reshard_id = _the_reshard(cluster)
    killed = run_cli(["moves", "cancel", str(cluster.path), reshard_id], env={"MDB_FAULT_POINT": "cancel.after_first_move_back"})
    assert killed.returncode == -signal.SIGKILL, (killed.stdout, killed.stderr)
    done = run_cli(["moves", "resume", str(cluster.path)])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert f"{reshard_id} (reshard): cancel completed: cancelled at step 'moves'" in done.stdout, done.stdout
    assert "2 finished (2 moved back)" in done.stdout, done.stdout
    _check_cancelled(cluster, before, map_text, moved_back=True)


def test_cancel_a_running_reshard_from_another_process(cluster: Cluster) -> None:
    before = _state(cluster)
    map_text = cluster.path.read_text(encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MDB_FAULT_POINT": "reshard.after_first_move", "MDB_FAULT_ACTION": "sleep:8"}
    proc = forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", *_reshard_args(cluster)],
                            cwd=str(ROOT), env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            with cluster.store() as store:
                if any(e.briefcases_done for e in Journal(store).entries(unfinished=True) if e.kind == "reshard"):
                    break
            time.sleep(0.2)
        done = run_cli(["moves", "cancel", str(cluster.path), _the_reshard(cluster)])
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert proc.returncode == 2 and "stopped at the request of pid" in err, (proc.returncode, err)
    # What the first batch held (its pair's briefcases up to the batch size): every one of them moved back.
    finished = re.search(r"(\d+) finished \((\d+) moved back\)", done.stdout)
    assert finished is not None and int(finished[1]) >= 1 and finished[1] == finished[2], done.stdout
    _check_cancelled(cluster, before, map_text, moved_back=True)


def test_a_reshard_past_its_map_apply_cannot_be_cancelled(cluster: Cluster) -> None:
    run = run_cli(_reshard_args(cluster), env={"MDB_FAULT_POINT": "reshard.after_map_apply"})
    assert run.returncode == -signal.SIGKILL, (run.stdout, run.stderr)
    reshard_id = _the_reshard(cluster)
    refused = run_cli(["moves", "cancel", str(cluster.path), reshard_id])
    assert refused.returncode == 2 and "it can only be finished" in refused.stderr, refused.stderr
    assert run_cli(["moves", "resume", str(cluster.path)]).returncode == 0
    assert yaml.safe_load(cluster.path.read_text(encoding="utf-8"))["version"] == 2
