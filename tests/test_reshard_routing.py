"""Issue 31: a reshard the application does not notice (docs/design.md invariants 2 and 8).

Writers (test_reshard_batches.Writers: a process routing by a frozen copy of the map, and a
thread) write and read every briefcase throughout batched reshards, one of them SIGKILLed
between a batch's commit point and its finalize and resumed. Every RetryableError that reaches
them counts as a failure here: a briefcase in the middle of a move is a wait the Store absorbs.
And a Store whose routing is arbitrarily old (made before everything) still finds every
briefcase after a hot-tenant `mdb move`, reshards and `mdb rebalance`, holding no relocation
directory and only a bounded set of learned locations.
"""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

from movehelp import Cluster, create_user, locations, run_cli
from sqlalchemy import func, select
from test_reshard_batches import SERVERS, USERS, Writers, _batches, _check_writes, cluster, writers  # noqa: F401  (fixtures)

from mdb.demo.models import Order, UserBriefcase
from mdb.gdid import GDID
from mdb.moves.reshard import reshard
from mdb.store import Store


def test_stale_and_current_routers_write_throughout_batched_reshards_and_see_no_error(
    cluster: Cluster, writers: Writers
) -> None:
    writers.wait_for(20)
    with cluster.store() as admin:
        reshard(admin, "user", GDID(0, 0, 0), ["u1", "u2", "x"], parallel=2, map_path=cluster.path)
        writers.wait_for(30)
        reshard(admin, "user", GDID(0, 0, 0), ["x", "u2"], parallel=2, map_path=cluster.path)
    writers.wait_for(30)
    assert writers.stop() > 0
    assert writers.retried == {}, f"errors reached the application: {writers.retried}"
    # the stale process met fences and followed them, and never held the relocation directory
    assert writers.steps.get("follow", 0) > 0, writers.steps
    assert "directory=False" in writers.routing, writers.routing
    _check_writes(cluster, writers.acked)  # 0 writes on a wrong shard, none lost
    assert all(status == "done" for status, _ in _batches(cluster))


def test_a_reshard_killed_between_commit_point_and_finalize_is_a_wait_not_an_error(
    cluster: Cluster, writers: Writers
) -> None:
    writers.wait_for(20)
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x", "--parallel", "2"],
                  env={"MDB_FAULT_POINT": "batch.after_commit_point"})
    assert run.returncode == -signal.SIGKILL, (run.stdout, run.stderr)
    time.sleep(1)  # the writers meet the fenced batch: its targets hold 'incoming' copies, they wait
    done = run_cli(["moves", "resume", str(cluster.path)])  # well within move_wait_seconds (30 s)
    assert done.returncode == 0, (done.stdout, done.stderr)
    writers.wait_for(40)
    assert writers.stop() > 0
    assert writers.retried == {}, f"errors reached the application: {writers.retried}"
    _check_writes(cluster, writers.acked)


def _counts(store: Store) -> dict[GDID, int]:
    """Orders per briefcase, read through ``store``'s routing (readonly sessions)."""
    out = {}
    for g in sorted(locations(store, SERVERS)):
        with store.briefcase(UserBriefcase, g, readonly=True) as s:
            out[g] = s.scalar(select(func.count()).select_from(Order)) or 0
    return out


def test_an_arbitrarily_old_router_finds_every_briefcase_after_reshards_hot_moves_and_rebalance(
    cluster: Cluster, tmp_path: Path
) -> None:
    frozen = tmp_path / "frozen-map.yaml"  # never rewritten: what the old processes started with
    shutil.copy(cluster.path, frozen)
    old_cluster = Cluster(cluster.urls, frozen, cluster.central)
    oldest = old_cluster.store()
    oldest.router  # noqa: B018  (routes with map version 1 from now on, until a shard says otherwise)
    forgetful = Store.from_yaml(frozen, types=[UserBriefcase], route_cache_size=0)  # learns nothing

    hot = USERS[0]
    moved = run_cli(["move", str(cluster.path), "user", str(hot), "--to", "x"])  # the hot-tenant exception
    assert moved.returncode == 0, moved.stderr
    with cluster.store() as fresh:
        assert fresh.router.locate("user", hot).server == "x"  # the directory names it
    for store in (oldest, forgetful):
        with store.briefcase(UserBriefcase, hot) as s:
            assert s.placement.server == "x"  # found through the fence on its default shard
    assert oldest.routes.get("user", hot) == "x" and len(forgetful.routes) == 0

    with cluster.store() as admin:
        reshard(admin, "user", GDID(0, 0, 0), ["u1", "u2", "x"], parallel=2, map_path=cluster.path)
        for i in range(12):  # a skew for rebalance: heavy briefcases on u1 (v mod 3 == 0)
            create_user(admin, GDID(0, 0, 3000 + 3 * i), orders=30, lines=1)
    applied = run_cli(["rebalance", str(cluster.path), "user", "--apply"])
    assert applied.returncode == 0, applied.stderr
    assert "applied 0 move" not in applied.stdout, applied.stdout

    with cluster.store() as fresh:
        expected = _counts(fresh)
    assert len(expected) == len(USERS) + 12
    late = old_cluster.store()  # made now from the frozen map file: version 1 too, never used before
    for store in (oldest, forgetful, late):
        assert _counts(store) == expected
        assert not store.router.directory_loaded  # routed by the map and fences alone
    assert len(forgetful.routes) == 0
    for store in (oldest, forgetful, late):
        store.close()
