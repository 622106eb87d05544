"""Operator rails of `mdb reshard` (issue 29 items 2-4 and its exit codes), through the CLI.

* item 2: a freeze that cannot get the partition's lock (a write session held open) or is
  stopped by Ctrl-C, at either old shard, leaves the partition writable, says who held the
  lock, and exits 4 (retryable); `mdb moves resume` finishes the reshard afterwards;
* item 3: a reshard refused by its prechecks (schema drift, a literal password in the map)
  leaves nothing to resume and blocks no later move;
* item 4: Ctrl-C (and SIGTERM) stop a reshard at any --parallel after the batches in hand,
  long before every planned briefcase has moved; resume finishes it;
* refused credentials exit 2 with a hint (not 3, "unavailable"); a shard that dies during a
  reshard exits 3 naming it; Ctrl-C of `mdb move` says what it left and what to run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support import forkserver
from support.moves import ROOT, Cluster, add_transaction, create_user, locations, make_cluster, run_cli
from sqlalchemy import create_engine, text

from mdb.demo.models import User, UserBriefcase
from mdb.gdid import GDID
from mdb.moves.batch import BATCH_KIND
from mdb.moves.freeze import frozen_by
from mdb.moves.journal import Journal
from mdb.store import Store
from mdb.urls import sqlalchemy_url

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

SERVERS = ["u1", "u2", "x"]
OLD = ["u1", "u2"]
START = GDID.parse("0:0:0")
RESHARD = ["--partition", "0:0:0", "--shards", "u1,u2,x"]


def _cluster(urls: Sequence[str], tmp_path: Path, users: int) -> Cluster:
    cluster = make_cluster(dict(zip(["c", *SERVERS], urls)), tmp_path, [("0:0:0", OLD)])
    with cluster.store() as store:
        for n in range(1, users + 1):
            create_user(store, GDID(0, 0, n), orders=1, lines=1)
    return cluster


def _popen(args: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", *args], cwd=str(ROOT), env=full,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(proc: subprocess.Popen[str], what: str, ready: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"mdb ended (exit {proc.returncode}) before {what}: {proc.communicate()}")
        if ready():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _stop(proc: subprocess.Popen[str], sig: signal.Signals) -> tuple[str, str, float]:
    """Send ``sig``; (stdout, stderr, seconds until the process exited)."""
    sent = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return out, err, time.monotonic() - sent


@contextmanager
def _reaped(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@contextmanager
def _write_session_held(cluster: Cluster, server: str) -> Iterator[int]:
    """An open write transaction of a partition-0 briefcase on ``server`` that stays there under the
    new list (its value is 0 or 1 mod 6), holding the partition's lock SHARED; yields its backend pid."""
    residue = OLD.index(server)
    g = next(GDID(0, 0, n) for n in range(6, 100) if n % 6 == residue)
    with cluster.store() as store:
        with store.briefcase(UserBriefcase, g) as s:
            if s.get(User, g) is None:
                s.add(User(user_id=g, email=f"{g}@example.com", name="held"))
                s.flush()
            assert s.placement.server == server
            yield int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _writes_go_through(cluster: Cluster) -> None:
    """Nothing of the partition is frozen on its old shards, and a briefcase on each takes a write now."""
    with Store.from_yaml(cluster.path, types=[UserBriefcase], move_wait_seconds=2.0) as store:
        assert {s: frozen_by(store, "user", START, s) for s in OLD} == {"u1": None, "u2": None}
        for g in (GDID(0, 0, 6), GDID(0, 0, 1)):  # on u1 and on u2 under either list: they never move
            add_transaction(store, g, 9_000_000 + g.counter, 1)


def _resume_finishes(cluster: Cluster) -> None:
    done = run_cli(["moves", "resume", str(cluster.path)])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "(reshard): reshard completed" in done.stdout, done.stdout
    with cluster.store() as store:
        assert Journal(store).entries(unfinished=True) == []
        assert {s: frozen_by(store, "user", START, s) for s in OLD} == {"u1": None, "u2": None}
        for g, held in locations(store, SERVERS).items():
            assert len(held) == 1 and store.router.locate("user", g).server == held[0], (g, held)


# -- item 2: the freeze ----------------------------------------------------------------------------


@pytest.mark.parametrize("held", OLD)
def test_a_freeze_past_its_lock_wait_unfreezes_and_names_the_session(held: str, pg_databases: Callable[[int], list[str]],
                                                                     tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path, users=8)
    with _write_session_held(cluster, held) as pid:
        run = run_cli(["reshard", str(cluster.path), "user", *RESHARD, "--parallel", "2", "--freeze-wait", "1"])
        assert run.returncode == 4, (run.stdout, run.stderr)  # retryable: nothing half-done
        assert f"on server {held!r} waited 1 s for the partition's lock" in run.stderr, run.stderr
        assert f"held by session pid {pid} (user postgres" in run.stderr, run.stderr
        assert "mdb moves resume MAP" in run.stderr and "Traceback" not in run.stderr, run.stderr
        _writes_go_through(cluster)  # the session is still open: the freeze gave up and let go
    _resume_finishes(cluster)


@pytest.mark.parametrize("held", OLD)
def test_ctrl_c_during_the_freeze_at_either_old_shard_unfreezes(held: str, pg_databases: Callable[[int], list[str]],
                                                                tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path, users=8)
    with _write_session_held(cluster, held), cluster.store() as probe:
        def freeze_waits() -> bool:
            with probe.transaction(held) as conn:
                return bool(conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")).scalar())

        with _reaped(_popen(["reshard", str(cluster.path), "user", *RESHARD, "--parallel", "2", "--freeze-wait", "60"])) as proc:
            _wait_for(proc, f"the freeze to wait for the partition's lock on {held}", freeze_waits)
            _, err, _ = _stop(proc, signal.SIGINT)
        assert proc.returncode == 130, err
        assert "interrupted at step freeze: run `mdb moves resume" in err and "Traceback" not in err, err
        _writes_go_through(cluster)
    _resume_finishes(cluster)


# -- item 3: a refusal leaves nothing to resume ----------------------------------------------------


SECRET = "Lit3ral-pa55word"


@pytest.mark.parametrize("refusal", ["schema drift", "literal password"])
def test_a_reshard_refused_by_its_prechecks_leaves_nothing_to_resume(refusal: str, pg_databases: Callable[[int], list[str]],
                                                                     tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path, users=6)
    if refusal == "schema drift":
        engine = create_engine(sqlalchemy_url(cluster.urls["x"]))
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE users DROP COLUMN name"))
        engine.dispose()
        said = "differ from the models"
    else:  # the test servers trust every password, so only the precheck can object to it
        cluster.urls["x"] = cluster.urls["x"].replace("postgres@", f"postgres:{SECRET}@", 1)
        cluster.write([("0:0:0", OLD)], 1)
        said = "carries a literal password"
    run = run_cli(["reshard", str(cluster.path), "user", *RESHARD])
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert said in run.stderr and SECRET not in run.stderr + run.stdout, run.stderr

    status = json.loads(run_cli(["moves", "status", str(cluster.path), "--json"]).stdout)
    assert status["in_flight"] == [], status
    assert [(r["kind"], r["status"]) for r in status["recent"]] == [("reshard", "aborted")], status["recent"]
    resume = run_cli(["moves", "resume", str(cluster.path)])
    assert (resume.returncode, resume.stdout.strip()) == (0, "nothing to resume"), (resume.stdout, resume.stderr)
    g = GDID(0, 0, 2)  # on u1: a later move of the area is not refused by the refused reshard
    moved = run_cli(["move", str(cluster.path), "user", str(g), "--to", "u2"])
    assert moved.returncode == 0, (moved.stdout, moved.stderr)


# -- item 4: Ctrl-C and SIGTERM stop every worker ---------------------------------------------------


@pytest.mark.parametrize(("parallel", "sig"), [(1, signal.SIGINT), (2, signal.SIGINT), (4, signal.SIGINT), (2, signal.SIGTERM)],
                         ids=["ctrl-c-1", "ctrl-c-2", "ctrl-c-4", "sigterm-2"])
def test_an_interrupt_stops_the_reshard_after_the_batches_in_hand(parallel: int, sig: signal.Signals,
                                                                   pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path, users=36)  # 24 of them move (value 2-5 mod 6)
    # Every move takes 0.6 s more (outside any lock): the reshard lasts long enough to be stopped.
    env = {"MDB_FAULT_POINT": "batch.after_journal_start", "MDB_FAULT_ACTION": "sleep:0.6"}
    args = ["reshard", str(cluster.path), "user", *RESHARD, "--parallel", str(parallel), "--batch-pause", "0"]
    with cluster.store() as probe, _reaped(_popen(args, env)) as proc:
        journal = Journal(probe)

        def moved_one() -> bool:
            return any(e.kind == "reshard" and e.briefcases_done >= 1 for e in journal.entries(unfinished=True))

        _wait_for(proc, "the first briefcase to move", moved_one)
        _, err, took = _stop(proc, sig)
        (entry,) = [e for e in journal.entries(unfinished=True) if e.kind == "reshard"]
    print(f"--parallel {parallel}: exited {took:.2f} s after {sig.name}, {entry.briefcases_done}/{entry.briefcases_total} moved")
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), err
    assert entry.briefcases_total == 24 and entry.briefcases_done < 24, "it went on moving after the signal"
    assert f"reshard {entry.move_id} interrupted at step moves: run `mdb moves resume" in err and "Traceback" not in err, err
    _resume_finishes(cluster)


def test_ctrl_c_stops_parallel_batched_workers_before_their_next_step_and_rolls_their_batches_back(
    pg_databases: Callable[[int], list[str]], tmp_path: Path,
) -> None:
    """Issue 32: the job's items are worked by threads; Ctrl-C reaches the main thread only. The workers
    see the stop before their batch's next step (here its cutover), roll the batch back, and the command
    ends with 130 at once, not after the batches in hand; nothing is left half-cut, resume finishes."""
    cluster = _cluster(pg_databases(4), tmp_path, users=36)
    env = {"MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_ACTION": "sleep:1.5"}  # every batch waits before its cutover
    args = ["reshard", str(cluster.path), "user", *RESHARD, "--parallel", "2"]
    with cluster.store() as probe, _reaped(_popen(args, env)) as proc:
        journal = Journal(probe)
        _wait_for(proc, "a batch to be in flight", lambda: any(e.kind == BATCH_KIND for e in journal.entries(unfinished=True)))
        _, err, took = _stop(proc, signal.SIGINT)
        unfinished = journal.entries(unfinished=True)
    print(f"--parallel 2, batched: exited {took:.2f} s after SIGINT")
    assert proc.returncode == 130, err
    (entry,) = [e for e in unfinished if e.kind == "reshard"]
    assert f"reshard {entry.move_id} interrupted at step moves: run `mdb moves resume" in err and "Traceback" not in err, err
    assert [e.move_id for e in unfinished if e.kind != "reshard"] == [], "a batch was left half-cut"
    _resume_finishes(cluster)


# -- exit codes ------------------------------------------------------------------------------------


def test_refused_credentials_exit_2_with_a_hint_not_3(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path, users=4)
    cluster.urls["x"] = cluster.urls["x"].replace("postgres@", "no_such_role@", 1)
    cluster.write([("0:0:0", OLD)], 1)
    run = run_cli(["reshard", str(cluster.path), "user", *RESHARD, "--dry-run"])
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "server 'x' refused the credentials" in run.stderr and "check the user and password" in run.stderr, run.stderr
    assert "unavailable" not in run.stderr, run.stderr


def test_a_shard_that_dies_during_a_reshard_is_named_with_exit_3(pg_databases: Callable[[int], list[str]],
                                                                 pg_server_factory: Any, tmp_path: Path) -> None:
    dedicated = pg_server_factory()
    urls = [*pg_databases(3), dedicated.create_database()]
    cluster = _cluster(urls, tmp_path, users=60)
    env = {"MDB_FAULT_POINT": "reshard.after_first_move", "MDB_FAULT_ACTION": "sleep:3"}
    with cluster.store() as probe, _reaped(_popen(["reshard", str(cluster.path), "user", *RESHARD, "--parallel", "2"], env)) as proc:
        journal = Journal(probe)
        _wait_for(proc, "the first briefcase to move", lambda: any(e.briefcases_done >= 1 for e in journal.entries(unfinished=True)
                                                                    if e.kind == "reshard"))
        dedicated.stop()  # x, the new shard, goes away while the reshard sleeps after its first move
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "server 'x'" in err and "Traceback" not in err, err


def test_ctrl_c_of_a_move_says_what_it_left_and_what_to_run(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path, users=4)
    g = GDID(0, 0, 2)
    env = {"MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_ACTION": "sleep:600"}
    with cluster.store() as probe, _reaped(_popen(["move", str(cluster.path), "user", str(g), "--to", "x"], env)) as proc:
        journal = Journal(probe)
        _wait_for(proc, "the move to be journaled", lambda: bool(journal.entries(unfinished=True)))
        time.sleep(1.0)  # on to its fault point, where it sleeps
        _, err, _ = _stop(proc, signal.SIGINT)
        (entry,) = journal.entries(unfinished=True)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == (f"note: move {entry.move_id} of user/{g} (u1 -> x) interrupted at step {entry.step}: run "
                           f"`mdb moves resume {cluster.path}` to finish it (past its commit point) or roll it back (before it)"), err
    done = run_cli(["moves", "resume", str(cluster.path)])
    assert done.returncode == 0, (done.stdout, done.stderr)
