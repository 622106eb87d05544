"""Shared by test_reshard_batches and the suites beside it (moved out of test_reshard_batches, which used to be imported by other test modules)."""

from __future__ import annotations

import time

import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
import pytest
from support import forkserver
from support.moves import process_state, ROOT, Cluster, add_transaction, cloned_cluster, create_user, locations
from support.templates import Databases
from sqlalchemy import select
from mdb.demo.models import Transaction, UserBriefcase
from mdb.errors import RetryableError
from mdb.gdid import GDID
from mdb.moves.batch import BATCH_KIND
from mdb.moves.journal import Journal
from mdb.store import Store

SERVERS = ["u1", "u2", "x"]
USERS = [GDID(0, 0, i) for i in range(1, 41)]
BATCH_POINTS = [
    "batch.after_journal_start",
    "batch.after_precopy",
    "batch.after_lock",
    "batch.after_source_cut",
    "batch.after_resync",
    "batch.after_verify",
    "batch.before_commit_point",
    "batch.after_commit_point",
    "batch.after_relocations",
    "batch.after_target_states",
    "batch.resume.after_discard",
]
WRITER = r"""
import sys, itertools
from collections import Counter
sys.path.insert(0, "tests")
from pathlib import Path
from support.moves import add_transaction
from sqlalchemy import select
from mdb.demo.models import Transaction, UserBriefcase
from mdb.errors import RetryableError
from mdb.gdid import GDID
from mdb.retry import RoutedOpen
from mdb.store import Store
path, stop, base, users = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
gdids = [GDID(0, 0, i) for i in range(1, users + 1)]
steps = Counter()
refused = RoutedOpen.refused
def counted(self, placement, exc):
    step = refused(self, placement, exc)
    steps["wait" if step.delay else "refresh" if step.refresh else "follow"] += 1
    return step
RoutedOpen.refused = counted
with Store.from_yaml(path, types=[UserBriefcase]) as store:
    print(f"version {store.map.version}", flush=True)
    for n in itertools.count():
        if stop.exists():
            break
        g, tid = gdids[n % len(gdids)], base + n
        try:
            add_transaction(store, g, tid, n)
            if n % 4 == 0:  # and reads: a readonly session of the same briefcase
                with store.briefcase(UserBriefcase, g, readonly=True) as s:
                    s.scalars(select(Transaction).where(Transaction.transaction_id == GDID(0, 4, tid))).all()
        except RetryableError as exc:  # counted by the caller: reshard tests of issue 31 allow none
            print(f"error {type(exc).__name__}", flush=True)
            continue
        print(f"{g} {tid}", flush=True)
    print("steps " + " ".join(f"{k}={v}" for k, v in sorted(steps.items())), flush=True)
    print(f"routing learned={len(store.routes)} refreshes={store.refreshes} directory={store.router.directory_loaded}", flush=True)
"""


def _users(store: Store) -> None:
    for g in USERS:
        create_user(store, g, orders=1, lines=2)


@pytest.fixture
def cluster(pg_databases: Databases, tmp_path: Path) -> Cluster:
    return cloned_cluster(pg_databases, ["c", *SERVERS], tmp_path, [("0:0:0", ["u1", "u2"])], seed=_users)


class Writers:
    """A writer process on a frozen copy of the map (a stale router) and a writer thread; acknowledged writes."""

    def __init__(self, cluster: Cluster, tmp_path: Path, move_wait_seconds: float | None = None) -> None:
        self.cluster = cluster
        self._move_wait = move_wait_seconds
        """The thread's ``Store(move_wait_seconds=...)``: None is the Store's default (30 s)."""
        self.acked: list[tuple[GDID, int]] = []
        self.retried: Counter[str] = Counter()
        """Retryable errors raised to the writers (thread and process), by type: an application would see them."""
        self.steps: dict[str, int] = {}
        """The writer process's refusals by reaction (wait, follow, refresh): what its Store absorbed."""
        self.routing = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_file = tmp_path / "stop-writers"
        stale_map = tmp_path / "stale-map.yaml"  # never rewritten: the process routes by the map it started with
        shutil.copy(cluster.path, stale_map)
        self.stale_version = Cluster(cluster.urls, stale_map, cluster.central).store().map.version
        self._proc = forkserver.popen(
            [sys.executable, "-c", WRITER, str(stale_map), str(self._stop_file), "5000000", str(len(USERS))],
            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self._thread = threading.Thread(target=self._write, args=(1_000_000,))
        self._thread.start()

    def _write(self, base: int) -> None:
        wait = {} if self._move_wait is None else {"move_wait_seconds": self._move_wait}
        with Store.from_yaml(self.cluster.path, types=[UserBriefcase], **wait) as store:
            n = 0
            while not self._stop.is_set():
                g, tid = USERS[n % len(USERS)], base + n
                n += 1
                try:
                    add_transaction(store, g, tid, n)
                except RetryableError as exc:
                    self.retried[type(exc).__name__] += 1
                    continue
                with self._lock:
                    self.acked.append((g, tid))

    def wait_for(self, more: int) -> None:
        start = len(self.acked)
        while len(self.acked) < start + more:
            threading.Event().wait(0.01)

    def stop(self) -> int:
        """Stop both; returns how many writes the process acknowledged."""
        self._stop.set()
        self._stop_file.touch()
        self._thread.join()
        out, err = self._proc.communicate(timeout=120)
        assert self._proc.returncode == 0, err
        lines = out.splitlines()
        assert lines[0] == f"version {self.stale_version}"
        self.routing = lines.pop()
        self.steps = {k: int(v) for k, v in (kv.split("=") for kv in lines.pop().split()[1:])}
        acked = 0
        for line in lines[1:]:
            text, tid = line.split()
            if text == "error":
                self.retried[tid] += 1
                continue
            self.acked.append((GDID.parse(text), int(tid)))
            acked += 1
        return acked


WRITERS_MOVE_WAIT = "WRITERS_MOVE_WAIT"
"""A test module's constant of this name (seconds) is how long the ``writers`` thread waits for a
moving briefcase before its write fails (a RetryableError, counted in ``retried``), instead of
the Store's 30 s. Where a suite kills a batch and then waits for the thread's next writes before
it resumes, the thread sat out the full wait on each briefcase the dead batch left moving
(30-60 s per kill point); the oracles count only acknowledged writes."""


@pytest.fixture
def writers(cluster: Cluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Writers]:
    w = Writers(cluster, tmp_path, getattr(request.module, WRITERS_MOVE_WAIT, None))
    try:
        yield w
    finally:
        if not w._stop.is_set():
            w._stop.set()
            w._stop_file.touch()
            w._thread.join()
            w._proc.kill()


def _check_placement(cluster: Cluster) -> dict[GDID, str]:
    """Every briefcase on exactly one server, routed there by a fresh Store; the journal has nothing unfinished."""
    with cluster.store() as store:
        store.refresh()
        found = locations(store, SERVERS)
        assert set(found) == set(USERS)
        for g, servers in found.items():
            assert len(servers) == 1, f"{g} is on {servers}"
            assert store.router.locate("user", g).server == servers[0], f"{g} routed away from its data"
        assert Journal(store).entries(unfinished=True) == []
        return {g: s[0] for g, s in found.items()}


def _check_writes(cluster: Cluster, acked: list[tuple[GDID, int]]) -> None:
    """Every acknowledged write once, on its briefcase's server; no row of any briefcase anywhere else."""
    homes = _check_placement(cluster)
    rows: Counter[tuple[str, GDID, int]] = Counter()
    with cluster.store() as store:
        for server in SERVERS:
            with store.transaction(server) as conn:
                for table in UserBriefcase.tables:
                    key = UserBriefcase.key_column(table)
                    wrong = [g for (g,) in conn.execute(select(key).distinct()) if homes[g] != server]
                    assert not wrong, f"{table.name} on {server!r} holds rows of {wrong[:3]}, whose home is elsewhere"
                t = Transaction.__table__
                for uid, tid in conn.execute(select(t.c.user_id, t.c.transaction_id)):
                    rows[(server, uid, tid.counter)] += 1
    assert all(n == 1 for n in rows.values()), "a transaction row is duplicated"
    by_tid = {tid: (server, uid) for server, uid, tid in rows}
    for g, tid in acked:
        assert tid in by_tid, f"acknowledged write {g}/{tid} is lost"
        assert by_tid[tid] == (homes[g], g), f"write {tid} is on {by_tid[tid]}, its briefcase on {homes[g]}"


def _batches(cluster: Cluster) -> list[tuple[str, int]]:
    with cluster.store() as store:
        return [(e.status, len(e.params["gdids"])) for e in Journal(store).entries() if e.kind == BATCH_KIND]


def _wait_stopped(proc: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 120
    while process_state(proc.pid) != "T":
        assert proc.poll() is None, (what, proc.communicate())
        assert time.monotonic() < deadline, f"{what}: the driver never reached its stop point"
        time.sleep(0.05)


