"""A lease is not a fence (DESIGN.md invariant 7): a driver paused past its lease writes nothing.

The end-to-end case is issue 28's: a real ``mdb reshard`` (host "host-a") stops itself with
SIGSTOP at each step of a batch in turn, ``mdb moves resume`` on "host-b" takes its lease over
once the beat is stale and finishes the reshard, then the first driver gets SIGCONT. Before
fencing, the first driver's commit point landed after the second had discarded its copy and
the batch's briefcases had no row anywhere. Now its first write after waking is refused by the
servers, it exits naming its lost lease, and every acknowledged write of the writers (a thread
here and a process routing by a stale map) is present exactly once on its routed server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import forkserver
from support.moves import FAST_LEASE, ROOT, Cluster, locations, make_cluster, run_cli, snapshot
from sqlalchemy import event, select, text
from support.reshard import BATCH_POINTS, SERVERS, Writers, _check_placement, _check_writes, cluster, writers  # noqa: F401 (fixtures: cluster, writers)

from mdb.errors import LeaseLostError
from mdb.moves import fencing
from mdb.moves.journal import Journal, move_leases
from mdb.moves.lease import hold
from support.reshard import _wait_stopped

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

HOLDS_A_TRANSACTION = {"batch.after_lock", "batch.after_source_cut", "batch.after_verify", "batch.before_commit_point"}
"""Points inside the batch's locked source transaction (which holds the lease's fence row shared)."""


@pytest.mark.timeout(900)
def test_a_driver_paused_past_its_lease_at_each_batch_step_writes_nothing_after_a_takeover(
    cluster: Cluster, writers: Writers,  # noqa: F811
) -> None:
    writers.wait_for(20)
    lists = [["u1", "u2", "x"], ["u1", "u2"]]
    # after_resync is reached only when a briefcase changed between a batch's pre-copy and its lock.
    points = [p for p in BATCH_POINTS if p not in ("batch.resume.after_discard", "batch.after_resync")]
    for i, point in enumerate(points):
        shards = ",".join(lists[i % 2])
        env = {**os.environ, **FAST_LEASE, "PYTHONPATH": str(ROOT), "MDB_HOST_NAME": "host-a",
               "MDB_FAULT_POINT": point, "MDB_FAULT_ACTION": "stop"}
        first = forkserver.popen(
            [sys.executable, "-c", "from mdb.cli import main; main()", "reshard", str(cluster.path), "user",
             "--partition", "0:0:0", "--shards", shards],
            cwd=str(ROOT), env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            _wait_stopped(first, point)
            time.sleep(float(FAST_LEASE["MDB_LEASE_STALE_SECONDS"]) + 1)  # its beat is stale now: host-b may take over
            second = run_cli(["moves", "resume", str(cluster.path)], env={**FAST_LEASE, "MDB_HOST_NAME": "host-b"}, timeout=300)
            assert second.returncode == 0, (point, second.stdout, second.stderr)
            assert "took over" in second.stderr and "host-a" in second.stderr, (point, second.stderr)
            if point in HOLDS_A_TRANSACTION:  # paused inside its source transaction: the claim ended that session
                assert "ending session" in second.stderr, (point, second.stderr)
            writers.wait_for(5)
            first.send_signal(signal.SIGCONT)
            out, err = first.communicate(timeout=300)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        # The woken driver's next write was refused by a server (or its beat found the lease gone first,
        # or its source session had been ended by the claim).
        assert first.returncode != 0, (point, out, err)
        if point not in HOLDS_A_TRANSACTION:
            assert "lease" in err and ("epoch" in err or "taken over" in err), (point, err)
        _check_placement(cluster)
        with cluster.store() as store:
            store.refresh()
            assert [",".join(p[2]) for p in store.router.partitions("user")] == [shards], point
        writers.wait_for(5)
    writers.stop()
    _check_writes(cluster, writers.acked)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_newer_epoch_refuses_the_older_drivers_writes_on_every_server(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    urls = request.getfixturevalue("tmp_sqlite_urls" if backend == "sqlite" else "pg_databases")(4)
    cluster = make_cluster(dict(zip(["c", *SERVERS], urls)), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        journal = Journal(store)
        with hold(journal, "reshard-fence-test") as lease:
            assert lease.epoch == 1
            old = lease.fenced(store, ["c", "u1"])  # u2 and x: claimed on first use
        for server in ["c", "u1", "u2", "x"]:
            with old.transaction(server) as conn:
                conn.execute(text("SELECT 1"))
        with store.transaction(journal.server) as conn:  # released: the row keeps its epoch
            row = conn.execute(select(move_leases).where(move_leases.c.move_id == "reshard-fence-test")).mappings().one()
        assert row["pid"] is None and row["epoch"] == 1
        with hold(journal, "reshard-fence-test") as lease:
            assert lease.epoch == 2
            new = lease.fenced(store, ["c", "u1", "u2"])
            for server in ["c", "u1", "u2"]:
                with pytest.raises(LeaseLostError, match=f"server '{server}' has seen lease epoch 2, this driver holds epoch 1"):
                    with old.transaction(server) as conn:
                        raise AssertionError("the old driver's transaction must not get this far")
            with new.transaction("x") as conn:  # first use by the new holder: claimed there, in its transaction
                conn.execute(text("SELECT 1"))
            with pytest.raises(LeaseLostError):
                with old.transaction("x"):
                    pass
            conn = old.connect("u1")  # a transaction the caller begins itself checks through fence_check
            try:
                conn.begin()
                with pytest.raises(LeaseLostError):
                    fencing.fence_check(old, conn, "u1")
            finally:
                conn.rollback()
                conn.close()
            sent: list[str] = []

            def record(_conn: object, _cursor: object, statement: str, *_: object) -> None:
                sent.append(statement)

            event.listen(store.engine("u1"), "before_cursor_execute", record)
            try:
                with new.transaction("u1") as conn:  # the check's read travels with BEGIN (FenceCheck): no statement of its own
                    conn.execute(text("SELECT 1"))
            finally:
                event.remove(store.engine("u1"), "before_cursor_execute", record)
            assert sent == ["SELECT 1"]
            # A move run under its own lease inside a fenced driver: both leases are checked in its transactions.
            fencing.claim(store, ["u1"], "move-inside", 1)
            with fencing.FencedCluster(new, "move-inside", 1).transaction("u1") as conn:
                conn.execute(text("SELECT 1"))
            with pytest.raises(LeaseLostError, match="reshard-fence-test: server 'u1' has seen lease epoch 2"):
                with fencing.FencedCluster(old, "move-inside", 1).transaction("u1"):
                    pass
            fencing.claim(store, ["u1"], "move-inside", 2)
            with pytest.raises(LeaseLostError, match="move-inside: server 'u1' has seen lease epoch 2"):
                with fencing.FencedCluster(new, "move-inside", 1).transaction("u1"):
                    pass


def test_a_claim_waits_for_the_old_drivers_checked_transaction_and_refuses_it_afterwards(
    pg_databases: Callable[[int], list[str]], tmp_path: Path,
) -> None:
    """PostgreSQL: once a claim returns, no transaction of the old epoch can commit on that server."""
    cluster = make_cluster(dict(zip(["c", *SERVERS], pg_databases(4))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        fencing.claim(store, ["u1"], "reshard-race", 1)
        old = fencing.FencedCluster(store, "reshard-race", 1)
        in_old = threading.Event()
        release_old = threading.Event()
        order: list[str] = []

        def old_driver() -> None:
            with old.transaction("u1") as conn:  # passes its check, then holds the fence row FOR SHARE
                in_old.set()
                release_old.wait(30)
                conn.execute(text("CREATE TABLE old_driver_wrote (x int)"))
            order.append("old committed")

        thread = threading.Thread(target=old_driver)
        thread.start()
        assert in_old.wait(30)
        committed_when_claimed: list[bool] = []

        def claimer_run() -> None:
            fencing.claim(store, ["u1"], "reshard-race", 2)
            # The moment the claim returned, asked of the server (not by which thread appends first:
            # the old driver's commit lets the claim go before that thread is scheduled again).
            with store.transaction("u1") as conn:
                committed_when_claimed.append(bool(conn.execute(text("SELECT to_regclass('old_driver_wrote') IS NOT NULL")).scalar()))

        claimer = threading.Thread(target=claimer_run)
        claimer.start()
        time.sleep(0.5)
        assert committed_when_claimed == [] and claimer.is_alive(), "the claim returned while the old driver's checked transaction was open"
        release_old.set()
        thread.join(30)
        claimer.join(30)
        assert not thread.is_alive() and not claimer.is_alive()
        assert order == ["old committed"] and committed_when_claimed == [True]
        with pytest.raises(LeaseLostError):
            with old.transaction("u1"):
                pass


@pytest.mark.parametrize("point", ["batch.after_precopy", "batch.before_commit_point", "batch.after_commit_point"])
def test_a_single_move_paused_past_its_lease_writes_nothing_after_a_takeover(point: str, cluster: Cluster) -> None:  # noqa: F811
    """``mdb move`` drives its own lease: paused before, at and after its commit point while another host resumes it."""
    from mdb.gdid import GDID

    with cluster.store() as store:
        g = GDID(0, 0, 3)
        source = store.router.locate("user", g).server
        target = "x"
        before = snapshot(store, SERVERS)
    env = {**os.environ, **FAST_LEASE, "PYTHONPATH": str(ROOT), "MDB_HOST_NAME": "host-a",
           "MDB_FAULT_POINT": point, "MDB_FAULT_ACTION": "stop"}
    first = forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", "move", str(cluster.path), "user", str(g),
                              "--to", target], cwd=str(ROOT), env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_stopped(first, point)
        time.sleep(float(FAST_LEASE["MDB_LEASE_STALE_SECONDS"]) + 1)
        second = run_cli(["moves", "resume", str(cluster.path)], env={**FAST_LEASE, "MDB_HOST_NAME": "host-b"}, timeout=300)
        assert second.returncode == 0 and "took over" in second.stderr, (point, second.stdout, second.stderr)
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode != 0, (point, out, err)
    with cluster.store() as store:
        store.refresh()
        assert snapshot(store, SERVERS) == before, f"{point}: rows lost or doubled"
        where = locations(store, SERVERS)[g]
        assert where == [target if point == "batch.after_commit_point" else source], (point, where)
        assert store.router.locate("user", g).server == where[0]
        assert Journal(store).entries(unfinished=True) == []


def test_a_take_ends_the_session_of_a_driver_paused_inside_its_heartbeat(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """SIGSTOP can land between a beat's UPDATE and its COMMIT: the lease row stays locked. A take waits
    the grace, then ends that session instead of waiting forever (seen once in the paused-driver test)."""
    from sqlalchemy import func, update
    from sqlalchemy.exc import DBAPIError

    cluster = make_cluster(dict(zip(["c", *SERVERS], pg_databases(4))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        journal = Journal(store)
        with hold(journal, "reshard-paused-beat"):
            pass
        paused = store.connect(journal.server)
        try:
            paused.begin()
            paused.execute(update(move_leases).where(move_leases.c.move_id == "reshard-paused-beat")
                           .values(beat_at=func.current_timestamp()))  # ... and then the process stops
            started = time.monotonic()
            with hold(journal, "reshard-paused-beat") as lease:
                assert lease.epoch == 2
            assert time.monotonic() - started >= fencing.CLAIM_GRACE
            with pytest.raises(DBAPIError, match="terminat"):  # its session was ended: the paused driver's beat cannot commit
                paused.execute(text("SELECT 1"))
        finally:
            paused.close()
