"""Batched cutovers (mdb.moves.batch) under a reshard: crashes inside a batch, writers, stale routers.

Writers in a separate process (routing with its own copy of the map, never told to refresh)
and in a thread of this process add transactions to every briefcase the whole time; a write
counts only when its commit returned. The reshard runs as the real CLI, killed with SIGKILL at
each point of a batch, then ``mdb moves resume`` finishes it. Afterwards every acknowledged
write is present exactly once, on the one server that holds its briefcase, which is where a
fresh Store routes it; no briefcase has rows anywhere else; the journal has nothing unfinished.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import sys

import pytest
from support import forkserver
from support.moves import ROOT, Cluster, locations, run_cli, snapshot

from mdb import faults
from mdb.gdid import GDID
from mdb.moves import verify
from mdb.moves.batch import BATCH_KIND, SingleMove
from mdb.moves.journal import Journal
from mdb.moves.move import MoveResult
from mdb.moves.reshard import BatchSizer, reshard
from support.reshard import BATCH_POINTS, SERVERS, USERS, Writers, _batches, _check_placement, _check_writes, cluster, writers  # noqa: F401 (fixtures: cluster, writers)

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)



def test_sigkill_inside_a_batch_with_writers_then_resume(cluster: Cluster, writers: Writers) -> None:
    writers.wait_for(20)
    lists = [["u1", "u2", "x"], ["u1", "u2"]]
    # after_resync is reached only when a briefcase was written between the pre-copy and the lock:
    # test_sigkill_while_a_batch_copies_again_what_was_written_since_its_precopy makes that happen.
    cases = [(p, {}) for p in BATCH_POINTS if p not in ("batch.resume.after_discard", "batch.after_resync")]
    cases += [("batch.after_precopy", {"MDB_FAULT_SKIP": "1"}), ("batch.after_commit_point", {"MDB_FAULT_SKIP": "1"})]
    sizes: list[int] = []  # briefcases in the batch each kill cut
    for i, (point, env) in enumerate(cases):
        shards = lists[i % 2]
        run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", ",".join(shards)],
                      env={"MDB_FAULT_POINT": point, **env})
        assert run.returncode == -signal.SIGKILL, f"{point}: {run.returncode} {run.stdout} {run.stderr}"
        with cluster.store() as store:
            journal = Journal(store)
            cut = [e for e in journal.entries(unfinished=True) if e.kind == BATCH_KIND]
            (resharding,) = [e for e in journal.entries(unfinished=True) if e.kind == "reshard"]
            earlier = [(e.kind, e.status, len(e.briefcases), e.detail) for e in journal.moves_of(resharding.move_id)]
        assert len(cut) == 1, (point, cut, earlier)
        sizes.append(len(cut[0].briefcases))
        writers.wait_for(10)  # the application writes while the reshard lies interrupted
        done = run_cli(["moves", "resume", str(cluster.path)])
        assert done.returncode == 0, (point, done.stdout, done.stderr)
        _check_placement(cluster)
        with cluster.store() as store:
            store.refresh()
            assert [list(p[2]) for p in store.router.partitions("user")] == [shards], point
        writers.wait_for(10)
    # Batches start at 8 briefcases; one the writers' locks made the reshard split can be smaller.
    assert sum(n > 1 for n in sizes) >= len(sizes) - 2, sizes
    # Resume itself killed while it discards a batch's copies, then resumed again.
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", ",".join(lists[len(cases) % 2])],
                  env={"MDB_FAULT_POINT": "batch.after_source_cut"})
    assert run.returncode == -signal.SIGKILL, run.stderr
    crashed = run_cli(["moves", "resume", str(cluster.path)], env={"MDB_FAULT_POINT": "batch.resume.after_discard"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    done = run_cli(["moves", "resume", str(cluster.path)])
    assert done.returncode == 0, done.stderr
    writers.wait_for(20)
    from_process = writers.stop()
    assert from_process > 0, "the stale writer process acknowledged nothing"
    _check_writes(cluster, writers.acked)
    batches = _batches(cluster)
    assert any(status == "done" and n > 1 for status, n in batches), batches
    assert any(status == "rolled back" for status, _ in batches), batches


RESYNC = r"""
import statistics
import sys
sys.path.insert(0, "tests")
from support.moves import add_transaction
from mdb import faults
from mdb.demo.models import UserBriefcase
from mdb.gdid import GDID
from mdb.moves.reshard import reshard
from mdb.store import Store
path, shards, users = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
with Store.from_yaml(path, types=[UserBriefcase]) as writer, Store.from_yaml(path, types=[UserBriefcase]) as admin:
    def write_every_briefcase(point):
        # Between the first batch's pre-copy and its lock: the briefcases of that batch change
        # on their source, so the cutover finds other sums there and copies them again.
        if point == "batch.after_precopy" and not faults.hook.done:
            faults.hook.done = True
            for n in range(1, users + 1):
                add_transaction(writer, GDID(0, 0, n), 7_000_000 + n, n)
                print(f"{GDID(0, 0, n)} {7_000_000 + n}", flush=True)
    write_every_briefcase.done = False
    faults.hook = write_every_briefcase
    reshard(admin, "user", GDID(0, 0, 0), shards, map_path=path)
"""


def test_sigkill_while_a_batch_copies_again_what_was_written_since_its_precopy(cluster: Cluster, writers: Writers) -> None:
    """Killed after the re-sync committed its second copy on the target, before the source's commit
    point: resume discards that copy (no fence on the source), and the reshard finishes with every write."""
    writers.wait_for(10)
    run = forkserver.run(
        [sys.executable, "-c", RESYNC, str(cluster.path), "u1,u2,x", str(len(USERS))], cwd=str(ROOT),
        env={**os.environ, "MDB_FAULT_POINT": "batch.after_resync"}, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == -signal.SIGKILL, (run.stdout, run.stderr)
    written = [(GDID.parse(g), int(tid)) for g, tid in (line.split() for line in run.stdout.splitlines())]
    assert len(written) == len(USERS)
    with cluster.store() as store:
        (cut,) = [e for e in Journal(store).entries(unfinished=True) if e.kind == BATCH_KIND]
    done = run_cli(["moves", "resume", str(cluster.path)])
    assert done.returncode == 0, (done.stdout, done.stderr)
    with cluster.store() as store:
        resolved = Journal(store).get(cut.move_id)
        assert resolved is not None and resolved.status == "rolled back", resolved
        store.refresh()
        assert [list(p[2]) for p in store.router.partitions("user")] == [["u1", "u2", "x"]]
    writers.wait_for(10)
    writers.stop()
    _check_writes(cluster, [*writers.acked, *written])


def test_a_stale_router_writes_during_a_batched_reshard_and_lands_nowhere_wrong(cluster: Cluster, writers: Writers) -> None:
    """The writer process routes by the map version it started with and never refreshes by itself."""
    writers.wait_for(20)
    with cluster.store() as admin:
        outcome = reshard(admin, "user", GDID(0, 0, 0), ["u1", "u2", "x"], parallel=2, map_path=cluster.path)
        assert outcome.map_version is not None and outcome.map_version > writers.stale_version
        writers.wait_for(30)
        outcome = reshard(admin, "user", GDID(0, 0, 0), ["x", "u2"], parallel=2, map_path=cluster.path)
    writers.wait_for(30)
    from_process = writers.stop()
    assert from_process > 0
    _check_writes(cluster, writers.acked)
    batches = _batches(cluster)
    assert batches and all(status == "done" for status, _ in batches) and max(n for _, n in batches) > 1, batches


def test_a_batch_that_fails_verification_is_rolled_back_and_its_briefcases_move_singly(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wrong checksum for one briefcase on the target: the batch rolls back, that one moves on its own
    (a batch of one, whose sums are left alone: the spoiled sum stands for a batch-only fault)."""
    real = verify.batch_sums
    spoiled: list[GDID] = []

    def spoil_target(conn, tables, gdids, method, **kw):  # type: ignore[no-untyped-def]
        """A copy of several briefcases that comes out wrong on x every time for one of them (the re-sync cannot mend it)."""
        sums = real(conn, tables, gdids, method, **kw)
        if conn.engine.url.database == cluster.urls["x"].rsplit("/", 1)[-1] and not alone:
            if not spoiled:
                spoiled.append(next(k for k in sums if k[0] == "users")[1])
            key = ("users", spoiled[0])
            if key in sums:
                sums[key] = verify.TableSum(sums[key].rows, "0" * 32)
        return sums

    alone: list[bool] = []  # while a briefcase moves on its own (a batch of one): its sums are left alone
    real_single = SingleMove.run

    def single(self: SingleMove) -> MoveResult:
        alone.append(True)
        try:
            return real_single(self)
        finally:
            alone.pop()

    monkeypatch.setattr(verify, "batch_sums", spoil_target)
    monkeypatch.setattr(SingleMove, "run", single)
    with cluster.store() as admin:
        outcome = reshard(admin, "user", GDID(0, 0, 0), ["u1", "u2", "x"], map_path=cluster.path)
        assert outcome.moved == len(outcome.plan.moves)
        journal = Journal(admin)
        entries = journal.moves_of(outcome.reshard_id or "")
    assert spoiled, "no batch into x was verified"
    aborted = [e for e in entries if e.kind == BATCH_KIND and e.status == "aborted"]
    assert len(aborted) == 1 and "differ" in (aborted[0].detail or ""), [(e.kind, e.status, e.detail) for e in entries]
    assert any(e.kind == BATCH_KIND and e.briefcases == [spoiled[0]] and e.status == "done" for e in entries)
    _check_placement(cluster)


def test_the_batch_size_follows_the_measured_pause() -> None:
    fixed, per = 0.010, 0.0005  # 10 ms of round trips, 0.5 ms a briefcase: 60 fit in 40 ms
    sizer = BatchSizer(0.040, start=8, largest=500)
    sizes = []
    for _ in range(20):
        n = sizer.next()
        sizes.append(n)
        sizer.observed(n, fixed + per * n)
    assert sizes[:2] == [8, 16], sizes
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:])), sizes  # at most doubling
    assert max(sizes) <= 60, sizes  # never more than fits
    assert 55 <= sizer.next() <= 60, sizes  # and close to it within a few batches
    assert sizer.fit() == pytest.approx((fixed, per))
    before = sizer.next()
    sizer.aborted()
    assert sizer.next() == before // 2
    slow = BatchSizer(0.040, start=8, largest=500, smallest=2)
    for _ in range(6):
        slow.observed(slow.next(), 0.050 + 0.001 * slow.next())  # the fixed part alone is over the target
    assert slow.next() == 2
    fast = BatchSizer(0.040, start=8, largest=500)
    for _ in range(12):
        fast.observed(fast.next(), 1e-6 * fast.next())
    assert fast.next() == 500


@pytest.mark.parametrize("seed", range(5))
def test_noisy_pauses_never_make_a_batch_several_times_the_size_that_fits(seed: int) -> None:
    """Batches of one size with pauses +-25% around the line: the size stays near what fits.

    A least-squares fit alone over such batches finds a slope near zero now and then and
    doubled the size twice (measured in a parallel reshard: batches of 164 and 328 among 80).
    """
    rng = random.Random(seed)
    fixed, per = 0.010, 0.0005  # 60 fit in 40 ms
    sizer = BatchSizer(0.040, start=8, largest=500)
    sizes = []
    for _ in range(400):
        n = sizer.next()
        sizes.append(n)
        sizer.observed(n, (fixed + per * n) * rng.uniform(0.75, 1.25))
    assert max(sizes[20:]) <= 84, sorted(sizes)[-10:]  # 60 / 0.75 at the very worst: four lucky batches in a row
    assert statistics.median(sizes[20:]) >= 45, statistics.median(sizes[20:])


def test_every_batch_fault_point_is_listed_here() -> None:
    assert {p for p in faults.points() if p.startswith("batch.")} == set(BATCH_POINTS)


@pytest.mark.parametrize("mode", ["--move-back", "--leave"])
def test_cancel_of_a_reshard_killed_inside_a_batch(cluster: Cluster, mode: str) -> None:
    """Killed with one batch finished and the next copied: cancel rolls the copied one back and
    moves the finished batch's briefcases back one by one (or leaves them as relocations)."""
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
        homes = {g: s[0] for g, s in locations(store, SERVERS).items()}
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x"],
                  env={"MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_SKIP": "1"})
    assert run.returncode == -signal.SIGKILL, run.stderr
    with cluster.store() as store:
        journal = Journal(store)
        (reshard_entry,) = [e for e in journal.entries(unfinished=True) if e.kind == "reshard"]
        finished = [g for e in journal.moves_of(reshard_entry.move_id) if e.status == "done" for g in e.briefcases]
    assert len(finished) > 1, "the first batch did not finish before the kill"
    done = run_cli(["moves", "cancel", str(cluster.path), reshard_entry.move_id, mode])
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert f"1 interrupted move(s) rolled back, {len(finished)} finished" in done.stdout, done.stdout
    with cluster.store() as store:
        store.refresh()
        assert snapshot(store, SERVERS) == before, "rows differ from the snapshot taken before the reshard"
        assert [list(p[2]) for p in store.router.partitions("user")] == [["u1", "u2"]]
        now = {g: s[0] for g, s in locations(store, SERVERS).items()}
        assert Journal(store).entries(unfinished=True) == []
        if mode == "--move-back":
            assert now == homes and not store.router.relocations
        else:
            assert {g for g in now if now[g] != homes[g]} == set(finished) == {g for _, g in store.router.relocations}
    _check_placement(cluster)
