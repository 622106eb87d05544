"""Hot-data patterns on real PostgreSQL: concurrency (threads and spawned processes), late
commits, concurrent snapshot jobs, the leaderboard fan-out, a briefcase move, and the CLI."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from support.pgbouncer import THROUGH_PGBOUNCER, Direct, Pooling
from sqlalchemy import delete, event, func, select
from support.stats import (
    BC_COUNTERS,
    BC_LOCK_TABLES,
    BC_LOG,
    BC_LOG_TABLES,
    CENTRAL_COUNTERS,
    CENTRAL_LOCK,
    CENTRAL_LOG,
    StakerBriefcase,
    append_events,
    declare_staker,
    briefcase_increments,
    central_increments,
    create_staker,
    deliver_briefcase,
    deliver_central,
    deliver_one_briefcase,
    open_store,
)
from typer.testing import CliRunner

from mdb.cli import app
from mdb.gdid import GDID
from mdb.moves import move_briefcase
from mdb.schema import apply_schema
from mdb.hot import Counters, central, run_snapshots
from mdb.hot.scope import Scope
from mdb.store import Store

SPAWN = multiprocessing.get_context("spawn")
USERS = [GDID(0, 0, i) for i in range(1, 7)]


@pytest.fixture
def map_path(pg_route: Direct | Pooling, tmp_path: Path) -> Path:
    """CENTRAL and two shards, reached directly or through PgBouncer (``pg_route``)."""
    c, u1, u2 = pg_route.databases(3)
    path = pg_route.write_map(tmp_path, {"c": c, "u1": u1, "u2": u2}, central=["c"], partitions=[("0:0:0", ["u1", "u2"])])
    with open_store(path) as store:
        assert all(r.ok for r in apply_schema(store))
        for g in USERS:
            create_staker(store, g)
    return path


@pytest.fixture
def store(map_path: Path) -> Iterator[Store]:
    with open_store(map_path) as s:
        yield s


def _run_concurrently(thread_jobs: list[Callable[[], Any]], process_jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
    """Start the processes (spawn), then the threads; return every job's result."""
    with ProcessPoolExecutor(max_workers=max(len(process_jobs), 1), mp_context=SPAWN) as procs, \
            ThreadPoolExecutor(max_workers=max(len(thread_jobs), 1)) as threads:
        futures = [procs.submit(fn, *args) for fn, args in process_jobs]
        futures += [threads.submit(job) for job in thread_jobs]
        return [f.result() for f in futures]


def _in_lockstep(threads: int, rounds: int, step: Callable[[int], Any]) -> list[tuple[int, Any]]:
    """Run ``step(r)`` in ``threads`` threads, all released together for each round r.

    Returns (round, result) of every call; raises the first real error (a failing thread
    aborts the barrier so the others stop at once instead of waiting for it).
    """
    barrier = threading.Barrier(threads)
    done: list[tuple[int, Any]] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            for r in range(rounds):
                barrier.wait(30)
                result = step(r)
                with lock:
                    done.append((r, result))
        except BaseException:
            barrier.abort()
            raise

    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(run) for _ in range(threads)]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return done


# -- 1. sharded counters -------------------------------------------------------------------------


@pytest.mark.slow  # 59 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
@pytest.mark.parametrize(("pg_route", "k"), [("direct", 1), ("direct", 16), ("pgbouncer", 16)], indirect=["pg_route"])
def test_counter_totals_exact_after_concurrent_increments(map_path: Path, store: Store, k: int) -> None:
    user = USERS[0]
    with central(store, "hot") as place:
        CENTRAL_COUNTERS.configure(place, "hot", k)
    with store.briefcase(StakerBriefcase, user) as s:
        BC_COUNTERS.configure(s, "hot", k)
    threads, per_thread, procs, per_proc = 6, 40, 2, 60
    barrier = threading.Barrier(threads * 2)
    jobs: list[Callable[[], Any]] = []
    for _ in range(threads):
        jobs.append(lambda: central_increments(str(map_path), "hot", per_thread, barrier))
        jobs.append(lambda: briefcase_increments(str(map_path), str(user), "hot", per_thread, barrier))
    process_jobs = [(central_increments, (str(map_path), "hot", per_proc)) for _ in range(procs)]
    process_jobs += [(briefcase_increments, (str(map_path), str(user), "hot", per_proc)) for _ in range(procs)]
    _run_concurrently(jobs, process_jobs)
    n = threads * per_thread + procs * per_proc
    with central(store, "hot") as place:
        assert CENTRAL_COUNTERS.read(place, "hot") == {"total_value_locked": 5 * n, "staker_count": n}
        central_slots = CENTRAL_COUNTERS.slot_rows(place, "hot")
    with store.briefcase(StakerBriefcase, user, readonly=True) as s:
        assert BC_COUNTERS.read(s, "hot") == {"total_value_locked": 5 * n, "staker_count": n}
        bc_slots = BC_COUNTERS.slot_rows(s, "hot")
    for slots in (central_slots, bc_slots):
        assert set(slots) == set(range(k))  # K rows, created with K
        assert sum(v["staker_count"] for v in slots.values()) == n
        if k > 1:
            assert sum(1 for v in slots.values() if v["staker_count"]) > 1  # the writes did spread



@pytest.mark.slow  # 31 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
@THROUGH_PGBOUNCER
def test_simultaneous_first_increments_of_a_new_counter_never_raise(store: Store) -> None:
    """Writers released together make the first increments of configured counters (K = 1: one slot).

    A slot row is unique by its derived primary key and by (counter, slot); two first inserts
    used to collide on the index the upsert does not target and raise. ``configure`` now
    creates the K rows, so increments only update.
    """
    threads, rounds = 8, 80
    counters = Counters(CENTRAL_COUNTERS.tables)
    for r in range(rounds):
        with central(store, f"fresh{r}") as place:
            counters.configure(place, f"fresh{r}", 1)  # every writer on the one slot

    def increment(r: int) -> None:
        with central(store, f"fresh{r}") as place:
            counters.add(place, f"fresh{r}", total_value_locked=1)

    _in_lockstep(threads, rounds, increment)
    for r in range(rounds):
        with central(store, f"fresh{r}") as place:
            assert counters.read(place, f"fresh{r}")["total_value_locked"] == threads


def test_an_increment_is_one_update_of_its_slot_row_never_an_insert(store: Store) -> None:
    """The slot rows exist from ``configure``; an increment only UPDATEs one of them.

    Why it matters: a slot row is unique twice, by its derived primary key and by (counter,
    slot). ``INSERT .. ON CONFLICT (counter, slot) DO UPDATE`` pre-checks only that arbiter
    index; under contention the pre-check can miss a row between two versions and the insert
    then raises ``UniqueViolation`` on the primary key (CI saw it with 8 writers on K = 1; raw
    psycopg, 16 writers x 1,000 upserts on one row, raised 5-16 times per run). An UPDATE waits
    on the row lock and re-reads the row, so it cannot raise that way.
    """
    with central(store, "shape") as place:
        CENTRAL_COUNTERS.configure(place, "shape", 4)
    for _ in range(8):
        with central(store, "shape") as place:
            sent: list[str] = []

            def record(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
                sent.append(statement)

            event.listen(place.conn, "before_cursor_execute", record)
            CENTRAL_COUNTERS.add(place, "shape", total_value_locked=5, staker_count=1)
            event.remove(place.conn, "before_cursor_execute", record)
            assert len(sent) == 1 and sent[0].lstrip().upper().startswith("UPDATE"), sent
    with central(store, "shape") as place:
        assert CENTRAL_COUNTERS.read(place, "shape") == {"total_value_locked": 40, "staker_count": 8}


def test_an_increment_recreates_missing_slot_rows(store: Store) -> None:
    """Slot rows missing under a persisted K (data from before K created them, or rows deleted
    by hand) are created at zero on the next increment, which then lands."""
    rows = CENTRAL_COUNTERS.tables.rows
    with central(store, "gone") as place:
        CENTRAL_COUNTERS.configure(place, "gone", 3)
        place.conn.execute(delete(rows).where(rows.c.counter == "gone"))
    counters = Counters(CENTRAL_COUNTERS.tables)  # a fresh process: K read from the config row
    with central(store, "gone") as place:
        counters.add(place, "gone", total_value_locked=7, staker_count=1)
    with central(store, "gone") as place:
        assert counters.read(place, "gone") == {"total_value_locked": 7, "staker_count": 1}
        assert sorted(counters.slot_rows(place, "gone")) == [0, 1, 2]


def test_k_shrink_is_refused_on_postgres(store: Store) -> None:
    with store.briefcase(StakerBriefcase, USERS[1]) as s:
        BC_COUNTERS.configure(s, "c", 8)
    from mdb.errors import StatsError

    with pytest.raises(StatsError, match="orphaned"), store.briefcase(StakerBriefcase, USERS[1]) as s:
        BC_COUNTERS.configure(s, "c", 2)
    with store.briefcase(StakerBriefcase, USERS[1], readonly=True) as s:
        assert BC_COUNTERS.slots(s, "c") == 8


# -- 2. stats lock ---------------------------------------------------------------------------------


@pytest.mark.slow  # 53 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
@THROUGH_PGBOUNCER
def test_each_calculation_applied_exactly_once_under_concurrent_redelivery(map_path: Path, store: Store) -> None:
    events = [(f"tx{i:03d}", "active", 10 + i, f"p{i % 3}") for i in range(24)]
    events += [(eid, "unbonded", amount, provider) for eid, _s, amount, provider in events[:8]]
    user = USERS[2]
    bc_events = [(f"bx{i}", 3 + i) for i in range(15)]
    thread_jobs: list[Callable[[], Any]] = [lambda: deliver_central(str(map_path), events, 2) for _ in range(4)]
    thread_jobs += [lambda: deliver_briefcase(str(map_path), str(user), bc_events, 2) for _ in range(3)]
    process_jobs = [(deliver_central, (str(map_path), events, 1)), (deliver_briefcase, (str(map_path), str(user), bc_events, 1))]
    results = _run_concurrently(thread_jobs, process_jobs)
    central_applied = results[0] + sum(results[2 : 2 + 4])
    bc_applied = results[1] + sum(results[2 + 4 :])
    assert central_applied == 2 * len(events)  # each (event, state) x 2 calculations, once
    assert bc_applied == len(bc_events)
    tvl = sum(a for _e, s, a, _p in events if s == "active") - sum(a for _e, s, a, _p in events if s == "unbonded")
    stakers = sum(1 if s == "active" else -1 for _e, s, _a, _p in events)
    with central(store, "tvl") as place:
        assert CENTRAL_COUNTERS.read(place, "tvl") == {"total_value_locked": tvl, "staker_count": stakers}
        assert "overall" in CENTRAL_LOCK.applied(place, "tx000", "active")  # per_provider too when its shard is this one
    per_provider = 0
    for p in ("p0", "p1", "p2"):
        with central(store, f"provider:{p}") as place:
            per_provider += CENTRAL_COUNTERS.read(place, f"provider:{p}")["total_value_locked"]
    assert per_provider == tvl
    with store.briefcase(StakerBriefcase, user, readonly=True) as s:
        assert BC_COUNTERS.read(s, "stake") == {"total_value_locked": sum(a for _e, a in bc_events), "staker_count": len(bc_events)}
        locks = s.connection().execute(select(func.count()).select_from(BC_LOCK_TABLES.locks)).scalar_one()
        assert locks == len(bc_events)



@THROUGH_PGBOUNCER
def test_simultaneous_first_deliveries_never_raise(store: Store) -> None:
    """Threads released together deliver the same events: one applies each, none gets an error.

    The lock row is unique twice over (primary key on the derived lock id, and the natural
    triple); simultaneous inserts can collide on either index, so a conflict target naming
    only one of them let the other raise a UniqueViolation.
    """
    threads, rounds = 6, 25

    def deliver(r: int) -> bool:
        with central(store, f"race{r}") as place:
            return CENTRAL_LOCK.apply(place, f"race{r}", "active", "overall", lambda _p: None)

    applied = _in_lockstep(threads, rounds, deliver)
    assert sorted(r for r, ok in applied if ok) == list(range(rounds))
    assert len(applied) == threads * rounds


# -- 3. event log + snapshots ----------------------------------------------------------------------


@THROUGH_PGBOUNCER
def test_a_late_commit_is_not_skipped_by_a_snapshot(store: Store) -> None:
    user = USERS[0]
    with store.briefcase(StakerBriefcase, user) as late:
        BC_LOG.append(late, "ledger", GDID(0, 5, 1), "deposit", {"amount": 1000})  # smallest id, commits last
        for i in range(2, 6):
            with store.briefcase(StakerBriefcase, user) as s:
                BC_LOG.append(s, "ledger", GDID(0, 5, i), "deposit", {"amount": i})
        first = run_snapshots(store, BC_LOG, "user")  # runs while `late` is open: must not wait for it
        assert [(r.seq, r.folded) for r in first] == [(1, 4)]
    with store.briefcase(StakerBriefcase, user, readonly=True) as s:
        read = BC_LOG.read(s, "ledger")
        assert read.state == {"events": 5, "amount": 1014} == BC_LOG.replay(s, "ledger")
        assert (read.snapshot_seq, read.tail_events) == (1, 1)
    assert [(r.seq, r.folded) for r in run_snapshots(store, BC_LOG, "user")] == [(2, 1)]
    with store.briefcase(StakerBriefcase, user, readonly=True) as s:
        assert BC_LOG.read(s, "ledger") .state == {"events": 5, "amount": 1014}


_ids = itertools.count(10_000)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(-20, 50)),
        st.tuples(st.just("open_late"), st.integers(-20, 50)),
        st.tuples(st.just("commit_late"), st.integers(0, 3)),
        st.tuples(st.just("rollback_late"), st.integers(0, 3)),
        st.tuples(st.just("snap"), st.just(0)),
    ),
    max_size=16,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_snapshot_plus_tail_equals_full_replay_with_late_commits(store: Store, ops: list[tuple[str, int]]) -> None:
    stream = f"votes-{next(_ids)}"
    server = store.router.locate_central(stream).server
    committed = 0
    count = 0
    open_txns: list[tuple[Any, int]] = []

    def check() -> None:
        with central(store, stream) as place:
            expected = {"events": count, "amount": committed}
            assert CENTRAL_LOG.read(place, stream).state == expected
            assert CENTRAL_LOG.replay(place, stream) == expected

    try:
        for op, value in ops:
            if op == "append":
                with central(store, stream) as place:
                    CENTRAL_LOG.append(place, stream, GDID(0, 6, next(_ids)), "vote", {"amount": value})
                committed, count = committed + value, count + 1
            elif op == "open_late":
                conn = store.connect(server)
                conn.begin()
                CENTRAL_LOG.append(Scope(conn, server, store=store), stream, GDID(0, 6, next(_ids)), "vote", {"amount": value})
                open_txns.append((conn, value))
            elif op in ("commit_late", "rollback_late") and open_txns:
                conn, amount = open_txns.pop(value % len(open_txns))
                if op == "commit_late":
                    conn.commit()
                    committed, count = committed + amount, count + 1
                else:
                    conn.rollback()
                conn.close()
            elif op == "snap":
                with central(store, stream) as place:
                    CENTRAL_LOG.snapshot(place, stream)
            check()
        while open_txns:
            conn, amount = open_txns.pop()
            conn.commit()
            conn.close()
            committed, count = committed + amount, count + 1
        check()
        with central(store, stream) as place:
            CENTRAL_LOG.snapshot(place, stream)
            assert CENTRAL_LOG.read(place, stream).tail_events == 0
        check()
    finally:
        for conn, _ in open_txns:
            conn.close()


@pytest.mark.slow  # 39 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
@THROUGH_PGBOUNCER
def test_snapshot_jobs_run_concurrently_with_writers_and_each_other(map_path: Path, store: Store) -> None:
    users = USERS[:4]
    per_writer = 40
    stop = threading.Event()
    passes: list[int] = []

    def snapshotter() -> None:
        with open_store(map_path) as own:
            while not stop.is_set():
                passes.append(len(run_snapshots(own, BC_LOG, "user")))

    def writer(w: int) -> None:
        append_events(str(map_path), str(users[w % len(users)]), range(w * 1000, w * 1000 + per_writer), w + 1)

    snaps = [threading.Thread(target=snapshotter) for _ in range(2)]
    for t in snaps:
        t.start()
    try:
        process_jobs = [(append_events, (str(map_path), str(users[0]), range(90_000, 90_000 + per_writer), 7))]
        _run_concurrently([lambda w=w: writer(w) for w in range(6)], process_jobs)
    finally:
        stop.set()
        for t in snaps:
            t.join()
    run_snapshots(store, BC_LOG, "user")
    expected: dict[GDID, dict[str, int]] = {u: {"events": 0, "amount": 0} for u in users}
    for w in range(6):
        e = expected[users[w % len(users)]]
        e["events"] += per_writer
        e["amount"] += per_writer * (w + 1)
    expected[users[0]]["events"] += per_writer
    expected[users[0]]["amount"] += per_writer * 7
    snaps_t, ev = BC_LOG_TABLES.snapshots, BC_LOG_TABLES.events
    for u in users:
        with store.briefcase(StakerBriefcase, u, readonly=True) as s:
            read = BC_LOG.read(s, "ledger")
            assert read.state == BC_LOG.replay(s, "ledger") == expected[u]
            assert read.tail_events == 0
            conn = s.connection()
            seqs = conn.execute(select(snaps_t.c.seq, snaps_t.c.events, snaps_t.c.total_events).where(snaps_t.c.user_id == u).order_by(snaps_t.c.seq)).all()
            assert [r[0] for r in seqs] == list(range(len(seqs)))  # 0 (head), 1, 2, ... no gaps, no duplicates
            marked = dict(conn.execute(select(ev.c.snapshot_seq, func.count()).where(ev.c.user_id == u).group_by(ev.c.snapshot_seq)).all())
            assert all(marked.get(seq, 0) == n for seq, n, _total in seqs[1:])  # each snapshot folded exactly its marked events
            assert seqs[-1][2] == expected[u]["events"]
    assert sum(passes) > 0


def test_leaderboard_fans_out_over_the_shards(store: Store) -> None:
    for n, u in enumerate(USERS):
        for i in range(n + 1):
            with store.briefcase(StakerBriefcase, u) as s:
                BC_LOG.append(s, "ledger", GDID(0, 7, n * 100 + i), "vote", {"amount": (n + 1) * 10})
        if n % 2:
            run_snapshots(store, BC_LOG, "user")
    assert {store.router.locate("user", u).server for u in USERS} == {"u1", "u2"}
    board = BC_LOG.read_all(store, "user", "ledger")
    assert board == {u: {"events": n + 1, "amount": (n + 1) * (n + 1) * 10} for n, u in enumerate(USERS)}
    ranking = sorted(board, key=lambda u: -board[u]["amount"])
    assert ranking[0] == USERS[-1]


# -- moves -------------------------------------------------------------------------------------------


def _rows(store: Store, server: str, user: GDID) -> dict[str, int]:
    out = {}
    with store.transaction(server) as conn:
        for t in StakerBriefcase.tables:
            out[t.name] = conn.execute(select(func.count()).select_from(t).where(t.c.user_id == user)).scalar_one()
    return out


@pytest.mark.slow  # 20 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
@THROUGH_PGBOUNCER
def test_a_move_carries_log_snapshots_counters_and_locks_and_duplicates_stay_applied_once(map_path: Path, store: Store) -> None:
    user = USERS[0]
    source = store.router.locate("user", user).server
    target = "u2" if source == "u1" else "u1"
    with store.briefcase(StakerBriefcase, user) as s:
        BC_COUNTERS.configure(s, "stake", 8)
    deliveries = [(f"mv{i}", 100 + i) for i in range(10)]
    for eid, amount in deliveries:
        assert deliver_one_briefcase(store, user, eid, amount) == 1
    for i in range(10):
        with store.briefcase(StakerBriefcase, user) as s:
            BC_LOG.append(s, "ledger", GDID(0, 5, 500 + i), "deposit", {"amount": i})
    run_snapshots(store, BC_LOG, "user")
    for i in range(10, 13):
        with store.briefcase(StakerBriefcase, user) as s:
            BC_LOG.append(s, "ledger", GDID(0, 5, 500 + i), "deposit", {"amount": i})
    with store.briefcase(StakerBriefcase, user, readonly=True) as s:
        before_counter = BC_COUNTERS.read(s, "stake")
        before_read = BC_LOG.read(s, "ledger")
        ids_before = set(s.connection().execute(select(BC_LOG_TABLES.events.c.event_id).where(BC_LOG_TABLES.events.c.user_id == user)).scalars())
    rows_before = _rows(store, source, user)
    assert all(rows_before[t.name] > 0 for t in StakerBriefcase.tables)

    result = move_briefcase(store, "user", user, target)
    assert result.status == "done"
    assert _rows(store, target, user) == rows_before
    assert set(_rows(store, source, user).values()) == {0}

    with open_store(map_path) as fresh:  # a new process's view: routed to the target
        assert fresh.router.locate("user", user).server == target
        with ThreadPoolExecutor(4) as pool:  # duplicates after the move, concurrently
            applied = list(pool.map(lambda d: deliver_one_briefcase(fresh, user, *d), deliveries * 3))
        assert sum(applied) == 0
        with fresh.briefcase(StakerBriefcase, user) as s:
            assert not BC_LOG.append(s, "ledger", GDID(0, 5, 505), "deposit", {"amount": 5})  # redelivered append
            assert BC_COUNTERS.read(s, "stake") == before_counter
            assert BC_COUNTERS.slots(s, "stake") == 8
            after = BC_LOG.read(s, "ledger")
            assert (after.state, after.snapshot_seq, after.tail_events) == (before_read.state, before_read.snapshot_seq, 3)
            ids_after = set(s.connection().execute(select(BC_LOG_TABLES.events.c.event_id).where(BC_LOG_TABLES.events.c.user_id == user)).scalars())
            assert ids_after == ids_before
        assert [(r.seq, r.folded, r.server) for r in run_snapshots(fresh, BC_LOG, "user")] == [(2, 3, target)]
        with fresh.briefcase(StakerBriefcase, user) as s:
            assert BC_LOG.read(s, "ledger").state == BC_LOG.replay(s, "ledger") == before_read.state
            assert deliver_one_briefcase(fresh, user, "new-after-move", 1) == 1


# -- CLI ---------------------------------------------------------------------------------------------


def test_mdb_snapshot_cli_folds_briefcase_and_central_streams(map_path: Path, store: Store, request: pytest.FixtureRequest) -> None:
    declare_staker(request)
    for n, u in enumerate(USERS[:3]):
        with store.briefcase(StakerBriefcase, u) as s:
            BC_LOG.append(s, "ledger", GDID(0, 8, n), "deposit", {"amount": 1})
    with central(store, "network") as place:
        CENTRAL_LOG.append(place, "network", GDID(0, 8, 99), "vote", {"amount": 3})
    runner = CliRunner()
    got = runner.invoke(app, ["snapshot", str(map_path), "user", "--log", BC_LOG.name, "--json"])
    assert got.exit_code == 0, got.output
    data = json.loads(got.output)
    assert data["events_folded"] == 3 and {s["key"] for s in data["snapshots"]} == {str(u) for u in USERS[:3]}
    got = runner.invoke(app, ["snapshot", str(map_path), "central", "--log", CENTRAL_LOG.name, "--stream", "network"])
    assert got.exit_code == 0, got.output
    assert "1 snapshots written, 1 events folded" in got.output
    again = runner.invoke(app, ["snapshot", str(map_path), "user", "--log", BC_LOG.name, "--json"])
    assert json.loads(again.output)["events_folded"] == 0
    bad = runner.invoke(app, ["snapshot", str(map_path), "nowhere"])
    assert bad.exit_code == 2 and "not an area" in bad.output
