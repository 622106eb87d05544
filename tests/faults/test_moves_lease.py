"""One driver per journal entry (issue 11 items 10 and 11): owner, heartbeat, takeover.

A real ``mdb reshard`` is held alive in the middle of its moves (``MDB_FAULT_ACTION=sleep``);
meanwhile a second ``mdb moves resume`` and a second ``mdb reshard`` must refuse and name it,
and ``mdb moves status`` must say it is running. Once it is SIGKILLed, status says
"interrupted" and resume takes its lease over at once (its pid is gone from this host).
The takeover rules themselves are checked on rows written as another host would write them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import forkserver
from support.moves import ROOT, Cluster, create_user, make_cluster, run_cli
from sqlalchemy import func, update

from mdb.errors import MoveLeaseHeldError
from mdb.gdid import GDID
from mdb.moves.journal import Journal, move_leases
from mdb.moves.lease import hold, holder_of, lease_stale

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

SERVERS = ["u1", "u2", "x"]
USERS = [GDID(0, 0, i) for i in range(1, 9)]


def _cluster(urls: list[str], tmp_path: Path) -> Cluster:
    cluster = make_cluster(dict(zip(["c", *SERVERS], urls)), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g, orders=1, lines=1)
    return cluster


def _wait_for_first_move(cluster: Cluster, proc: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        with cluster.store() as store:
            running = [e for e in Journal(store).entries(unfinished=True) if e.kind == "reshard" and e.briefcases_done >= 1]
        if running:
            return running[0].move_id
        time.sleep(0.2)
    raise AssertionError("the reshard never finished its first move")


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["killed", "ctrl-c"])
def test_a_running_reshard_is_named_and_not_driven_twice(stop: signal.Signals, pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MDB_FAULT_POINT": "reshard.after_first_move", "MDB_FAULT_ACTION": "sleep:600"}
    proc = forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", "reshard", str(cluster.path), "user",
                             "--partition", "0:0:0", "--shards", "u1,u2,x"], cwd=str(ROOT), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        reshard_id = _wait_for_first_move(cluster, proc)
        holder = f"pid {proc.pid} on host {socket.gethostname()}"

        second = run_cli(["moves", "resume", str(cluster.path)])
        assert second.returncode == 2, (second.stdout, second.stderr)
        assert f"{reshard_id} is held by {holder}" in second.stdout, second.stdout

        again = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,x"])
        assert again.returncode == 2 and f"running (pid {proc.pid}, host {socket.gethostname()}" in again.stderr, again.stderr

        status = json.loads(run_cli(["moves", "status", str(cluster.path), "--json"]).stdout)
        (flying,) = [s for s in status["in_flight"] if s["move_id"] == reshard_id]
        assert flying["driver"].startswith(f"running (pid {proc.pid}, host {socket.gethostname()}, last beat"), flying
        assert flying["holder"]["alive"] is True
    finally:
        proc.send_signal(stop)  # Ctrl-C lets the lease go; SIGKILL leaves it to a dead pid
        try:
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    status = json.loads(run_cli(["moves", "status", str(cluster.path), "--json"]).stdout)
    (flying,) = [s for s in status["in_flight"] if s["move_id"] == reshard_id]
    assert flying["driver"] == "interrupted: run `mdb moves resume MAP`" and flying["eta_seconds"] is None, flying
    done = run_cli(["moves", "resume", str(cluster.path)])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert f"{reshard_id} (reshard): reshard completed" in done.stdout, done.stdout
    with cluster.store() as store:
        journal = Journal(store)
        assert journal.entries(unfinished=True) == []
        assert holder_of(journal, reshard_id) is None, "resume did not release the lease"


def test_where_says_a_killed_move_is_interrupted(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = _cluster(pg_databases(4), tmp_path)
    g = USERS[0]
    with cluster.store() as store:
        home = store.router.locate("user", g).server
    run = run_cli(["move", str(cluster.path), "user", str(g), "--to", next(s for s in SERVERS if s != home)],
                  env={"MDB_FAULT_POINT": "batch.after_precopy"})
    assert run.returncode == -signal.SIGKILL, run.stderr
    where = json.loads(run_cli(["where", str(cluster.path), "user", str(g), "--json"]).stdout)
    assert [m["driver"] for m in where["moves_in_flight"]] == ["interrupted: run `mdb moves resume MAP`"], where
    text = run_cli(["where", str(cluster.path), "user", str(g)])
    assert "at step precopy, interrupted: run `mdb moves resume MAP`" in text.stdout.replace("\n", " "), text.stdout


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_takeover_rules(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Free: released, or the pid is gone from this host, or another host's beat is stale.
    Held: a live pid on this host (however old its beat), another host with a fresh beat."""
    urls = request.getfixturevalue("tmp_sqlite_urls" if backend == "sqlite" else "pg_databases")(4)
    cluster = make_cluster(dict(zip(["c", *SERVERS], urls)), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        journal = Journal(store)

        def held_by(pid: int, host: str, beat_age: float, move_id: str) -> None:
            with hold(journal, move_id):
                pass  # creates the table; the released row keeps only its epoch
            with store.transaction(journal.server) as conn:
                beat = func.current_timestamp() if beat_age == 0 else _ago(conn, beat_age)
                assert conn.execute(update(move_leases).where(move_leases.c.move_id == move_id).values(
                    pid=pid, host=host, token=f"t{move_id}", since=beat, beat_at=beat)).rowcount == 1

        cases = [
            ("other host, fresh beat", 4242, "elsewhere.example", 0, True),
            ("other host, stale beat", 4242, "elsewhere.example", lease_stale() + 30, False),
            ("this host, pid gone, fresh beat", _dead_pid(), socket.gethostname(), 0, False),
            ("this host, pid alive, stale beat", os.getppid(), socket.gethostname(), lease_stale() + 30, True),
        ]
        for i, (what, pid, host, age, refused) in enumerate(cases):
            move_id = f"move-lease-{i}"
            held_by(pid, host, age, move_id)
            if refused:
                with pytest.raises(MoveLeaseHeldError, match=f"held by pid {pid} on host {host} since"):
                    with hold(journal, move_id):
                        pass
                continue
            with hold(journal, move_id):
                now = holder_of(journal, move_id)
                assert now is not None and now.mine, what
            assert holder_of(journal, move_id) is None, what


def _ago(conn: object, seconds: float) -> object:
    """A timestamp ``seconds`` before the server's now, in the column's own type."""
    from datetime import timedelta

    now = conn.execute(func.current_timestamp().select()).scalar_one()  # type: ignore[attr-defined]
    return now - timedelta(seconds=seconds)


def test_a_taken_over_driver_notices_it_lost_its_lease(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    """The heartbeat finds its row rewritten by another driver and stops its own driver at the next check."""
    from mdb.errors import ReshardStoppedError
    from mdb.moves import lease as lease_mod

    cluster = make_cluster(dict(zip(["c", *SERVERS], tmp_sqlite_urls(4))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        journal = Journal(store)
        with hold(journal, "reshard-lost") as mine:
            with store.transaction(journal.server) as conn:
                conn.execute(update(move_leases).where(move_leases.c.move_id == "reshard-lost").values(host="elsewhere.example", token="theirs"))
            lease_mod.Lease._beat_once(mine)
            with pytest.raises(ReshardStoppedError, match="taken over"):
                mine.check()


@pytest.mark.parametrize("variable", ["MDB_LEASE_BEAT_SECONDS", "MDB_LEASE_STALE_SECONDS"])
def test_a_bad_lease_setting_is_refused_before_the_lease_is_taken(
    variable: str, tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings are read when used; a bad one fails the driver's start, naming the variable,
    not its heartbeat thread later (which would let the lease go stale under a running driver)."""
    from mdb.errors import MdbError

    cluster = make_cluster(dict(zip(["c", *SERVERS], tmp_sqlite_urls(4))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        journal = Journal(store)
        monkeypatch.setenv(variable, "soon")
        with pytest.raises(MdbError, match=f"{variable}='soon' is not a number of seconds"):
            with hold(journal, "move-badly-set"):
                pass
        monkeypatch.delenv(variable)
        assert holder_of(journal, "move-badly-set") is None
        with hold(journal, "move-badly-set") as lease:
            assert lease.beat == 5.0 and holder_of(journal, "move-badly-set") is not None
