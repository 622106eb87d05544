"""The work-item queue of reshard jobs (mdb.moves.jobs): claims, per-server limits, takeover of a dead claim."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from support.moves import create_user, make_cluster
from sqlalchemy import text

from mdb.gdid import GDID
from mdb.moves import jobs
from mdb.moves.journal import RUNNING, Journal, JournalEntry, new_move_id
from mdb.moves.lease import hold, liveness
from mdb.moves.movejob import start_job
from mdb.moves.plan import PlannedMove
from mdb.moves.reshard import reshard


def _job(journal: Journal, per_server: int) -> str:
    job_id = new_move_id("reshard")
    journal.start(JournalEntry(move_id=job_id, kind="reshard", area="user", step="moves", status=RUNNING,
                               params={"per_server": per_server, "old_shards": ["a", "b"], "new_shards": ["a", "b", "c", "d"]}))
    return job_id


def _moves(source: str, target: str, first: int, n: int) -> list[PlannedMove]:
    return [PlannedMove(GDID(0, 0, i), source, target, {"users": 1}) for i in range(first, first + n)]


def test_claims_respect_the_per_server_limit_and_let_unrelated_pairs_go(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = make_cluster(dict(zip(["c", "a", "b", "d"], pg_databases(4))), tmp_path, [("0:0:0", ["a", "b"])])
    with cluster.store() as store:
        journal = Journal(store)
        job = _job(journal, per_server=1)
        # Items of 2 briefcases, pairs in turn: a->b, d->c, b->d, a->b (the queue only counts servers by name)
        jobs.enqueue(journal, job, 1, [*_moves("a", "b", 1, 4), *_moves("d", "c", 10, 2), *_moves("b", "d", 20, 2)], size=2)
        first = jobs.claim(journal, [job])
        assert first is not None and (first.source, first.target) == ("a", "b")
        with hold(journal, first.item_id):
            second = jobs.claim(journal, [job])
            assert second is not None and (second.source, second.target) == ("d", "c"), "an unrelated pair must go on"
            with hold(journal, second.item_id):
                # a->b again (a and b busy), b->d (b and d busy): nothing more at one item per server
                assert jobs.claim(journal, [job]) is None
            # d -> c released (not done): its claim lapsed with its lease, so it is claimable again, first in turn
            jobs.release_item(store, journal.server, second.item_id)
            again = jobs.claim(journal, [job])
            assert again is not None and again.item_id == second.item_id and again.attempts == 2


def test_an_item_whose_claimer_died_is_claimed_again_and_a_stopped_job_drops_the_rest(
    pg_databases: Callable[[int], list[str]], tmp_path: Path,
) -> None:
    cluster = make_cluster(dict(zip(["c", "a", "b"], pg_databases(3))), tmp_path, [("0:0:0", ["a"])])
    with cluster.store() as store:
        journal = Journal(store)
        job = _job(journal, per_server=5)
        jobs.enqueue(journal, job, 1, _moves("a", "b", 1, 6), size=2)
        item = jobs.claim(journal, [job])
        assert item is not None
        with hold(journal, item.item_id):  # a live holder: its item is not handed out twice
            others = [jobs.claim(journal, [job]) for _ in range(2)]
            assert all(o is not None and o.item_id != item.item_id for o in others)
        # Released lease, claim kept (a claimer that died after its take): claimable once more, as a takeover.
        with store.transaction(journal.server) as conn:
            conn.execute(jobs.job_items.update().where(jobs.job_items.c.item_id != item.item_id).values(worker=None))
            conn.execute(jobs.job_items.update().where(jobs.job_items.c.item_id == item.item_id)
                         .values(claimed_at=text("current_timestamp - interval '1 hour'")))
        jobs.stop_items(journal, job)
        states = {i.item_id: i.status for i in jobs.open_items(journal, job)}
        assert states == {item.item_id: jobs.STOPPING}, "unclaimed items are dropped, the claimed one asked to stop"
        settled: list[str] = []
        jobs.settle(journal, job, lambda i: (settled.append(i.item_id), jobs.drop(store, journal.server, i.item_id)))
        assert settled == [item.item_id] and jobs.open_items(journal, job) == []


def test_a_job_is_driven_from_the_moment_its_row_exists(pg_databases: Callable[[int], list[str]], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle `mdb worker` adopts a running job whose lease no live process holds. The command
    takes the lease before it journals the job, so no worker can see the row undriven and take the
    job from the command (which then failed with the lease held elsewhere)."""
    cluster = make_cluster(dict(zip(["c", "a", "b", "x"], pg_databases(4))), tmp_path, [("0:0:0", ["a", "b"])])
    seen: list[tuple[str, str]] = []
    start = Journal.start

    def journaled(self: Journal, entry: JournalEntry) -> None:
        start(self, entry)
        if entry.kind in ("reshard", "rebalance"):
            seen.append((entry.kind, liveness(self, entry)[0]))

    monkeypatch.setattr(Journal, "start", journaled)
    with cluster.store() as store:
        for n in range(1, 7):
            create_user(store, GDID(0, 0, n))
        reshard(store, "user", GDID.ZERO, ["a", "b", "x"])
        moved = GDID(0, 0, 3)
        source = store.router.locate("user", moved).server
        start_job(store, "rebalance", "user", [PlannedMove(moved, source, "a" if source != "a" else "b", {})])
    assert seen == [("reshard", "running"), ("rebalance", "running")]
