"""A move can crash anywhere (docs/design.md invariant 3): SIGKILL at every named step, then resume.

Each case runs the real ``mdb move`` / ``mdb reshard`` in a child process with
``MDB_FAULT_POINT`` naming a point in the protocol; the child kills itself there with SIGKILL.
Then ``mdb moves resume`` runs, and every table's rows over all servers must equal the
snapshot taken before (no duplicate, nothing lost), each briefcase must be on exactly one
server, that server must be where a fresh Store routes it, and the journal must be empty of
unfinished work.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.pgbouncer import make_pooled_cluster
from support.moves import Cluster, create_user, locations, make_cluster, run_cli, snapshot
from support.reshard import BATCH_POINTS

from mdb.demo.models import User, UserBriefcase
from mdb.gdid import GDID
from mdb import faults
from mdb.moves import cancel as _cancel, reshard as _reshard, resume as _resume_points  # noqa: F401  (they register their points)
from mdb.moves.freeze import frozen_by
from mdb.moves.journal import Journal
from mdb.store import Store

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

SERVERS = ["u1", "u2", "x"]
USERS = [GDID(0, 0, i) for i in range(1, 7)]
THROUGH_PGBOUNCER_TOO = pytest.mark.parametrize("cluster", ["direct", "pgbouncer"], indirect=True)

MOVE_POINTS = [  # a single move is a batch of one (docs/dev/0017): the batch's points, in its order
    ("batch.after_journal_start", {}),
    ("batch.after_precopy", {}),
    ("batch.after_lock", {}),
    ("batch.after_source_cut", {}),
    ("batch.after_verify", {}),
    ("batch.before_commit_point", {}),
    ("batch.after_commit_point", {}),
    ("batch.after_relocations", {}),  # finalize's (mdb.moves.cutover)
    ("batch.after_target_states", {}),
]
# Where the briefcase must be after resume: the target iff the commit point had passed.
PASSED = {"batch.after_commit_point", "batch.after_relocations", "batch.after_target_states"}


def _check(cluster: Cluster, before: dict, where_expected: dict[GDID, str] | None = None) -> dict[GDID, str]:
    with cluster.store() as store:
        assert snapshot(store, SERVERS) == before, "rows differ from the snapshot taken before the move"
        found = locations(store, SERVERS)
        assert set(found) == set(USERS)
        out = {}
        for g, servers in found.items():
            assert len(servers) == 1, f"{g} is on {servers}"
            assert store.router.locate("user", g).server == servers[0], f"{g} routed away from its data"
            with store.briefcase(UserBriefcase, g) as s:  # the ownership check agrees
                assert s.get(User, g) is not None
            out[g] = servers[0]
        assert Journal(store).entries(unfinished=True) == []
    if where_expected is not None:
        assert out == where_expected
    return out


def _resume(cluster: Cluster, env: dict[str, str] | None = None) -> str:
    done = run_cli(["moves", "resume", str(cluster.path)], env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def cluster(request: pytest.FixtureRequest, pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Cluster:
    """Four databases, users on u1 and u2. ``pgbouncer`` (THROUGH_PGBOUNCER_TOO): every server
    behind one transaction-mode PgBouncer, the tools too (no ``direct:`` URLs)."""
    urls = dict(zip(["c", *SERVERS], pg_databases(4)))
    if getattr(request, "param", "direct") == "pgbouncer":
        cluster: Cluster = make_pooled_cluster(request.getfixturevalue("pgbouncer"), urls, tmp_path, [("0:0:0", ["u1", "u2"])], tools_direct=False)
    else:
        cluster = make_cluster(urls, tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g)
    return cluster


def test_every_fault_point_is_exercised_here_or_in_the_reshard_test() -> None:
    # between_passes: tests/faults/test_reshard_columns.py (a migration between two passes)
    covered = {p for p, _ in MOVE_POINTS} | {p for p, _ in RESHARD_POINTS} \
        | {"cancel.after_first_move_back", "reshard.between_passes"} \
        | set(BATCH_POINTS)  # tests/faults/test_moves_cancel.py, tests/faults/test_reshard_batches.py
    FAULT_POINTS = [p for p in faults.points() if p.split(".")[0] in ("move", "reshard", "resume", "cancel", "batch")]
    assert covered == set(FAULT_POINTS)
    assert len(FAULT_POINTS) >= 20


@THROUGH_PGBOUNCER_TOO
def test_sigkill_at_every_move_step_then_resume(cluster: Cluster) -> None:
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
    placed = _check(cluster, before)
    for i, (point, env) in enumerate(MOVE_POINTS):
        g = USERS[i % len(USERS)]
        source = placed[g]
        target = next(s for s in SERVERS if s != source)
        run = run_cli(["move", str(cluster.path), "user", str(g), "--to", target], env={"MDB_FAULT_POINT": point, **env})
        assert run.returncode == -signal.SIGKILL, f"{point}: the child was not killed there: {run.returncode} {run.stderr}"
        _resume(cluster)
        expected = dict(placed)
        expected[g] = target if point in PASSED else source
        placed = _check(cluster, before, expected)


def test_sigkill_while_resuming_a_rollback(cluster: Cluster) -> None:
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
    placed = _check(cluster, before)
    g = USERS[0]
    target = next(s for s in SERVERS if s != placed[g])
    run = run_cli(["move", str(cluster.path), "user", str(g), "--to", target], env={"MDB_FAULT_POINT": "batch.after_verify"})
    assert run.returncode == -signal.SIGKILL
    crashed = run_cli(["moves", "resume", str(cluster.path)], env={"MDB_FAULT_POINT": "batch.resume.after_discard"})
    assert crashed.returncode == -signal.SIGKILL
    _resume(cluster)
    _check(cluster, before, placed)


def test_a_briefcase_with_an_interrupted_move_is_not_moved_again_until_resume(cluster: Cluster) -> None:
    """The killed move left a copy on its target and a journal row that resume acts on; a second
    move beside them would leave resume reasoning about the wrong source."""
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
    placed = _check(cluster, before)
    g = USERS[1]
    first, second = (s for s in SERVERS if s != placed[g])
    run = run_cli(["move", str(cluster.path), "user", str(g), "--to", first], env={"MDB_FAULT_POINT": "batch.after_precopy"})
    assert run.returncode == -signal.SIGKILL
    for args in (["--to", second], ["--to", second, "--dry-run"]):
        refused = run_cli(["move", str(cluster.path), "user", str(g), *args])
        assert refused.returncode == 2 and "unfinished moves" in refused.stderr and "mdb moves resume" in refused.stderr, refused.stderr
    other = USERS[2]  # another briefcase of the same partition is not held up
    moved = run_cli(["move", str(cluster.path), "user", str(other), "--to", next(s for s in SERVERS if s != placed[other])])
    assert moved.returncode == 0, moved.stderr
    _resume(cluster)
    placed = _check(cluster, before)
    again = run_cli(["move", str(cluster.path), "user", str(g), "--to", second])
    assert again.returncode == 0, again.stderr
    _check(cluster, before, {**placed, g: second})


RESHARD_POINTS = [
    ("reshard.after_journal_start", {}),
    ("reshard.after_plan", {}),
    ("reshard.after_prechecks", {}),
    ("reshard.after_first_move", {}),
    ("reshard.after_moves", {}),
    ("reshard.during_freeze", {}),
    ("reshard.after_freeze", {}),
    ("reshard.after_final_moves", {}),
    ("reshard.before_map_apply", {}),
    ("reshard.after_map_apply", {}),
    ("reshard.after_map_file", {}),
    ("reshard.after_unfreeze", {}),
    ("reshard.after_clear_relocations", {}),
    ("reshard.after_resident_cleanup", {}),
]


@THROUGH_PGBOUNCER_TOO
def test_sigkill_at_every_reshard_step_then_resume(cluster: Cluster) -> None:
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
    _check(cluster, before)
    lists = [["u1", "u2", "x"], ["u1", "u2"]]
    # Two batch points with --batch-pause 0 (one briefcase at a time); the batch points are killed
    # with writers running in tests/faults/test_reshard_batches.py.
    cases = [*RESHARD_POINTS, ("batch.after_precopy", {"MDB_FAULT_SKIP": "1"}), ("batch.after_commit_point", {"MDB_FAULT_SKIP": "1"})]
    for i, (point, env) in enumerate(cases):
        shards = lists[i % 2]
        one_at_a_time = ["--batch-pause", "0"] if point.startswith("batch.") else []
        run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", ",".join(shards), *one_at_a_time],
                      env={"MDB_FAULT_POINT": point, **env})
        assert run.returncode == -signal.SIGKILL, f"{point}: {run.returncode} {run.stdout} {run.stderr}"
        with cluster.store() as store:
            interrupted = [(e.move_id, e.step) for e in Journal(store).entries(unfinished=True) if e.kind == "reshard"]
        report = _resume(cluster)
        assert len(interrupted) == 1 and f"was at step {interrupted[0][1]!r}" in report, (point, interrupted, report)
        placed = _check(cluster, before)
        with cluster.store() as store:
            _assert_counts_are_the_finished_moves(Journal(store), interrupted[0][0], point)
        # The reshard finished: every briefcase sits on its shard under the new list, by default routing.
        with Store.from_yaml(cluster.path, types=[UserBriefcase]) as store:
            store.refresh()
            assert [list(p[2]) for p in store.router.partitions("user")] == [shards], point
            assert not store.router.relocations, point
            for server in ["u1", "u2"]:  # the old shards of both lists: no freeze is left behind
                assert frozen_by(store, "user", GDID(0, 0, 0), server) is None, (point, server)
            for g, server in placed.items():
                assert server == shards[g.sharding_value % len(shards)], (point, g)


def _assert_counts_are_the_finished_moves(journal: Journal, reshard_id: str, point: str) -> None:
    """A resumed reshard's counts are its finished moves: none counted twice, none missed (item 9).

    Killed right after a move's commit point, the old code's counter missed the move resume
    finalized; one killed after its counter update re-counted nothing, but its total stayed
    the first plan's, whatever a re-plan found.
    """
    entry = journal.get(reshard_id)
    assert entry is not None and entry.status == "done", point
    finished = [m for m in journal.moves_of(reshard_id) if m.status == "done"]
    briefcases = sum(len(m.briefcases) for m in finished)  # a batch moves several
    assert (entry.briefcases_done, entry.briefcases_total) == (briefcases, briefcases), point
    rows = sum(m.rows_done for m in finished)
    assert (entry.rows_done, entry.rows_total) == (rows, rows), point
    assert all(done == total for total, done in entry.tables.values()), (point, entry.tables)


def test_resume_resolves_what_it_can_while_a_target_is_down(pg_databases: Callable[[int], list[str]], pg_server_factory: Callable[[], Any], tmp_path: Path) -> None:
    """Two interrupted moves, one to a server that is now down: resume rolls the other back,
    reports the stuck one as failed and exits 1; once the server is back, resume finishes."""
    down = pg_server_factory()
    urls = {**dict(zip(["c", "u1", "u2"], pg_databases(3))), "x": down.create_database()}
    cluster = make_cluster(urls, tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g)
        before = snapshot(store, SERVERS)
        home = {g: store.router.locate("user", g).server for g in USERS[:2]}
    to_x, to_other = USERS[0], USERS[1]
    other_target = next(s for s in ("u1", "u2") if s != home[to_other])
    for g, target in ((to_x, "x"), (to_other, other_target)):
        run = run_cli(["move", str(cluster.path), "user", str(g), "--to", target], env={"MDB_FAULT_POINT": "batch.after_precopy"})
        assert run.returncode == -signal.SIGKILL, run.stderr
    down.stop()
    partial = run_cli(["moves", "resume", str(cluster.path)])
    assert partial.returncode == 1, (partial.stdout, partial.stderr)
    assert "failed: server 'x' is unavailable" in partial.stdout and "rolled back" in partial.stdout, partial.stdout
    with cluster.store() as store:
        assert [e.gdid for e in Journal(store).entries(unfinished=True)] == [to_x]  # the other one is resolved
    down.start()
    _resume(cluster)
    _check(cluster, before, None)
