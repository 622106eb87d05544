"""The application deletes (and creates again) briefcases that a reshard planned, moved, or is moving (issue 28 item 4).

A deleted briefcase is done: nothing to move, in the forward pass (deleted between the plan
and its batch), after a SIGKILL and resume, and in a cancel's move-back (deleted on its new
shard). None of them wedges the reshard or the area; every briefcase that still exists ends on
exactly one server, where a fresh Store routes it, with its rows unchanged.
"""

from __future__ import annotations

import pytest
import re
import signal

from support.moves import Cluster, create_user, locations, run_cli
from sqlalchemy import delete
from support.reshard import SERVERS, USERS, cluster  # noqa: F401 (fixtures: cluster)

from mdb import faults
from mdb.demo.models import UserBriefcase
from mdb.gdid import GDID
from mdb.moves.batch import BATCH_KIND
from mdb.moves.journal import Journal
from mdb.moves.reshard import reshard
from mdb.store import Store

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)


def _delete(store: Store, gdids: list[GDID]) -> None:
    for g in gdids:
        with store.briefcase(UserBriefcase, g) as s:
            for table in reversed(UserBriefcase.tables):  # children before their parents
                s.execute(delete(table).where(UserBriefcase.key_column(table) == g))


def _check(cluster: Cluster, alive: set[GDID]) -> None:
    with cluster.store() as store:
        store.refresh()
        found = locations(store, SERVERS)
        assert set(found) == alive, (sorted(set(found) - alive), sorted(alive - set(found)))
        for g, servers in found.items():
            assert len(servers) == 1, f"{g} is on {servers}"
            assert store.router.locate("user", g).server == servers[0], f"{g} routed away from its data"
        assert Journal(store).entries(unfinished=True) == []


def test_briefcases_deleted_between_the_plan_and_their_batch_are_done(cluster: Cluster) -> None:  # noqa: F811
    doomed = USERS[::5]

    def delete_after_plan(point: str) -> None:
        if point == "reshard.after_plan":
            _delete(writer, doomed)

    with cluster.store() as store, cluster.store() as writer:
        faults.hook = delete_after_plan
        try:
            out = reshard(store, "user", GDID(0, 0, 0), ["u1", "u2", "x"], map_path=cluster.path)
        finally:
            faults.hook = None
    old, new = ["u1", "u2"], ["u1", "u2", "x"]
    movers = [g for g in USERS if old[g.counter % 2] != new[g.counter % 3]]
    assert set(doomed) & set(movers), "no deleted briefcase was planned to move"
    assert out.moved == len(set(movers) - set(doomed))  # the deleted ones were not moved, and nothing waits for them
    _check(cluster, set(USERS) - set(doomed))
    # `moves status` shows each batch as a batch: how many briefcases, and rows without a planned total of 0.
    shown = run_cli(["moves", "status", str(cluster.path), "--limit", "50"], env={"COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    batches = [line for line in shown.stdout.splitlines() if "batch-move" in line]
    assert batches and all("/0 " not in line for line in batches), shown.stdout  # a batch of one shows its GDID
    assert any(re.search(r"user: \d+ briefcases", line) for line in batches), shown.stdout


def test_deletes_during_a_killed_reshard_its_resume_and_its_cancel_with_move_back(cluster: Cluster) -> None:  # noqa: F811
    alive = set(USERS)
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x"],
                  env={"MDB_FAULT_POINT": "batch.after_precopy", "MDB_FAULT_SKIP": "1"})
    assert run.returncode == -signal.SIGKILL, run.stderr
    with cluster.store() as store:
        journal = Journal(store)
        (entry,) = [e for e in journal.entries(unfinished=True) if e.kind == "reshard"]
        copied = [g for e in journal.entries(unfinished=True) if e.kind != "reshard" for g in e.briefcases]
        moved = [g for e in journal.moves_of(entry.move_id) if e.status == "done" for g in e.briefcases]
        assert copied and moved, (copied, moved)
        gone = [copied[0], moved[0]]  # one behind an interrupted copy, one already on its new shard
        _delete(store, gone)
    alive -= set(gone)
    # Killed again later in the resumed reshard, then deletes of briefcases on both sides, then cancel --move-back.
    again = run_cli(["moves", "resume", str(cluster.path)], env={"MDB_FAULT_POINT": "batch.after_commit_point", "MDB_FAULT_SKIP": "1"})
    assert again.returncode == -signal.SIGKILL, (again.stdout, again.stderr)
    with cluster.store() as store:
        journal = Journal(store)
        moved = [g for e in journal.moves_of(entry.move_id) if e.status == "done" for g in e.briefcases if g in alive]
        gone = moved[:3]
        _delete(store, gone)
        create_user(store, gone[2], orders=1, lines=1)  # deleted and created again: routed where its GDID goes now
    alive -= set(gone[:2])
    cancelled = run_cli(["moves", "cancel", str(cluster.path), entry.move_id, "--move-back"])
    assert cancelled.returncode == 0, (cancelled.stdout, cancelled.stderr)
    assert "3 deleted by the application meanwhile" in " ".join(cancelled.stdout.split()), cancelled.stdout
    _check(cluster, alive)
    with cluster.store() as store:
        assert [list(p[2]) for p in store.router.partitions("user")] == [["u1", "u2"]]
        backs = [e for e in Journal(store).moves_of(entry.move_id) if e.params.get("move_back")]
        assert any(e.kind == BATCH_KIND and e.status == "done" and len(e.briefcases) > 1 for e in backs), \
            "the move-back went one briefcase at a time, not in batches"
    # And a reshard of what is left runs to its end.
    done = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x"])
    assert done.returncode == 0, (done.stdout, done.stderr)
    _check(cluster, alive)
