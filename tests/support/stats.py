"""Shared by the hot-data tests (and importable by their spawned processes): a briefcase type
with every pattern's tables, the CENTRAL families, and worker functions. No tests here."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import pytest

from mdb.briefcase import BRIEFCASE_TYPES, BriefcaseType
from mdb.errors import RetryableError
from mdb.gdid import GDID
from mdb.sqltypes import GDIDType
from mdb.hot import Counters, EventLog, StatsLock, SumFold, central, counter_models, event_log_models, stats_lock_models
from mdb.hot.central_tables import CENTRAL_EVENT_LOG, CENTRAL_STATS_LOCK
from mdb.hot.tables import counter_tables
from mdb.store import Store
from mdb.registry import Registry, default_registry
from mdb.system_tables import central_metadata

VALUES = ("total_value_locked", "staker_count")


class StatsBase(DeclarativeBase):
    type_annotation_map = {GDID: GDIDType}


class Staker(StatsBase):
    __tablename__ = "stakers"
    user_id: Mapped[GDID] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))


BC_COUNTER_TABLES, BC_COUNTER_MODELS = counter_models(StatsBase, "staker_stats", VALUES, key_column="user_id")
BC_LOCK_TABLES, BC_LOCK_MODELS = stats_lock_models(StatsBase, "staker_stats_lock", key_column="user_id")
BC_LOG_TABLES, BC_LOG_MODELS = event_log_models(StatsBase, "staker_ledger", key_column="user_id")


STATS_REGISTRY = Registry()
"""The type is declared in a registry of its own: in the default one, other test modules'
in-process CLI runs (map diff --live, schema apply) would look for its tables on their servers."""


class StakerBriefcase(BriefcaseType, registry=STATS_REGISTRY):
    area = "user"
    key = "user_id"
    root = Staker
    children = (*BC_COUNTER_MODELS, *BC_LOCK_MODELS, *BC_LOG_MODELS)


REGISTRY_KEY = f"{StakerBriefcase.__module__}.{StakerBriefcase.__qualname__}"


def declare_staker(request: pytest.FixtureRequest) -> None:
    """StakerBriefcase in the default registry for one test, where the map's models: import would
    put it for an in-process `mdb` command."""
    default_registry.add(BRIEFCASE_TYPES, REGISTRY_KEY, StakerBriefcase)
    request.addfinalizer(lambda: default_registry.remove(BRIEFCASE_TYPES, REGISTRY_KEY))


CENTRAL_STAKE_TABLES = counter_tables(central_metadata, "test_stake_stats", VALUES)

FOLD = SumFold(("amount",))
BC_COUNTERS = Counters(BC_COUNTER_TABLES)
BC_LOCK = StatsLock(BC_LOCK_TABLES)
BC_LOG = EventLog(BC_LOG_TABLES, FOLD)
CENTRAL_COUNTERS = Counters(CENTRAL_STAKE_TABLES)
CENTRAL_LOCK = StatsLock(CENTRAL_STATS_LOCK)
CENTRAL_LOG = EventLog(CENTRAL_EVENT_LOG, FOLD)


def open_store(map_path: str | Path) -> Store:
    return Store.from_yaml(map_path, types=[StakerBriefcase])


def create_staker(store: Store, gdid: GDID) -> None:
    with store.briefcase(StakerBriefcase, gdid) as s:
        s.add(Staker(user_id=gdid, name=f"staker {gdid}"))


# -- workers (run in threads and in spawned processes) --------------------------------------------


def central_increments(map_path: str, counter: str, n: int, start: threading.Barrier | None = None) -> None:
    with open_store(map_path) as store:
        if start is not None:
            start.wait()
        for _ in range(n):
            with central(store, counter) as place:
                CENTRAL_COUNTERS.add(place, counter, total_value_locked=5, staker_count=1)


def briefcase_increments(map_path: str, gdid: str, counter: str, n: int, start: threading.Barrier | None = None) -> None:
    with open_store(map_path) as store:
        if start is not None:
            start.wait()
        for _ in range(n):
            with store.briefcase(StakerBriefcase, gdid) as s:
                BC_COUNTERS.add(s, counter, total_value_locked=5, staker_count=1)


def deliver_central(map_path: str, events: Sequence[tuple[str, str, int, str]], repeats: int) -> int:
    """Deliver each (event id, state, amount, provider) ``repeats`` times; returns applications made."""
    applied = 0
    with open_store(map_path) as store:
        for _ in range(repeats):
            for event_id, state, amount, provider in events:
                applied += deliver_one_central(store, event_id, state, amount, provider)
    return applied


def deliver_one_central(store: Store, event_id: str, state: str, amount: int, provider: str) -> int:
    sign = 1 if state == "active" else -1
    applied = 0
    with central(store, "tvl") as place:  # the effect's shard: the lock record lives with it
        applied += CENTRAL_LOCK.apply(
            place, event_id, state, "overall",
            lambda p: CENTRAL_COUNTERS.add(p, "tvl", total_value_locked=sign * amount, staker_count=sign),
        )
    counter = f"provider:{provider}"
    with central(store, counter) as place:
        applied += CENTRAL_LOCK.apply(
            place, event_id, state, "per_provider",
            lambda p: CENTRAL_COUNTERS.add(p, counter, total_value_locked=sign * amount, staker_count=sign),
        )
    return applied


def deliver_briefcase(map_path: str, gdid: str, events: Sequence[tuple[str, int]], repeats: int) -> int:
    applied = 0
    with open_store(map_path) as store:
        for _ in range(repeats):
            for event_id, amount in events:
                applied += deliver_one_briefcase(store, GDID.parse(gdid), event_id, amount)
    return applied


def deliver_one_briefcase(store: Store, gdid: GDID, event_id: str, amount: int) -> int:
    with store.briefcase(StakerBriefcase, gdid) as s:
        return int(BC_LOCK.apply(
            s, event_id, "active", "overall",
            lambda p: BC_COUNTERS.add(p, "stake", total_value_locked=amount, staker_count=1),
        ))


def append_events(map_path: str, gdid: str, ids: Sequence[int], amount: int) -> None:
    with open_store(map_path) as store:
        for i in ids:
            with store.briefcase(StakerBriefcase, gdid) as s:
                BC_LOG.append(s, "ledger", GDID(0, 5, i), "deposit", {"amount": amount})


def deliver_spreading(map_path: str, gdid: str, events: Sequence[tuple[str, int]], max_k_age: float) -> int:
    """Deliver each (event id, amount) once to counter ``kill`` through the stats lock, with a
    Counters that re-reads K every ``max_k_age`` s; re-runs a transaction on a RetryableError."""
    counters = Counters(BC_COUNTER_TABLES, max_k_age=max_k_age)
    applied = 0
    with open_store(map_path) as store:
        for event_id, amount in events:
            for attempt in range(50):
                try:
                    with store.briefcase(StakerBriefcase, gdid) as s:
                        applied += BC_LOCK.apply(
                            s, event_id, "active", "overall",
                            lambda p, amount=amount: counters.add(p, "kill", total_value_locked=amount, staker_count=1),
                        )
                    break
                except RetryableError:
                    if attempt == 49:
                        raise
    return applied
