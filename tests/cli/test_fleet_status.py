"""``mdb status`` in each state of a real PostgreSQL fleet, with its exit code and JSON (issue 33).

idle (0), a spare holding data (5), a reshard running (0), interrupted (5), a partition frozen
while its reshard runs (0) and after it was killed (6), a migration half-rolled (5). The
reshards are real ``mdb reshard`` processes held at a fault point (``MDB_FAULT_ACTION=sleep``)
and SIGKILLed there. ``mdb moves history`` is checked on the jobs these leave behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.moves import Cluster, run_cli

from mdb.migrations.scripts import open_history
from mdb.moves.journal import Journal
from support.templates import Databases
from support.fleet import ATTENTION, BROKEN, HEALTHY, STATUS_SERVERS, STATUS_USERS, REVISION, cloned, kill, start_reshard, status

SERVERS, USERS = STATUS_SERVERS, STATUS_USERS


@pytest.fixture
def fleet(pg_databases: Databases, tmp_path: Path) -> Cluster:
    return cloned(pg_databases, tmp_path)


def wait_for(cluster: Cluster, proc: subprocess.Popen[str], ready: Callable[[dict[str, Any]], bool]) -> tuple[int, dict[str, Any]]:
    """Poll ``mdb status`` until ``ready`` holds for its JSON (the reshard reached its fault point)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        code, out = status(cluster)
        if ready(out):
            return code, out
        time.sleep(0.3)
    raise AssertionError("the reshard never reached its fault point")


@pytest.mark.slow  # 97 s measured at load ~15 on 2 cores: docs/testing.md
def test_idle_then_a_spare_holding_data_and_the_history_of_that_move(fleet: Cluster) -> None:
    code, out = status(fleet)
    assert code == HEALTHY and out["verdict"] == "healthy", out["problems"]
    assert out["map"] == {"file_version": 1, "applied_version": 1, "file_behind": False}
    (area,) = out["areas"]
    assert [(s["server"], s["spare"]) for s in area["servers"]] == [("u1", False), ("u2", False), ("x", True)]
    assert sum(s["briefcases"] for s in area["servers"]) == len(USERS) and area["relocations"] == 0
    assert out["spares"] == [{"server": "x", "briefcases": {}}]
    assert out["jobs"] == [] and out["frozen"] == [] and out["failures"] == [] and out["problems"] == []

    moved = run_cli(["move", str(fleet.path), "user", str(USERS[0]), "--to", "x"])
    assert moved.returncode == 0, moved.stderr
    code, out = status(fleet)
    assert code == ATTENTION and out["verdict"] == "attention"
    assert out["spares"] == [{"server": "x", "briefcases": {"user": 1}}]
    assert out["areas"][0]["relocations"] == 1
    assert [p["what"] for p in out["problems"]] == ["spare server 'x' holds 1 briefcase(s) of 'user'"]
    skewed = run_cli(["status", str(fleet.path), "--max-skew", "0.2"])  # 4, 3 and 1 briefcases: far off the mean
    assert skewed.returncode == ATTENTION and "attention: area 'user': bytes skew" in skewed.stdout, skewed.stdout

    done = run_cli(["moves", "history", str(fleet.path), "--json"])
    assert done.returncode == 0, done.stderr
    (job,) = json.loads(done.stdout)["jobs"]
    assert (job["kind"], job["area"], job["target"], job["result"], job["error"]) == ("batch-move", "user", "x", "done", None)
    assert (job["briefcases_moved"], job["pauses"]) == (1, 1) and job["rows_moved"] > 0 and job["pause_p99_seconds"] is not None
    assert [p["phase"] for p in job["phases"]] == ["precopy", "lock", "commit_point", "relocation", "target_state"], job
    assert json.loads(run_cli(["moves", "history", str(fleet.path), "--json", "--area", "user", "--since", "1h"]).stdout)["jobs"] == [job]
    assert json.loads(run_cli(["moves", "history", str(fleet.path), "--json", "--since", "2999-01-01"]).stdout)["jobs"] == []
    bad = run_cli(["moves", "history", str(fleet.path), "--since", "yesterday"])
    assert bad.returncode == 2 and "--since 'yesterday'" in bad.stderr, bad.stderr


@pytest.mark.slow  # 190 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_reshard_running_then_interrupted_then_resumed(fleet: Cluster) -> None:
    proc = start_reshard(fleet, "reshard.after_first_move")
    try:
        code, out = wait_for(fleet, proc, lambda o: any(j["briefcases_done"] >= 1 for j in o["jobs"]))
        assert code == HEALTHY, out["problems"]
        (job,) = out["jobs"]
        assert (job["kind"], job["state"], job["phase"], job["workers"]) == ("reshard", "running", "moves", 1)
        assert job["lease"]["pid"] == proc.pid and job["lease"]["age_seconds"] >= 0 and "run" not in job
    finally:
        kill(proc)
    code, out = status(fleet)
    assert code == ATTENTION, out
    (job,) = out["jobs"]
    assert job["state"] == "interrupted" and job["interrupted_since"] is not None and job["eta_seconds"] is None
    assert job["run"] == [f"mdb moves resume {fleet.path}", f"mdb moves cancel {fleet.path} {job['id']}"]
    assert out["frozen"] == []
    text = run_cli(["status", str(fleet.path), "--max-skew", "100"])
    assert text.returncode == ATTENTION and f"reshard {job['id']} of area 'user' is interrupted at phase 'moves'" in text.stdout, text.stdout

    resumed = run_cli(["moves", "resume", str(fleet.path)])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    code, out = status(fleet)
    assert code == HEALTHY and out["jobs"] == [] and out["map"]["applied_version"] == 2 and out["map"]["file_behind"] is False
    (history,) = json.loads(run_cli(["moves", "history", str(fleet.path), "--json"]).stdout)["jobs"]
    assert (history["job_id"], history["kind"], history["result"]) == (job["id"], "reshard", "done")
    phases = [p["phase"] for p in history["phases"]]
    assert phases[:3] == ["plan", "prechecks", "moves"] and "map_apply" in phases and phases[-1] == "cleanup", phases
    assert history["briefcases_moved"] == history["briefcases_total"] and history["pauses"] >= 1
    assert history["pause_p99_seconds"] is not None
    with fleet.store() as store:  # the journal can be cleaned: the history is its own table
        journal = Journal(store)
        with store.transaction(journal.server) as conn:
            from mdb.moves.journal import moves_table
            conn.execute(moves_table.delete())
    assert json.loads(run_cli(["moves", "history", str(fleet.path), "--json"]).stdout)["jobs"] == [history]


@pytest.mark.slow  # 158 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_frozen_partition_while_its_reshard_runs_and_after_it_was_killed(fleet: Cluster) -> None:
    proc = start_reshard(fleet, "reshard.during_freeze")
    try:
        code, out = wait_for(fleet, proc, lambda o: bool(o["frozen"]))
        assert code == HEALTHY, out["problems"]  # a freeze is a reshard's normal final phase
        (frozen,) = out["frozen"]
        (job,) = out["jobs"]
        assert (frozen["area"], frozen["partition"], frozen["reshard_id"], frozen["reshard_running"]) == ("user", "0:0:0", job["id"], True)
        assert frozen["since"] is not None and job["phase"] == "freeze"
    finally:
        kill(proc)
    code, out = status(fleet)
    assert code == BROKEN and out["verdict"] == "broken", out
    assert [f["reshard_running"] for f in out["frozen"]] == [False]
    assert [p["level"] for p in out["problems"]] == ["attention", "broken"]
    assert "is frozen on 'u1' by" in out["problems"][1]["what"] and out["problems"][1]["fix"] == f"mdb moves resume {fleet.path}"

    assert run_cli(["moves", "resume", str(fleet.path)]).returncode == 0
    code, out = status(fleet)
    assert code == HEALTHY and out["frozen"] == [] and out["jobs"] == []


@pytest.mark.slow  # 99 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_migration_half_rolled_out(fleet: Cluster) -> None:
    root = fleet.path.parent / "migrations"
    open_history(root, "user", create=True)
    (root / "user" / "versions" / "a1_noop.py").write_text(REVISION, encoding="utf-8")
    killed = run_cli(["migrate", "up", str(fleet.path), "--parallel", "1"], env={"MDB_FAULT_POINT": "migrate.after_server"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, out = status(fleet)
    assert code == ATTENTION, out
    assert out["migrations"]["mixed"] == {"user": True}
    revisions = {m["server"]: m["revision"] for m in out["migrations"]["servers"]}
    assert sorted(revisions) == ["u1", "u2", "x"] and sorted(str(v) for v in revisions.values()) == ["None", "None", "a1"], revisions
    assert "servers at mixed migration revisions" in out["problems"][0]["what"]

    assert run_cli(["migrate", "up", str(fleet.path)]).returncode == 0
    code, out = status(fleet)
    assert code == HEALTHY and out["migrations"]["mixed"] == {"user": False}
    assert {m["revision"] for m in out["migrations"]["servers"]} == {"a1"}
