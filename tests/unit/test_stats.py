"""Hot-data patterns on SQLite files: API rules, refusals, and snapshot + tail = replay (hypothesis).

The concurrency, late-commit and move tests run on real PostgreSQL in test_stats_pg.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from support.mapfiles import write_map
from sqlalchemy import func, select
from support.stats import (
    BC_COUNTERS,
    BC_LOCK,
    BC_LOG,
    BC_LOG_TABLES,
    CENTRAL_COUNTERS,
    CENTRAL_LOG,
    CENTRAL_LOCK,
    StakerBriefcase,
    create_staker,
    open_store,
)

from mdb.errors import CrossBriefcaseError, MdbError, RoutingError, StatsError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.hot import Counters, central, derived_gdid, run_snapshots
from mdb.hot.scope import Scope
from mdb.store import Store

ALICE = GDID(0, 0, 7)


@pytest.fixture
def store(tmp_path: Path, tmp_sqlite_urls) -> Store:
    c1, c2, u1, u2 = tmp_sqlite_urls(4)
    path = write_map(tmp_path, {"c1": c1, "c2": c2, "u1": u1, "u2": u2}, central=["c1", "c2"],
                     partitions=[("0:0:0", ["u1", "u2"])])
    s = open_store(path)
    assert all(r.ok for r in apply_schema(s))
    create_staker(s, ALICE)
    yield s
    s.close()


def test_derived_gdids_are_stable_and_marked() -> None:
    a = derived_gdid("counter", "tvl", 3)
    assert a == derived_gdid("counter", "tvl", 3) and a != derived_gdid("counter", "tvl", 4)
    assert a.authority == 15


def test_counter_adds_several_values_in_slots_and_reads_the_sum(store: Store) -> None:
    with store.briefcase(StakerBriefcase, ALICE) as s:
        assert BC_COUNTERS.configure(s, "stake", 4) == 4
    for _ in range(40):  # one transaction each: a transaction adds to one slot per counter
        with store.briefcase(StakerBriefcase, ALICE) as s:
            BC_COUNTERS.add(s, "stake", total_value_locked=10, staker_count=1)
    with store.briefcase(StakerBriefcase, ALICE) as s:
        BC_COUNTERS.add(s, "stake", total_value_locked=-5)
    with store.briefcase(StakerBriefcase, ALICE, readonly=True) as s:
        assert BC_COUNTERS.read(s, "stake") == {"total_value_locked": 395, "staker_count": 40}
        slots = BC_COUNTERS.slot_rows(s, "stake")
        assert set(slots) == {0, 1, 2, 3}  # K rows, created with K
        assert sum(1 for v in slots.values() if v["staker_count"]) > 1  # the writes did spread
        assert BC_COUNTERS.read(s, "never-written") == {"total_value_locked": 0, "staker_count": 0}


def test_counter_k_grows_but_never_shrinks(store: Store) -> None:
    with central(store, "tvl") as place:
        CENTRAL_COUNTERS.configure(place, "tvl", 8)
    with central(store, "tvl") as place, pytest.raises(StatsError, match=r"shrink K from 8 to 4.*orphaned"):
        CENTRAL_COUNTERS.configure(place, "tvl", 4)
    with central(store, "tvl") as place:
        assert CENTRAL_COUNTERS.slots(place, "tvl") == 8
        assert CENTRAL_COUNTERS.configure(place, "tvl", 16) == 16
        assert CENTRAL_COUNTERS.slots(place, "tvl") == 16


def test_first_write_persists_the_default_k_so_a_smaller_k_is_refused_later(store: Store) -> None:
    wide = Counters(CENTRAL_COUNTERS.tables, default_slots=16)
    with central(store, "wide") as place:
        wide.add(place, "wide", staker_count=1)
    with central(store, "wide") as place, pytest.raises(StatsError, match="orphaned"):
        CENTRAL_COUNTERS.configure(place, "wide", 2)


def test_bad_counter_input_is_refused_with_the_reason(store: Store) -> None:
    with central(store, "tvl") as place:
        with pytest.raises(StatsError, match="no values"):
            CENTRAL_COUNTERS.add(place, "tvl", votes=1)
        with pytest.raises(StatsError, match="nothing to add"):
            CENTRAL_COUNTERS.add(place, "tvl")
        with pytest.raises(StatsError, match="1..4096"):
            CENTRAL_COUNTERS.configure(place, "tvl", 0)


def test_places_refuse_the_wrong_table_shape_shard_or_mode(store: Store) -> None:
    other_key = next(k for k in (f"c{i}" for i in range(100)) if store.router.locate_central(k).server != store.router.locate_central("tvl").server)
    with central(store, "tvl") as place:
        with pytest.raises(RoutingError, match="lives on shard"):
            CENTRAL_COUNTERS.add(place, other_key, staker_count=1)
        with pytest.raises(CrossBriefcaseError, match="briefcase key"):
            BC_COUNTERS.add(place, "tvl", staker_count=1)
    with store.briefcase(StakerBriefcase, ALICE) as s:
        with pytest.raises(CrossBriefcaseError, match="not keyed by"):
            CENTRAL_COUNTERS.add(s, "tvl", staker_count=1)
    with store.briefcase(StakerBriefcase, ALICE, readonly=True) as s, pytest.raises(MdbError, match="readonly"):
        BC_COUNTERS.add(s, "stake", staker_count=1)
    conn = store.connect(store.router.locate_central("tvl").server)
    try:
        with pytest.raises(TypeError, match="bare connection"):
            CENTRAL_COUNTERS.add(conn, "tvl", staker_count=1)  # type: ignore[arg-type]
        with pytest.raises(MdbError, match="not in a transaction"):
            CENTRAL_COUNTERS.add(Scope(conn, "c1"), "tvl", staker_count=1)
    finally:
        conn.close()


def test_stats_lock_applies_each_calculation_once_and_new_kinds_later(store: Store) -> None:
    calls: list[str] = []
    with store.briefcase(StakerBriefcase, ALICE) as s:
        assert BC_LOCK.apply(s, "xyz", "active", "overall", lambda p: calls.append("overall"))
        assert not BC_LOCK.apply(s, "xyz", "active", "overall", lambda p: calls.append("again"))
        assert BC_LOCK.apply(s, "xyz", "unbonded", "overall", lambda p: calls.append("unbonded"))
    with store.briefcase(StakerBriefcase, ALICE) as s:
        assert not BC_LOCK.apply(s, "xyz", "active", "overall", lambda p: calls.append("again"))
        assert BC_LOCK.apply(s, "xyz", "active", "per_provider", lambda p: calls.append("per_provider"))
        assert BC_LOCK.applied(s, "xyz", "active") == {"overall", "per_provider"}
    assert calls == ["overall", "unbonded", "per_provider"]


def test_stats_lock_effect_that_raises_leaves_no_record(store: Store) -> None:
    def boom(place: Scope) -> None:
        CENTRAL_COUNTERS.add(place, "tvl", total_value_locked=100)
        raise RuntimeError("effect failed")

    with central(store, "tvl") as place:
        with pytest.raises(RuntimeError):
            CENTRAL_LOCK.apply(place, "e1", "active", "overall", boom)
        # the caller caught it and commits the rest of its transaction
    with central(store, "tvl") as place:
        assert CENTRAL_LOCK.applied(place, "e1", "active") == set()
        assert CENTRAL_COUNTERS.read(place, "tvl")["total_value_locked"] == 0
        assert CENTRAL_LOCK.apply(place, "e1", "active", "overall", lambda p: CENTRAL_COUNTERS.add(p, "tvl", total_value_locked=7))
        assert CENTRAL_COUNTERS.read(place, "tvl")["total_value_locked"] == 7


def test_event_log_append_is_idempotent_and_snapshots_are_incremental(store: Store) -> None:
    with store.briefcase(StakerBriefcase, ALICE) as s:
        assert BC_LOG.append(s, "ledger", GDID(0, 5, 1), "deposit", {"amount": 10})
        assert not BC_LOG.append(s, "ledger", GDID(0, 5, 1), "deposit", {"amount": 10})
        assert BC_LOG.append(s, "ledger", GDID(0, 5, 2), "deposit", {"amount": 5})
    results = run_snapshots(store, BC_LOG, "user")
    assert [(r.key, r.seq, r.folded) for r in results] == [(ALICE, 1, 2)]
    assert run_snapshots(store, BC_LOG, "user") == []  # nothing new: no snapshot
    with store.briefcase(StakerBriefcase, ALICE) as s:
        BC_LOG.append(s, "ledger", GDID(0, 5, 3), "withdrawal", {"amount": -3})
        read = BC_LOG.read(s, "ledger")
        assert (read.state, read.snapshot_seq, read.tail_events) == ({"events": 3, "amount": 12}, 1, 1)
        assert BC_LOG.snapshot(s, "ledger").seq == 2
        assert BC_LOG.read(s, "ledger").tail_events == 0
        marked = s.connection().execute(
            select(BC_LOG_TABLES.events.c.snapshot_seq, func.count()).group_by(BC_LOG_TABLES.events.c.snapshot_seq)
        ).all()
        assert sorted(marked) == [(1, 2), (2, 1)]


def test_event_log_refuses_a_non_gdid_id_and_a_non_integer_amount(store: Store) -> None:
    with store.briefcase(StakerBriefcase, ALICE) as s:
        with pytest.raises(StatsError, match="GDID"):
            BC_LOG.append(s, "ledger", "1", "deposit", {"amount": 1})  # type: ignore[arg-type]
        with pytest.raises(StatsError, match="must be an integer"):  # at append, not at the next read
            BC_LOG.append(s, "ledger", GDID(0, 5, 9), "deposit", {"amount": "lots"})
        assert BC_LOG.read(s, "ledger").state == {"events": 0, "amount": 0}


def test_run_snapshots_refuses_the_wrong_target(store: Store) -> None:
    with pytest.raises(StatsError, match="CENTRAL log"):
        run_snapshots(store, CENTRAL_LOG, "user")
    with pytest.raises(StatsError, match="lives in briefcases"):
        run_snapshots(store, BC_LOG, "central")


_ids = itertools.count(1000)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(st.integers(-50, 100), st.just("snap")), max_size=25))
def test_snapshot_plus_tail_equals_replay_for_any_schedule(store: Store, ops: list[int | str]) -> None:
    stream = f"s{next(_ids)}"
    expected = {"events": 0, "amount": 0}
    for op in ops:
        with central(store, stream) as place:
            if op == "snap":
                CENTRAL_LOG.snapshot(place, stream)
            else:
                assert isinstance(op, int)
                CENTRAL_LOG.append(place, stream, GDID(0, 6, next(_ids)), "vote", {"amount": op})
                expected = {"events": expected["events"] + 1, "amount": expected["amount"] + op}
            assert CENTRAL_LOG.read(place, stream).state == CENTRAL_LOG.replay(place, stream) == expected


def test_demo_balances_come_from_the_ledger_event_log(tmp_path: Path, tmp_sqlite_urls) -> None:
    from mdb.demo.models import LEDGER, User, UserBriefcase
    from mdb.demo.repositories import LedgerRepository

    c, u1 = tmp_sqlite_urls(2)
    path = write_map(tmp_path / "demo", {"c": c, "u1": u1}, central=["c"], partitions=[("0:0:0", ["u1"])])
    with Store.from_yaml(path, types=[UserBriefcase]) as demo:
        assert all(r.ok for r in apply_schema(demo))
        with demo.briefcase(UserBriefcase, ALICE) as s:
            s.add(User(user_id=ALICE, email="a@example.org", name="A"))
        ledger = LedgerRepository(demo)
        ledger.record_transaction(ALICE, 5000)
        ledger.record_transaction(ALICE, -1234)
        assert ledger.read_balance(ALICE) == 3766
        assert ledger.snapshot_balances() == 2
        ledger.record_transaction(ALICE, 10)
        with demo.briefcase(UserBriefcase, ALICE, readonly=True) as s:
            read = LEDGER.read(s, "ledger")
            assert (read.snapshot_seq, read.tail_events, read.state["amount_cents"]) == (1, 1, 3776)
        assert ledger.read_balance(ALICE) == 3776


def test_a_cached_k_belongs_to_its_database_not_to_a_server_name(tmp_path: Path, tmp_sqlite_urls) -> None:
    """One Counters serving two databases that share a server name (a changed URL, a restored
    copy): K=16 of the first must not become the second's K=1 counter's K. Keyed by the name,
    the cached 16 won over the second database's 1 and its writes made 16 slot rows there."""
    counters = Counters(CENTRAL_COUNTERS.tables)
    stores = []
    for n in range(2):
        folder = tmp_path / f"fleet{n}"
        folder.mkdir()
        c, u = tmp_sqlite_urls(2)
        stores.append(open_store(write_map(folder, {"c": c, "u": u}, central=["c"], partitions=[("0:0:0", ["u"])])))
        assert all(r.ok for r in apply_schema(stores[-1]))
    first, second = stores
    with central(first, "tvl") as place:
        counters.configure(place, "tvl", 16)
    with central(second, "tvl") as place:
        counters.configure(place, "tvl", 1)
    for _ in range(20):
        with central(second, "tvl") as place:
            counters.add(place, "tvl", total_value_locked=1)
    with central(second, "tvl") as place:
        assert set(counters.slot_rows(place, "tvl")) == {0}
        assert counters.read(place, "tvl")["total_value_locked"] == 20
    for s in stores:
        s.close()
