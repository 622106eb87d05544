"""Hot-data counters under an adversary on real PostgreSQL (issue 18): two increments of one
counter in one transaction never deadlock, the deadlocks the application can still make are a
retryable mdb error, a K raise reaches a live writer within ``max_k_age``, and exactly-once
holds with SIGKILLed workers, late redeliveries and K raised mid-run."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from sqlalchemy import func, select
from support.stats import (
    BC_COUNTERS,
    BC_LOCK_TABLES,
    CENTRAL_COUNTERS,
    CENTRAL_LOCK,
    StakerBriefcase,
    create_staker,
    deliver_spreading,
    open_store,
)

from mdb.errors import RetryableError, StatsError, TransactionConflictError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.hot import Counters, central
from mdb.store import Store

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

USER = GDID(0, 0, 3)
SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def map_path(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Path:
    c, u1 = pg_databases(2)
    path = write_map(tmp_path, {"c": c, "u1": u1}, central=["c"], partitions=[("0:0:0", ["u1"])])
    with open_store(path) as s:
        assert all(r.ok for r in apply_schema(s))
        create_staker(s, USER)
    return path


@pytest.fixture
def store(map_path: Path) -> Iterator[Store]:
    with open_store(map_path) as s:
        yield s


class Scripted:
    """A stand-in for a Counters' random source that picks the given slots in turn."""

    def __init__(self, picks: list[int]) -> None:
        self.picks = list(picks)

    def randrange(self, k: int) -> int:
        pick = self.picks.pop(0)
        assert pick < k
        return pick


def _two_step_transactions(steps: list[Callable[[int], Any]], opener: Callable[[], Any]) -> list[BaseException | None]:
    """Run one transaction per step function in its own thread: ``step(0)``, wait until every
    transaction did its first step, ``step(1)``, commit. Returns each thread's error (or None)."""
    barrier = threading.Barrier(len(steps))
    errors: list[BaseException | None] = [None] * len(steps)

    def run(i: int) -> None:
        try:
            with opener() as place:
                steps[i](place, 0)
                barrier.wait(30)
                steps[i](place, 1)
        except BaseException as exc:  # collected and asserted on by the caller
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_adds_to_one_counter_in_one_transaction_never_deadlock(store: Store) -> None:
    """Before: each add picked a fresh random slot; with K = 2 a transaction holding slot 0 that
    then picked slot 1 waited for one holding 1 that then picked 0: a deadlock (8 in 40 rounds
    with random picks). Here the picks are forced into that order; a transaction now reuses its
    first slot, so both commit."""
    with central(store, "dl") as place:
        CENTRAL_COUNTERS.configure(place, "dl", 2)
    writers = [Counters(CENTRAL_COUNTERS.tables), Counters(CENTRAL_COUNTERS.tables)]
    writers[0]._random = Scripted([0, 1])  # type: ignore[assignment]
    writers[1]._random = Scripted([1, 0])  # type: ignore[assignment]
    used: list[list[int]] = [[], []]

    def step(w: int) -> Callable[[Any, int], None]:
        return lambda place, _n: used[w].append(writers[w].add(place, "dl", total_value_locked=1))

    errors = _two_step_transactions([step(0), step(1)], lambda: central(store, "dl"))
    assert errors == [None, None]
    assert used == [[0, 0], [1, 1]]  # one slot per (transaction, counter)
    with central(store, "dl") as place:
        assert CENTRAL_COUNTERS.read(place, "dl")["total_value_locked"] == 4


def test_a_deadlock_is_a_retryable_transaction_conflict_on_central_and_in_a_briefcase(store: Store) -> None:
    """Two counters taken in opposite orders still deadlock (that order is the application's);
    PostgreSQL aborts one transaction, and mdb reports it as TransactionConflictError, a
    RetryableError, instead of a raw OperationalError. Re-running it makes the totals exact."""
    counters = {"a": "dl-a", "b": "dl-b"}
    for name in counters.values():
        with central(store, name) as place:
            CENTRAL_COUNTERS.configure(place, name, 1)
        with store.briefcase(StakerBriefcase, USER) as s:
            BC_COUNTERS.configure(s, name, 1)
    routed = {store.router.locate_central(n).server for n in counters.values()}
    assert routed == {"c"}  # one CENTRAL shard: both counters in one transaction

    def crossing(family: Counters, first: str, second: str) -> Callable[[Any, int], None]:
        return lambda place, n: family.add(place, first if n == 0 else second, total_value_locked=1)

    openers: list[tuple[Counters, Callable[[], Any]]] = [
        (CENTRAL_COUNTERS, lambda: central(store, "dl-a")),
        (BC_COUNTERS, lambda: store.briefcase(StakerBriefcase, USER)),
    ]
    for family, opener in openers:
        steps = [crossing(family, "dl-a", "dl-b"), crossing(family, "dl-b", "dl-a")]
        errors = _two_step_transactions(steps, opener)
        failed = [e for e in errors if e is not None]
        assert len(failed) == 1, errors
        assert isinstance(failed[0], TransactionConflictError) and isinstance(failed[0], RetryableError), repr(failed[0])
        assert "deadlock" in str(failed[0]) and "retry" in str(failed[0])
        retry = errors.index(failed[0])
        with opener() as place:  # the caller's retry: the whole transaction again
            steps[retry](place, 0)
            steps[retry](place, 1)
        with opener() as place:
            assert family.read(place, "dl-a")["total_value_locked"] == 2
            assert family.read(place, "dl-b")["total_value_locked"] == 2


def test_a_k_raise_reaches_a_live_writer_within_max_k_age(store: Store) -> None:
    """Before: a writer that cached K = 1 kept writing slot 0 after K reached 64, until the
    process built a new Counters. Now the cached K is re-read once it is max_k_age old."""
    writer = Counters(CENTRAL_COUNTERS.tables, max_k_age=0.5)
    with central(store, "grow") as place:
        writer.configure(place, "grow", 1)
    for _ in range(3):
        with central(store, "grow") as place:
            assert writer.add(place, "grow", staker_count=1) == 0
    with central(store, "grow") as place:
        Counters(CENTRAL_COUNTERS.tables).configure(place, "grow", 64)  # another process raises K
    raised = time.monotonic()
    time.sleep(max(0.0, raised + writer.max_k_age - time.monotonic()))
    slots = []
    for _ in range(60):
        with central(store, "grow") as place:
            slots.append(writer.add(place, "grow", staker_count=1))
    assert max(slots) < 64 and len(set(slots)) > 1, slots  # all in slot 0 with the old K: 64**-60 by chance
    with central(store, "grow") as place:
        assert CENTRAL_COUNTERS.read(place, "grow")["staker_count"] == 63


def test_bad_names_are_refused_before_postgresql_sees_them(store: Store) -> None:
    """A NUL byte used to reach PostgreSQL and come back as sqlalchemy DataError."""
    with central(store, "tvl") as place:
        with pytest.raises(StatsError, match=r"event id .*control character '\\x00'"):
            CENTRAL_LOCK.apply(place, "tx\x00", "active", "overall", lambda _p: None)
        with pytest.raises(StatsError, match=r"counter id .*control character '\\x00'"):
            CENTRAL_COUNTERS.read(place, "tv\x00l")


def test_exactly_once_and_exact_totals_with_killed_workers_redeliveries_and_k_raises(map_path: Path, store: Store) -> None:
    """Three processes deliver the same events (in different orders) through the stats lock
    into one counter; two are SIGKILLed mid-run, replacements deliver everything again late,
    and K is raised 1 -> 4 -> 16 -> 64 meanwhile. Every event is applied exactly once and the
    totals are exact."""
    events = [(f"kill{i:04d}", 1 + i % 7) for i in range(240)]
    with store.briefcase(StakerBriefcase, USER) as s:
        BC_COUNTERS.configure(s, "kill", 1)
    locks = BC_LOCK_TABLES.locks

    def applied() -> int:
        with store.briefcase(StakerBriefcase, USER, readonly=True) as s:
            return s.connection().execute(select(func.count()).select_from(locks).where(locks.c.event_id.like("kill%"))).scalar_one()

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 120
        while applied() < n:
            assert time.monotonic() < deadline, f"no progress past {applied()} of {n} applied events"
            time.sleep(0.02)

    def raise_k(k: int) -> None:
        with store.briefcase(StakerBriefcase, USER) as s:
            BC_COUNTERS.configure(s, "kill", k)

    def start(order: list[tuple[str, int]]) -> Any:
        proc = SPAWN.Process(target=deliver_spreading, args=(str(map_path), str(USER), order, 0.2))
        proc.start()
        return proc

    workers = [start(events[w * 80:] + events[:w * 80]) for w in range(3)]
    killed = []
    for victim, progress, k in ((0, 30, 4), (1, 90, 16)):
        wait_for(progress)
        assert workers[victim].is_alive(), "the worker finished before it could be killed"
        os.kill(workers[victim].pid, signal.SIGKILL)
        killed.append(workers[victim])
        raise_k(k)
    late = [start(list(reversed(events))), start(events)]
    raise_k(64)
    for proc in [*workers, *late]:
        proc.join(300)
    assert [p.exitcode for p in killed] == [-signal.SIGKILL, -signal.SIGKILL]
    assert [p.exitcode for p in workers if p not in killed] + [p.exitcode for p in late] == [0, 0, 0]
    assert applied() == len(events)
    with store.briefcase(StakerBriefcase, USER, readonly=True) as s:
        assert BC_COUNTERS.read(s, "kill") == {"total_value_locked": sum(a for _e, a in events), "staker_count": len(events)}
        assert BC_COUNTERS.slots(s, "kill") == 64 and set(BC_COUNTERS.slot_rows(s, "kill")) == set(range(64))
