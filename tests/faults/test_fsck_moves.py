"""``mdb fsck --repair`` against moves in flight (issue 28 item 2, DESIGN.md invariant 7).

A reshard moves briefcases in batches; each batch pre-copies its briefcases to the target
before it takes the lock. fsck used to take those copies for leftovers and delete them, and a
batch that then committed lost them. Here a reshard (the installed ``mdb``, real PostgreSQL,
writers running all the time) is

- paused (``MDB_FAULT_ACTION=stop``: the process SIGSTOPs itself) at each step of a batch while
  ``mdb fsck --repair`` runs, then continued to its end;
- SIGKILLed at each step, then ``mdb fsck --repair`` runs before ``mdb moves resume``.

In every case fsck reports the batch's briefcases as ``unfinished_move`` ("run `mdb moves
resume MAP`") and repairs nothing; afterwards every acknowledged write is present exactly once,
on its routed server, read from the servers directly (``_check_writes``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import forkserver
from support.moves import ROOT, Cluster, process_state
from support.reshard import BATCH_POINTS, Writers, _check_placement, _check_writes, cluster, writers  # noqa: F401  (fixtures)

from mdb.fleet.fsck import RESUME
from mdb.moves.batch import BATCH_KIND
from mdb.moves.journal import Journal

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

MDB = str(Path(sys.executable).parent / "mdb")  # the installed console script
LISTS = [["u1", "u2", "x"]]
"""One pass per point, out to three shards: ~13 briefcases move, in two batches."""
POINTS = [p for p in BATCH_POINTS if p not in ("batch.resume.after_discard", "batch.after_resync")]
WRITERS_MOVE_WAIT = 5.0
"""The writer thread gives up on a briefcase a killed batch left moving after 5 s, not 30 s, and
writes the next (support.reshard.WRITERS_MOVE_WAIT): ``writers.wait_for(10)`` before the resume
sat out 30 s per such briefcase."""


def mdb(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return forkserver.run([MDB, *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=300, cwd=str(ROOT))


def _wait_stopped_or_exited(proc: subprocess.Popen[str]) -> bool:
    """True when the process stopped itself (paused at its point), False when it exited."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if process_state(proc.pid) == "T":
            return True
        time.sleep(0.02)
    raise AssertionError(f"the reshard neither paused nor ended (state {process_state(proc.pid)!r})")


def _fsck_repair(cluster: Cluster, point: str) -> list[dict[str, Any]]:
    """``mdb fsck --repair``: nothing repaired; every finding is the batch's unfinished move."""
    run = mdb("fsck", str(cluster.path), "user", "--repair", "--json")
    assert run.returncode in (0, 1), (point, run.stdout, run.stderr)
    (area,) = json.loads(run.stdout)["areas"]
    findings: list[dict[str, Any]] = area["findings"]
    assert [f for f in findings if f["action"] == "repaired"] == [], (point, findings)
    assert {f["kind"] for f in findings} <= {"unfinished_move"}, (point, findings)
    assert all(f["action"] == RESUME for f in findings), (point, findings)
    return findings


def _named_by_batches(cluster: Cluster) -> set[str]:
    with cluster.store() as store:
        return {str(g) for e in Journal(store).entries(unfinished=True) if e.kind == BATCH_KIND for g in e.briefcases}


@pytest.mark.parametrize("point", POINTS)
def test_fsck_repair_while_a_batch_is_paused_at_each_step(cluster: Cluster, writers: Writers, point: str) -> None:
    writers.wait_for(20)
    for shards in LISTS:
        proc = forkserver.popen(
            [MDB, "reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", ",".join(shards)],
            env={**os.environ, "MDB_FAULT_POINT": point, "MDB_FAULT_ACTION": "stop"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
        )
        try:
            checked = False
            while _wait_stopped_or_exited(proc):  # every batch of the pass stops at the point
                if not checked:  # fsck --repair against the first batch caught there
                    named = _named_by_batches(cluster)
                    assert named, f"{point}: paused, but no batch is running"
                    findings = _fsck_repair(cluster, point)
                    if point == "batch.after_precopy":  # its copies lie on the target: the batch's, not leftovers
                        assert findings, "fsck did not see the pre-copied briefcases"
                    assert {f["gdid"] for f in findings} <= named, (point, findings)
                    checked = True
                os.kill(proc.pid, signal.SIGCONT)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, (point, out, err)
        assert checked, f"{point}: the reshard never reached it"
        _check_placement(cluster)
        with cluster.store() as store:
            store.refresh()
            assert [list(p[2]) for p in store.router.partitions("user")] == [shards], point
        writers.wait_for(10)
    assert writers.stop() > 0
    _check_writes(cluster, writers.acked)


@pytest.mark.parametrize("point", POINTS)
def test_fsck_repair_after_a_batch_is_killed_at_each_step(cluster: Cluster, writers: Writers, point: str) -> None:
    writers.wait_for(20)
    for shards in LISTS:
        run = mdb("reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", ",".join(shards),
                  env={"MDB_FAULT_POINT": point})
        assert run.returncode == -signal.SIGKILL, (point, run.returncode, run.stderr)
        named = _named_by_batches(cluster)
        assert named, point
        findings = _fsck_repair(cluster, point)
        if point in ("batch.after_precopy", "batch.before_commit_point"):
            assert findings, "fsck did not see the batch's copies"
        assert {f["gdid"] for f in findings} <= named, (point, findings)
        writers.wait_for(10)
        done = mdb("moves", "resume", str(cluster.path))
        assert done.returncode == 0, (point, done.stdout, done.stderr)
        _check_placement(cluster)
        clean = mdb("fsck", str(cluster.path), "user", "--json")
        assert clean.returncode == 0, (point, clean.stdout)
    assert writers.stop() > 0
    _check_writes(cluster, writers.acked)
