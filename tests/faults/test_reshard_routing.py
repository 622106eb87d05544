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

import pytest
import shutil
import signal
import time
from pathlib import Path

from support.moves import Cluster, create_user, locations, run_cli
from sqlalchemy import func, select
from support.reshard import SERVERS, USERS, Writers, _batches, _check_writes, cluster, writers  # noqa: F401  (fixtures)

from mdb.demo.models import Order, User, UserBriefcase
from mdb.gdid import GDID
from mdb.moves import move_briefcase
from mdb.moves.reshard import reshard
from mdb.relocations import load_relocation_reach, load_relocations, set_relocations
from mdb.router import Reach, reach_of
from mdb.store import Store

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)


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


def test_a_readonly_session_reads_the_briefcase_its_check_found_though_a_move_commits_in_between(cluster: Cluster) -> None:
    """The check of a readonly session holds no lock, so a move may commit (fence, source rows
    deleted) between it and the session's reads. On PostgreSQL the session is one snapshot, taken
    by the check: the reads see the briefcase as the check found it, never an empty one (under
    READ COMMITTED they saw none: bench.py reshard_impact met it)."""
    g = USERS[0]
    with cluster.store() as store:
        source = store.router.default_placement("user", g).server
        target = next(s for s in SERVERS if s != source)
        with store.briefcase(UserBriefcase, g, readonly=True) as s:
            assert s.placement.server == source  # checked: the shard owns it
            move_briefcase(store, "user", g, target)  # commits on other connections meanwhile
            with store.transaction(source) as conn:
                assert conn.scalar(select(func.count()).select_from(User).where(User.user_id == g)) == 0
            assert s.scalar(select(func.count()).select_from(Order)) == 1  # the snapshot of the check
            assert s.scalar(select(User.name).where(User.user_id == g)) == f"user {g.counter}"
        with store.briefcase(UserBriefcase, g, readonly=True) as s:  # the next session follows the fence
            assert s.placement.server == target
            assert s.scalar(select(func.count()).select_from(Order)) == 1


def test_a_hot_tenant_moved_off_the_layout_is_folded_by_a_later_reshard_and_routed_by_every_process(
    cluster: Cluster, tmp_path: Path
) -> None:
    """docs/moves.md: a reshard plans every briefcase of the partition where it lives, relocation
    targets included, and puts each on its shard under the new list; the hot tenant's own
    relocation is then cleared like the reshard's. Before that, `mdb move` to a chosen server
    is routed by a process that never reads the directory; after it, moved apart again, too."""
    frozen = tmp_path / "frozen-map.yaml"
    shutil.copy(cluster.path, frozen)
    stale = Cluster(cluster.urls, frozen, cluster.central).store()
    hot = next(g for g in USERS if g.sharding_value % 3 != 2)  # its shard under [u1, u2, x] is not x
    moved = run_cli(["move", str(cluster.path), "user", str(hot), "--to", "x"])
    assert moved.returncode == 0, moved.stderr
    with stale.briefcase(UserBriefcase, hot) as s:
        assert s.placement.server == "x"  # routed by the fence on u1/u2, without the directory
    with cluster.store() as admin:
        reshard(admin, "user", GDID(0, 0, 0), ["u1", "u2", "x"], parallel=2, map_path=cluster.path)
    with cluster.store() as fresh:
        assert ("user", hot) not in fresh.router.relocations  # folded: its default shard holds it
        home = fresh.router.default_placement("user", hot).server
        assert home != "x" and locations(fresh, SERVERS)[hot] == [home]
    for store in (stale, Cluster(cluster.urls, frozen, cluster.central).store()):
        with store.briefcase(UserBriefcase, hot, readonly=True) as s:
            assert s.placement.server == home and s.scalar(select(func.count()).select_from(Order)) == 1
        assert not store.router.directory_loaded
    # docs/moves.md: "to keep it apart, `mdb move` it again after the reshard" - and every process follows
    again = run_cli(["move", str(cluster.path), "user", str(hot), "--to", "x"])
    assert again.returncode == 0, again.stderr
    with cluster.store() as fresh:
        assert fresh.router.locate("user", hot).server == "x" and locations(fresh, SERVERS)[hot] == ["x"]
    for store in (stale, Cluster(cluster.urls, frozen, cluster.central).store()):
        with store.briefcase(UserBriefcase, hot) as s:  # a write, from a map two versions old
            assert s.placement.server == "x" and s.scalar(select(func.count()).select_from(Order)) == 1
        assert not store.router.directory_loaded
        store.close()


def test_the_directory_summary_on_postgresql_is_one_aggregate_exact_by_sharding_value(cluster: Cluster) -> None:
    """What fan-out and the fleet tools read instead of the entries (PostgreSQL: MIN/MAX over hex
    text per authority, since the bytes sort authority before counter)."""
    entries = {GDID(0, 15, 5): "x", GDID(0, 0, 7): "x", GDID(0, 3, 100): "x", GDID(2, 1, 3): "u1"}
    with cluster.store() as store:
        set_relocations(store, "user", entries)
        reach = load_relocation_reach(store)
        assert reach == {("user", "x"): Reach(3, 5, 100), ("user", "u1"): Reach(1, *[GDID(2, 1, 3).sharding_value] * 2)}
        assert reach == reach_of(load_relocations(store))
        set_relocations(store, "user", dict.fromkeys(entries))
