"""Counters and the stats lock on MongoDB: exactly-once under concurrent threads, both transaction modes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from support.mongo import MongoEnv, UserDocs

from mdb import GDID
from mdb.errors import RetryableError, StatsError
from mdb.mongo.hot import COUNTERS, MongoCounter, MongoStatsLock

BOTH = pytest.mark.parametrize("transactions", [True, False], ids=["txn", "no-txn"])
UID = GDID(0, 0, 5)


def retrying(fn: Callable[[], Any]) -> Any:
    """Re-run a whole briefcase context on a retryable error (a transaction conflict on a real server)."""
    for _ in range(200):
        try:
            return fn()
        except RetryableError:
            continue
    raise AssertionError("still conflicting after 200 attempts")


def run_threads(n: int, target: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # reported below: a thread's failure fails the test
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@BOTH
def test_counter_adds_are_never_lost(mongo_env: MongoEnv, transactions: bool) -> None:
    store = mongo_env.store(2, transactions=transactions)
    with store.documents(UserDocs, UID) as bc:
        bc.root.insert_one({"email": "h@x"})
    counter = MongoCounter("visits", slots=4)

    def worker(i: int) -> None:
        for _ in range(25):
            def once() -> None:
                with store.documents(UserDocs, UID) as bc:
                    counter.add(bc, n=1, weight=i)
            retrying(once)

    run_threads(4, worker)
    with store.documents(UserDocs, UID, readonly=True) as bc:
        assert counter.read(bc) == {"n": 100, "weight": 25 * (0 + 1 + 2 + 3)}
    slots = store.mongo.database("m2")[COUNTERS].count_documents({"counter": "visits"})
    assert 1 <= slots <= 4


@BOTH
def test_stats_lock_applies_each_event_once_under_concurrent_duplicates(mongo_env: MongoEnv, transactions: bool) -> None:
    store = mongo_env.store(2, transactions=transactions)
    with store.documents(UserDocs, UID) as bc:
        bc.root.insert_one({"email": "s@x"})
    counter = MongoCounter("staked", slots=3)
    lock = MongoStatsLock()
    events = {f"tx-{i}": 10 + i for i in range(12)}
    applied = []
    applied_lock = threading.Lock()

    def deliver(i: int) -> None:
        # every thread delivers every event (in a different order): 4 deliveries each
        order = list(events.items())[i:] + list(events.items())[:i]
        for event_id, amount in order:
            def once() -> bool:
                with store.documents(UserDocs, UID) as bc:
                    return lock.apply(bc, event_id, "active", "overall", lambda b: counter.add(b, amount=amount, n=1))
            if retrying(once):
                with applied_lock:
                    applied.append(event_id)

    run_threads(4, deliver)
    assert sorted(applied) == sorted(events)  # each event applied by exactly one delivery
    with store.documents(UserDocs, UID, readonly=True) as bc:
        assert counter.read(bc) == {"amount": sum(events.values()), "n": len(events)}
        assert lock.applied(bc, "tx-3", "active") == {"overall"}
        assert lock.unfinished(bc) == []
    # a later state or another calculation is a new lock
    with store.documents(UserDocs, UID) as bc:
        assert lock.apply(bc, "tx-3", "unbonded", "overall", lambda b: counter.add(b, amount=-13, n=-1))
        assert lock.apply(bc, "tx-3", "active", "per_provider", lambda b: None)
        assert not lock.apply(bc, "tx-3", "active", "overall", lambda b: counter.add(b, amount=1000))


@BOTH
def test_failed_effect_releases_the_lock(mongo_env: MongoEnv, transactions: bool) -> None:
    store = mongo_env.store(2, transactions=transactions)
    lock = MongoStatsLock()

    def boom(bc: Any) -> None:
        raise ValueError("effect failed")

    with pytest.raises(ValueError):
        with store.documents(UserDocs, UID) as bc:
            lock.apply(bc, "e1", "active", "overall", boom)
    with store.documents(UserDocs, UID) as bc:
        assert lock.apply(bc, "e1", "active", "overall", lambda b: None)  # not taken by the failed delivery


def test_bad_arguments_are_refused(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(1)
    with pytest.raises(StatsError, match="slots"):
        MongoCounter("x", slots=0)
    with store.documents(UserDocs, UID, readonly=True) as bc:
        with pytest.raises(StatsError, match="readonly"):
            MongoCounter("x").add(bc, n=1)
    with store.documents(UserDocs, UID) as bc:
        with pytest.raises(StatsError, match="integer deltas"):
            MongoCounter("x").add(bc, n=1.5)
        with pytest.raises(StatsError, match="state"):
            MongoStatsLock().apply(bc, "e", "", "c", lambda b: None)


def test_bad_names_k_and_deltas_are_value_errors_naming_the_argument(mongo_env: MongoEnv) -> None:
    """Issue 18 on the MongoDB side: K given as True was taken as 1, a delta past 64 bits reached
    the driver, a control character went into an ``_id`` and a non-string event id hit len()."""
    store = mongo_env.store(1)
    with pytest.raises(StatsError, match=r"slots .* got True"):
        MongoCounter("x", slots=True)
    with pytest.raises(StatsError, match=r"counter name .*control character"):
        MongoCounter("vis\x00its")
    with store.documents(UserDocs, UID) as bc:
        with pytest.raises(StatsError, match=r"value 'n' .* 64-bit"):
            MongoCounter("x").add(bc, n=2**63)
        with pytest.raises(StatsError, match=r"event id .*control character"):
            MongoStatsLock().apply(bc, "tx\x1f1", "active", "overall", lambda b: None)
        with pytest.raises(StatsError, match=r"event id must be a string, got int"):
            MongoStatsLock().apply(bc, 5, "active", "overall", lambda b: None)  # type: ignore[arg-type]
        with pytest.raises(StatsError, match=r"state .*':'"):
            MongoStatsLock().apply(bc, "tx", "act:ive", "overall", lambda b: None)
        assert MongoCounter("x").read(bc) == {}
