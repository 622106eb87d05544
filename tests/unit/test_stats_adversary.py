"""Hot-data patterns under an adversary (issue 18), on SQLite files: ambiguous or clashing
derived ids, payloads a fold cannot take, and bad arguments. Each test failed on the code
before its fix; the PostgreSQL-only ones (deadlocks, a K raise seen by a live writer) are in
test_stats_adversary_pg.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from sqlalchemy import delete, insert, select
from support.stats import (
    BC_COUNTERS,
    BC_LOCK,
    BC_LOCK_TABLES,
    BC_LOG,
    BC_LOG_TABLES,
    CENTRAL_COUNTERS,
    CENTRAL_LOCK,
    CENTRAL_LOG,
    StakerBriefcase,
    create_staker,
    declare_staker,
    open_store,
)
from typer.testing import CliRunner

from mdb.cli import app
from mdb.errors import FoldError, StatsError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.hot import central, derived_gdid, run_snapshots
from mdb.hot.tables import DERIVED_AUTHORITY
from mdb.store import Store

ALICE, BOB = GDID(0, 0, 7), GDID(0, 0, 8)


@pytest.fixture
def map_path(tmp_path: Path, tmp_sqlite_urls) -> Path:
    c1, c2, u1, u2 = tmp_sqlite_urls(4)
    path = write_map(tmp_path, {"c1": c1, "c2": c2, "u1": u1, "u2": u2}, central=["c1", "c2"],
                     partitions=[("0:0:0", ["u1", "u2"])])
    with open_store(path) as s:
        assert all(r.ok for r in apply_schema(s))
        create_staker(s, ALICE)
        create_staker(s, BOB)
    return path


@pytest.fixture
def store(map_path: Path) -> Any:
    with open_store(map_path) as s:
        yield s


def _old_derived_gdid(*parts: str | int) -> GDID:
    """The derivation as it was before issue 18 (parts joined with U+001F, nothing refused)."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode("utf-8"), digest_size=12).digest()
    return GDID(int.from_bytes(digest[:4], "big"), DERIVED_AUTHORITY, int.from_bytes(digest[4:], "big") & ((1 << 60) - 1))


# -- 1. derived ids: injective, and a clash raises ------------------------------------------------


def test_two_stats_lock_keys_that_shared_one_derived_id_are_refused_not_skipped(store: Store) -> None:
    """Before: ("a\\x1fb", "c") and ("a", "b\\x1fc") hashed to one lock id, so the second event's
    effect was skipped while applied() said it never ran. The separator inside a part is refused."""
    calls: list[str] = []
    with store.briefcase(StakerBriefcase, ALICE) as s:
        with pytest.raises(StatsError, match=r"event id .*control character"):
            BC_LOCK.apply(s, "a\x1fb", "c", "calc", lambda _p: calls.append("first"))
        with pytest.raises(StatsError, match=r"state .*control character"):
            BC_LOCK.apply(s, "a", "b\x1fc", "calc", lambda _p: calls.append("second"))
    assert calls == []
    with pytest.raises(StatsError, match="separator"):
        derived_gdid("stats-lock", "a\x1fb", "c", "calc")


def test_the_derivation_is_unchanged_for_every_id_it_accepts() -> None:
    """Existing rows keep their ids: the accepted inputs hash exactly as before."""
    for parts in (("counter", "tvl", 3), ("counter-config", "provider:p1"), ("snapshot", "ledger", 0),
                  ("stats-lock", "0xabc", "active", "overall"), ("stats-lock", "ü €", "s", "c")):
        assert derived_gdid(*parts) == _old_derived_gdid(*parts)


def test_a_stats_lock_id_held_by_another_event_raises_instead_of_counting_as_applied(store: Store) -> None:
    """A derived-id clash (a hash collision, or a row written under the ambiguous encoding) is an
    error, never "already applied": the lock row of ("x", "active", "overall") is taken by a
    row of another event."""
    locks = BC_LOCK_TABLES.locks
    with store.briefcase(StakerBriefcase, ALICE) as s:
        s.connection().execute(insert(locks).values(
            user_id=ALICE, lock_id=derived_gdid("stats-lock", "x", "active", "overall"),
            event_id="other event", state="active", calculation="overall"))
    calls: list[str] = []
    with store.briefcase(StakerBriefcase, ALICE) as s:
        with pytest.raises(StatsError, match=r"derived id .* already used by another row"):
            BC_LOCK.apply(s, "x", "active", "overall", lambda _p: calls.append("applied"))
        assert BC_LOCK.applied(s, "x", "active") == set()
    assert calls == []


def test_a_counter_slot_id_held_by_another_counter_raises_at_configure(store: Store) -> None:
    rows = CENTRAL_COUNTERS.tables.rows
    with central(store, "tvl") as place:
        place.conn.execute(insert(rows).values(row_id=derived_gdid("counter", "tvl", 1), counter="intruder", slot=0))
    with central(store, "tvl") as place, pytest.raises(StatsError, match=r"slot rows \[1\] .*derived id"):
        CENTRAL_COUNTERS.configure(place, "tvl", 4)


def test_a_snapshot_head_id_held_by_another_stream_raises(store: Store) -> None:
    snaps = CENTRAL_LOG.tables.snapshots
    with central(store, "votes") as place:
        place.conn.execute(insert(snaps).values(snapshot_id=derived_gdid("snapshot", "votes", 0), stream="intruder",
                                                seq=0, state={}, events=0, total_events=0))
        CENTRAL_LOG.append(place, "votes", GDID(0, 6, 1), "vote", {"amount": 1})
    with central(store, "votes") as place, pytest.raises(StatsError, match="derived id .* already used by another row"):
        CENTRAL_LOG.snapshot(place, "votes")


# -- 2. payloads are checked against the fold; a bad stream does not stop a pass -------------------


def test_append_refuses_a_payload_the_fold_cannot_take_naming_field_and_type(store: Store) -> None:
    with store.briefcase(StakerBriefcase, ALICE) as s:
        with pytest.raises(StatsError, match=r"payload field 'amount' must be an integer \(int\), got str '5'"):
            BC_LOG.append(s, "ledger", GDID(0, 5, 1), "deposit", {"amount": "5"})
        with pytest.raises(StatsError, match=r"payload .* is not JSON"):
            BC_LOG.append(s, "ledger", GDID(0, 5, 2), "deposit", {"amount": float("nan")})
        with pytest.raises(StatsError, match=r"payload must be a mapping"):
            BC_LOG.append(s, "ledger", GDID(0, 5, 3), "deposit", [("amount", 1)])  # type: ignore[arg-type]
        assert BC_LOG.append(s, "ledger", GDID(0, 5, 4), "deposit", {"amount": 5})
        assert BC_LOG.read(s, "ledger").state == {"events": 1, "amount": 5}


def _poison(store: Store, user: GDID, event: GDID) -> None:
    """An event the fold cannot take, written as data from before append-time checks would be."""
    with store.briefcase(StakerBriefcase, user) as s:
        s.connection().execute(insert(BC_LOG_TABLES.events).values(
            user_id=user, event_id=event, stream="ledger", kind="deposit", payload={"amount": "5"}))


def test_a_snapshot_pass_isolates_a_stream_it_cannot_fold_and_folds_the_others(store: Store) -> None:
    for n, user in enumerate((ALICE, BOB)):
        with store.briefcase(StakerBriefcase, user) as s:
            BC_LOG.append(s, "ledger", GDID(0, 5, 10 + n), "deposit", {"amount": 3})
    _poison(store, ALICE, GDID(0, 5, 99))
    results = run_snapshots(store, BC_LOG, "user")
    by_key = {r.key: r for r in results}
    assert (by_key[BOB].seq, by_key[BOB].folded, by_key[BOB].error) == (1, 1, None)
    bad = by_key[ALICE]
    assert (bad.seq, bad.folded) == (0, 0)
    assert bad.error is not None and "0:5:99" in bad.error and "'amount'" in bad.error and "ledger" in bad.error
    with store.briefcase(StakerBriefcase, ALICE, readonly=True) as s:
        with pytest.raises(FoldError, match=r"stream 'ledger' .* event 0:5:99"):
            BC_LOG.read(s, "ledger")
        unmarked = s.connection().execute(select(BC_LOG_TABLES.events.c.snapshot_seq)).scalars().all()
        assert set(unmarked) == {None}  # the failed pass rolled back: nothing claimed, nothing lost


def test_a_pass_isolates_a_stream_whose_name_cannot_be_written_any_more(store: Store) -> None:
    """A stream named with a control character (only the old code could store one) cannot get a
    snapshot row now; the pass reports it and still folds the other CENTRAL streams."""
    with central(store, "good") as place:
        CENTRAL_LOG.append(place, "good", GDID(0, 6, 1), "vote", {"amount": 2})
    legacy = "bad\x1fstream"
    with central(store, legacy) as place:
        place.conn.execute(insert(CENTRAL_LOG.tables.events).values(
            event_id=GDID(0, 6, 2), stream=legacy, kind="vote", payload={"amount": 1}))
    results = {r.stream: r for r in run_snapshots(store, CENTRAL_LOG, "central")}
    assert (results["good"].seq, results["good"].folded, results["good"].error) == (1, 1, None)
    assert results[legacy].folded == 0 and "control character" in (results[legacy].error or "")
    assert results[legacy].server == store.router.locate_central(legacy).server


def test_a_failed_fold_leaves_no_markers_even_when_the_caller_commits(store: Store) -> None:
    """Claim, fold and snapshot are one savepoint: before, a caller that caught the fold's
    error and committed kept the claim markers without their snapshot, and the next pass (which
    claims only unmarked events) dropped those events from every state."""
    with store.briefcase(StakerBriefcase, ALICE) as s:
        BC_LOG.append(s, "ledger", GDID(0, 5, 30), "deposit", {"amount": 6})
    _poison(store, ALICE, GDID(0, 5, 31))
    with store.briefcase(StakerBriefcase, ALICE) as s:
        with pytest.raises(FoldError, match="0:5:31"):
            BC_LOG.snapshot(s, "ledger")
        # the caller goes on and commits
    events = BC_LOG_TABLES.events
    with store.briefcase(StakerBriefcase, ALICE) as s:
        assert set(s.connection().execute(select(events.c.snapshot_seq)).scalars()) == {None}
        s.connection().execute(delete(events).where(events.c.event_id == GDID(0, 5, 31)))  # the operator's fix
    assert [(r.seq, r.folded) for r in run_snapshots(store, BC_LOG, "user")] == [(1, 1)]
    with store.briefcase(StakerBriefcase, ALICE, readonly=True) as s:
        assert BC_LOG.read(s, "ledger").state == BC_LOG.replay(s, "ledger") == {"events": 1, "amount": 6}


def test_mdb_snapshot_reports_the_stream_it_cannot_fold_by_briefcase_and_exits_1(
    map_path: Path, store: Store, request: pytest.FixtureRequest
) -> None:
    declare_staker(request)
    with store.briefcase(StakerBriefcase, BOB) as s:
        BC_LOG.append(s, "ledger", GDID(0, 5, 20), "deposit", {"amount": 4})
    _poison(store, ALICE, GDID(0, 5, 98))
    runner = CliRunner()
    got = runner.invoke(app, ["snapshot", str(map_path), "user", "--log", BC_LOG.name, "--json"])
    assert got.exit_code == 1, got.output
    data = json.loads(got.output)
    assert data["events_folded"] == 1
    assert [(f["stream"], f["key"]) for f in data["failed"]] == [("ledger", str(ALICE))]
    assert "0:5:98" in data["failed"][0]["error"]
    again = runner.invoke(app, ["snapshot", str(map_path), "user", "--log", BC_LOG.name])
    assert again.exit_code == 1
    assert "could not be folded" in again.output and str(ALICE) in again.output


# -- 5. bad arguments are mdb errors deriving from ValueError, naming the argument -----------------


def test_bad_arguments_are_value_errors_naming_the_argument(store: Store) -> None:
    with central(store, "tvl") as place:
        with pytest.raises(StatsError, match="counter id must be a string, got int"):
            CENTRAL_COUNTERS.add(place, 5, total_value_locked=1)  # type: ignore[arg-type]
        with pytest.raises(StatsError, match=r"slots \(K\) must be an integer .* got True"):
            CENTRAL_COUNTERS.configure(place, "tvl", True)
        with pytest.raises(StatsError, match=r"value 'total_value_locked' must be an integer .* got str"):
            CENTRAL_COUNTERS.add(place, "tvl", total_value_locked="5")  # type: ignore[arg-type]
        with pytest.raises(StatsError, match=r"value 'staker_count' .* 64-bit"):
            CENTRAL_COUNTERS.add(place, "tvl", staker_count=2**63)
        with pytest.raises(StatsError, match=r"event id .*control character '\\x00'"):
            CENTRAL_LOCK.apply(place, "ev\x00il", "active", "overall", lambda _p: None)
        with pytest.raises(StatsError, match=r"calculation must be a string, got int"):
            CENTRAL_LOCK.apply(place, "ev", "active", 7, lambda _p: None)  # type: ignore[arg-type]
    with store.briefcase(StakerBriefcase, ALICE) as s:
        with pytest.raises(StatsError, match="counter id .*control character"):
            BC_COUNTERS.add(s, "stake\n", staker_count=1)
        with pytest.raises(StatsError, match="event kind must be a string, got int"):
            BC_LOG.append(s, "ledger", GDID(0, 5, 1), 5, {"amount": 1})  # type: ignore[arg-type]
        with pytest.raises(StatsError, match="stream .*control character"):
            BC_LOG.append(s, "led\x00ger", GDID(0, 5, 1), "deposit", {"amount": 1})
    for exc in (StatsError("x"), FoldError("x", stream="s", server="c1", seq=0)):
        assert isinstance(exc, ValueError)
