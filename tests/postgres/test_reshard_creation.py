"""A reshard while another process keeps CREATING briefcases in the partition (docs/design.md 1-2).

Without the freeze of the reshard's final phase, a briefcase created on an old shard after the
last sweep and before the new map is stamped would stay there while the new map routes it
elsewhere. The test holds the reshard at the start of its final phase until the writer has
created more briefcases (stragglers), checks that the final sweep moved some of them, and then
checks that every briefcase is exactly once on the shard the new map names, with every
acknowledged write.
"""

from __future__ import annotations

import pytest
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from support import forkserver
from support.moves import ROOT, Cluster, create_user, locations, make_cluster
from sqlalchemy import select

from mdb.demo.models import Transaction
from mdb.gdid import GDID
from mdb.moves.journal import Journal
from mdb.moves.plan import PlannedMove
from mdb.moves.reshard import ReshardCounts, reshard
from mdb.moves.status import move_status
from mdb.store import Store

SERVERS = ["u1", "u2", "x"]
SEED = [GDID(0, 0, i) for i in range(1, 7)]
NEW = ["u1", "u2", "x"]

CREATOR = r"""
import sys, itertools
sys.path.insert(0, "tests")
from pathlib import Path
from support.moves import add_transaction, create_user
from mdb.demo.models import UserBriefcase
from mdb.errors import RetryableError
from mdb.gdid import GDID
from mdb.store import Store
path, stop = sys.argv[1], Path(sys.argv[2])
created = []
with Store.from_yaml(path, types=[UserBriefcase], move_wait_seconds=60) as store:
    for n in itertools.count():
        if stop.exists():
            break
        g = GDID(0, 0, 1000 + n)
        try:
            create_user(store, g, orders=1, lines=1)
        except RetryableError as exc:
            print(f"R {type(exc).__name__}", flush=True)
            continue
        created.append(g)
        print(f"C {g}", flush=True)
        target, tid = created[n % len(created)], 5_000_000 + n
        try:
            add_transaction(store, target, tid, n)
        except RetryableError as exc:
            print(f"R {type(exc).__name__}", flush=True)
            continue
        print(f"T {target} {tid}", flush=True)
"""


class _Progress:
    """Holds the reshard at its freeze until the creator has made stragglers; records final moves
    and every count shown (briefcases done, total, rows done, total)."""

    def __init__(self, created: Callable[[], int]) -> None:
        self._created = created
        self.phases: list[str] = []
        self.final_moves: list[GDID] = []
        self.shown: list[tuple[int, int, int, int]] = []

    def phase(self, name: str) -> None:
        self.phases.append(name)
        if name == "freeze":
            wanted = self._created() + 10
            while self._created() < wanted:
                threading.Event().wait(0.01)

    def counts(self, counts: ReshardCounts, last: PlannedMove | None) -> None:
        self.shown.append((counts.briefcases_done, counts.briefcases_total, counts.rows_done, counts.rows_total))
        if last is not None and self.phases and self.phases[-1] == "final moves":
            self.final_moves.append(last.gdid)


def _assert_counts_agree(store: Store, reshard_id: str | None, shown: list[tuple[int, int, int, int]], final: tuple[int, int]) -> None:
    """Issue 11 item 9: the bars, `moves status` and the final line agree and never exceed the total.

    Briefcases created during the reshard are moved by later sweeps; the old code kept the first
    plan's total, so done passed it (the bar showed 459/178, the final line "178 of 267").
    """
    assert shown and all(done <= total and rows <= rows_total for done, total, rows, rows_total in shown), shown
    assert [s[0] for s in shown] == sorted(s[0] for s in shown), "done went backwards"
    _, recent = move_status(store, recent=10_000)
    status = next(s.entry for s in recent if s.entry.move_id == reshard_id)
    journaled = (status.briefcases_done, status.briefcases_total, status.rows_done, status.rows_total)
    assert journaled == shown[-1] == (final[0], final[0], final[1], final[1]), (journaled, shown[-1], final)
    finished = [m for m in Journal(store).moves_of(status.move_id) if m.status == "done"]
    assert final == (sum(len(m.briefcases) for m in finished), sum(m.rows_done for m in finished))  # a batch moves several


@pytest.mark.slow  # 112 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_briefcases_created_during_a_reshard_end_up_once_on_the_new_shard(
    pg_databases: Callable[[int], list[str]], tmp_path: Path
) -> None:
    cluster: Cluster = make_cluster(dict(zip(["c", *SERVERS], pg_databases(4))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in SEED:
            create_user(store, g, orders=1, lines=1)
    stop = tmp_path / "stop"
    # stdout is read line by line by one thread only; stderr goes to a file (communicate() would
    # read stdout too and steal parts of lines from the reader).
    errors = tmp_path / "creator.stderr"
    with errors.open("w") as err_file:
        proc = forkserver.popen([sys.executable, "-c", CREATOR, str(cluster.path), str(stop)],
                                cwd=str(ROOT), stdout=subprocess.PIPE, stderr=err_file, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()

    def created() -> int:
        return sum(1 for line in list(lines) if line.startswith("C "))

    try:
        while created() < 10:
            assert proc.poll() is None, errors.read_text()
            threading.Event().wait(0.01)
        progress = _Progress(created)
        with cluster.store() as admin:
            outcome = reshard(admin, "user", GDID(0, 0, 0), NEW, parallel=2, map_path=cluster.path, progress=progress)
        assert outcome.map_version is not None
        assert progress.final_moves, "the final (frozen) sweep moved no straggler: the window was not exercised"
        _assert_counts_agree(admin, outcome.reshard_id, progress.shown, (outcome.moved, outcome.rows_moved))
        after = created()
        while created() < after + 5:  # writes go on after the unfreeze, under the new map
            assert proc.poll() is None, errors.read_text()
            threading.Event().wait(0.01)
    finally:
        stop.touch()
        proc.wait(timeout=120)
        reader.join()
    assert proc.returncode == 0, errors.read_text()

    made = [GDID.parse(line.split()[1]) for line in lines if line.startswith("C ")]
    writes = {int(line.split()[2]): GDID.parse(line.split()[1]) for line in lines if line.startswith("T ")}
    with cluster.store() as store:
        store.refresh()
        assert [list(p[2]) for p in store.router.partitions("user")] == [NEW]
        assert not store.router.relocations
        homes = locations(store, SERVERS)
        assert set(made) | set(SEED) == set(homes), "a briefcase is missing, or one appeared that nobody acknowledged"
        for g, servers in homes.items():
            assert servers == [NEW[g.sharding_value % len(NEW)]], f"{g} is on {servers}"
            assert store.router.locate("user", g).server == servers[0]
        found: Counter[tuple[str, GDID, int]] = Counter()
        for server in SERVERS:
            with store.transaction(server) as conn:
                for uid, tid in conn.execute(select(Transaction.__table__.c.user_id, Transaction.__table__.c.transaction_id)):
                    found[(server, uid, tid.counter)] += 1
        assert all(n == 1 for n in found.values()), "a transaction row is duplicated"
        by_tid = {tid: (server, uid) for server, uid, tid in found}
        for tid, g in writes.items():
            assert by_tid.get(tid) == (homes[g][0], g), f"acknowledged write {g}/{tid} is lost or misplaced"
        assert Journal(store).entries(unfinished=True) == []
