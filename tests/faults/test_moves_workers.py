"""A reshard as a job any number of workers run (issue 32), on real PostgreSQL.

``mdb reshard --parallel 0`` only drives the job's phases; ``mdb worker`` processes claim its
work items. Workers are SIGKILLed at random batch steps while a writer thread and a writer
process routing by a stale map keep writing; every process is killed at once and new workers
finish the job on their own; a worker SIGSTOPped past its lease on one "host" is taken over by
a worker on another, whose claim fences the first one's writes. The oracle (every acknowledged
write once, on its routed shard, nowhere else) is test_reshard_batches's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from support.moves import FAST_LEASE, Cluster, process_state, run_cli
from support.reshard import BATCH_POINTS, Writers, _batches, _check_placement, _check_writes, _wait_stopped, cluster, writers  # noqa: F401
from support.workers import no_process_left, spawn, stop as _stop  # noqa: F401

from mdb.moves.journal import Journal

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

SMALL_ITEMS = {"MDB_ITEM_BRIEFCASES": "3"}
"""About 26 briefcases move per reshard here: cut into many items, so several workers share a pass."""
STOPPED = (0, 130, 143, -signal.SIGTERM)
"""How a worker ends on SIGTERM: 143 (or 130) once the CLI handles it; -15 when it came while the process was still starting."""
KILL_POINTS = [p for p in BATCH_POINTS if p not in ("batch.resume.after_discard", "batch.after_resync")]


@pytest.fixture(autouse=True)
def _no_process_left(no_process_left: None) -> Iterator[None]:  # noqa: F811
    """A failed test leaves no worker running (it would go on working on the next test's databases' jobs)."""
    yield


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return spawn(args, {**SMALL_ITEMS, **env})


def _worker(cluster: Cluster, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return _spawn(["worker", str(cluster.path)], env or {})


def _unfinished_reshards(cluster: Cluster) -> list[str]:
    with cluster.store() as store:
        return [e.move_id for e in Journal(store).entries(unfinished=True) if e.kind == "reshard"]


def _shards(cluster: Cluster) -> list[str]:
    with cluster.store() as store:
        store.refresh()
        return [list(p[2]) for p in store.router.partitions("user")][0]


@pytest.mark.timeout(1500)
def test_workers_sigkilled_at_random_steps_and_all_at_once_lose_nothing(cluster: Cluster, writers: Writers) -> None:  # noqa: F811
    seed = int(os.environ.get("MDB_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    writers.wait_for(20)
    lists = [["u1", "u2", "x"], ["u1", "u2"]]
    killed = 0
    for round_no in range(4):
        shards = lists[round_no % 2]
        doomed = rng.randrange(3)
        point, skip = rng.choice(KILL_POINTS), rng.randrange(3)
        pool = [_worker(cluster, {"MDB_FAULT_POINT": point, "MDB_FAULT_SKIP": str(skip)} if k == doomed else None) for k in range(3)]
        driver = _spawn(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", ",".join(shards),
                         "--parallel", "0"], {})
        deadline = time.monotonic() + 400
        replaced: list[subprocess.Popen[str]] = []
        while driver.poll() is None:
            assert time.monotonic() < deadline, f"seed {seed} round {round_no}: the reshard did not finish"
            for k, p in enumerate(pool):
                if p.poll() is not None:  # SIGKILLed at its fault point: a new worker takes its place
                    assert p.returncode == -signal.SIGKILL, (seed, point, p.returncode, p.communicate())
                    killed += 1
                    replaced.append(p)
                    pool[k] = _worker(cluster)
            time.sleep(0.1)
        out, err = driver.communicate()
        assert driver.returncode == 0, (seed, round_no, point, out, err)
        stopped = _stop(pool)
        assert all(rc in STOPPED for rc, _ in stopped), (seed, [(rc, out[-2000:]) for rc, out in stopped if rc not in STOPPED])
        assert _shards(cluster) == shards, (seed, round_no)
        _check_placement(cluster)
        writers.wait_for(10)
    assert killed >= 1, f"seed {seed}: no worker reached its fault point in four reshards"

    # Every process killed at once in the middle of a reshard; workers started afterwards finish it on their own.
    shards = lists[0] if _shards(cluster) == lists[1] else lists[1]
    slow = {"MDB_FAULT_ACTION": "sleep:3", "MDB_FAULT_POINT": "batch.after_precopy"}  # every batch: time to kill them mid-job
    pool = [_worker(cluster, slow) for _ in range(3)]
    driver = _spawn(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", ",".join(shards), "--parallel", "1"], slow)
    done_before = sum(status == "done" for status, _ in _batches(cluster))  # batches of the earlier reshards
    deadline = time.monotonic() + 300
    while sum(status == "done" for status, _ in _batches(cluster)) <= done_before:
        assert driver.poll() is None and time.monotonic() < deadline, (seed, driver.communicate() if driver.poll() is not None else "")
        time.sleep(0.05)
    for p in [driver, *pool]:
        p.kill()
        p.wait()
    assert _unfinished_reshards(cluster), "the reshard finished before every process was killed: nothing was tested"
    writers.wait_for(10)
    fresh = [_worker(cluster) for _ in range(3)]
    deadline = time.monotonic() + 400
    while _unfinished_reshards(cluster):
        assert time.monotonic() < deadline, f"seed {seed}: new workers did not finish the interrupted reshard"
        assert all(p.poll() is None for p in fresh), [p.communicate() for p in fresh if p.poll() is not None]
        time.sleep(0.2)
    stopped = _stop(fresh)
    assert any("driving reshard" in out for _, out in stopped), stopped  # the job's phases, taken up by a worker
    assert _shards(cluster) == shards
    writers.wait_for(20)
    assert writers.stop() > 0, "the stale writer process acknowledged nothing"
    _check_writes(cluster, writers.acked)


@pytest.mark.timeout(900)
def test_a_worker_on_another_host_takes_over_an_item_whose_worker_was_stopped_past_its_lease(
    cluster: Cluster, writers: Writers,  # noqa: F811
) -> None:
    writers.wait_for(20)
    # Paused with its pre-copy committed on the target, before its lock: the taker discards that copy and moves the item.
    first = _worker(cluster, {**FAST_LEASE, "MDB_HOST_NAME": "host-a", "MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_ACTION": "stop"})
    driver = _spawn(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x", "--parallel", "0"],
                    {**FAST_LEASE, "MDB_HOST_NAME": "host-c"})
    second: subprocess.Popen[str] | None = None
    try:
        _wait_stopped(first, "batch.after_precopy")
        status = run_cli(["moves", "status", str(cluster.path), "--json"])
        assert status.returncode == 0, status.stderr
        busy = json.loads(status.stdout)["workers"]
        assert [(w["holder"]["host"], w["holder"]["pid"]) for w in busy] == [("host-a", first.pid)], busy
        time.sleep(float(FAST_LEASE["MDB_LEASE_STALE_SECONDS"]) + 1)  # host-a's beat is stale now
        second = _worker(cluster, {**FAST_LEASE, "MDB_HOST_NAME": "host-b"})
        out, err = driver.communicate(timeout=400)
        assert driver.returncode == 0, (out, err)
        assert process_state(first.pid) == "T", "the stopped worker ran on"
        writers.wait_for(5)
        first.send_signal(signal.SIGCONT)
        time.sleep(3)  # it wakes, finds its write refused (or its session ended), and goes on looking for work
        (rc_first, err_first), (rc_second, err_second) = _stop([first, second])
    finally:
        for p in (first, driver, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert "took over" in err_second and "host-a" in err_second, err_second
    assert "lease epoch" in err_first or "taken over" in err_first, err_first  # its next write was refused by a server
    assert _shards(cluster) == ["u1", "u2", "x"]
    writers.wait_for(10)
    assert writers.stop() > 0
    _check_writes(cluster, writers.acked)
