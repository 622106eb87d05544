"""A reshard's plan counts the rows of the briefcases that move, and of no other.

The plan runs several times per reshard (the first plan, a re-plan after each online sweep, one
inside the freeze where the partition's writes wait) and the later ones find almost nothing to
move: they must not aggregate the partition's tables. On real PostgreSQL shards (and on SQLite
files, the IN-list path of the same statement): the movers' counts are exact while the same
tables hold rows of briefcases that stay; a plan where nothing moves sends no counting
statement at all; movers are counted in blocks of at most ``COUNT_BLOCK``, each once; a
briefcase on two servers and an incoming copy are what they were. The document scan (fake
MongoDB) answers the same two questions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from support.moves import add_transaction, create_user, make_cluster
from sqlalchemy import event, func, insert, select
from support.documents import Env

from mdb.demo.models import User, UserBriefcase
from mdb.errors import RoutingError
from mdb.gdid import GDID
from mdb.moves import plan as plan_module
from mdb.moves.plan import PartitionScan, ReshardPlan, ServerScan, plan_reshard, scan_for
from mdb.moves.sql_steps import set_state
from mdb.partition_map import parse_map
from mdb.router import Router
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.system_tables import STATE_INCOMING

START = GDID(0, 0, 0)
USERS = [GDID(0, 0, i) for i in range(1, 31)]


def _home(g: GDID, shards: Sequence[str]) -> str:
    return shards[g.sharding_value % len(shards)]


@pytest.fixture(params=["postgresql", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Shards a and b (x empty) holding USERS by default routing, each with its own number of rows."""
    if request.param == "postgresql":
        urls = dict(zip(["c", "a", "b", "x"], request.getfixturevalue("pg_databases")(4)))
    else:
        urls = {name: f"sqlite:///{tmp_path / name}.db" for name in ["c", "a", "b", "x"]}
    cluster = make_cluster(urls, tmp_path, [("0:0:0", ["a", "b"])])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g, orders=g.counter % 3, lines=g.counter % 4)
            for t in range(g.counter % 5):
                add_transaction(store, g, g.counter * 100 + t, t)
        yield store


def _rows_of(store: Store, server: str, g: GDID) -> dict[str, int]:
    """Rows of ``g`` per table on ``server``, each table counted on its own (what the plan must match)."""
    with store.transaction(server) as conn:
        return {t.name: conn.execute(select(func.count()).select_from(t).where(t.c.user_id == g)).scalar_one() for t in UserBriefcase.tables}


class _Asked:
    """Wraps a scan: records every ``rows`` request its servers' reads get (server, briefcases)."""

    def __init__(self, scan: PartitionScan, monkeypatch: pytest.MonkeyPatch) -> None:
        self.requests: list[tuple[str, list[GDID]]] = []
        reading = scan.reading

        @contextmanager
        def recorded(server: str) -> Iterator[ServerScan]:
            with reading(server) as read:
                rows = read.rows

                def asked(gdids: Sequence[GDID]) -> list[dict[str, int]]:
                    self.requests.append((server, list(gdids)))
                    return rows(gdids)

                monkeypatch.setattr(read, "rows", asked)
                yield read

        monkeypatch.setattr(scan, "reading", recorded)


@contextmanager
def _statements(store: Store, servers: Sequence[str]) -> Iterator[list[str]]:
    """Every SQL statement sent to ``servers`` meanwhile (SQLAlchemy's before_cursor_execute)."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    engines = [store.engine(server) for server in servers]
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


def test_movers_counts_are_exact_next_to_rows_of_briefcases_that_stay(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    scan = scan_for(store, "user", "a")
    asked = _Asked(scan, monkeypatch)
    new = ["a", "b", "x"]
    plan = plan_reshard(store, scan, "user", START, new)

    movers = {g: _home(g, ["a", "b"]) for g in USERS if _home(g, ["a", "b"]) != _home(g, new)}
    assert 0 < len(movers) < len(USERS)  # the tables hold rows of briefcases that stay too
    assert plan.briefcases_in_partition == len(USERS)
    assert [(m.gdid, m.source, m.target) for m in plan.moves] == sorted(
        ((g, src, _home(g, new)) for g, src in movers.items()), key=lambda t: (t[1], t[0]))
    expected = {g: _rows_of(store, src, g) for g, src in movers.items()}
    assert {m.gdid: m.rows for m in plan.moves} == expected
    assert any(sum(r.values()) > 1 for r in expected.values()) and any(r["orders"] == 0 for r in expected.values())
    totals = {t.name: sum(r[t.name] for r in expected.values()) for t in UserBriefcase.tables}
    assert plan.rows_per_table() == totals and plan.total_rows == sum(totals.values())
    pairs: dict[tuple[str, str], tuple[int, int]] = {}
    for g, src in movers.items():
        n, rows = pairs.get((src, _home(g, new)), (0, 0))
        pairs[(src, _home(g, new))] = (n + 1, rows + sum(expected[g].values()))
    assert plan.pairs() == pairs
    # Only movers were asked about, each once, by the server that holds it.
    assert sorted((g, server) for server, gdids in asked.requests for g in gdids) == sorted(movers.items())


def test_a_plan_where_nothing_moves_counts_no_rows(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-plans of a reshard (after a sweep, in the freeze): the keys are read, no table aggregated."""
    scan = scan_for(store, "user", "a")
    asked = _Asked(scan, monkeypatch)
    with _statements(store, ["a", "b"]) as sent:
        plan = plan_reshard(store, scan, "user", START, ["a", "b"])
    assert (plan.briefcases_in_partition, plan.briefcases_to_move, plan.moves, plan.total_rows) == (len(USERS), 0, [], 0)
    assert asked.requests == []
    counting = [s for s in sent if "count(" in s.lower()]
    assert counting == [], counting
    assert any("users" in s and "ORDER BY" in s for s in sent)  # the keys were read


def test_movers_are_counted_in_blocks_each_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run (keep_moves=False) holds at most a block of movers per server; totals equal the kept plan's."""
    monkeypatch.setattr(plan_module, "COUNT_BLOCK", 3)
    scan = scan_for(store, "user", "a")
    kept = plan_reshard(store, scan, "user", START, ["a", "b", "x"])
    asked = _Asked(scan, monkeypatch)
    dry = plan_reshard(store, scan, "user", START, ["a", "b", "x"], keep_moves=False)
    assert dry.moves == [] and len(asked.requests) > 2
    assert all(1 <= len(gdids) <= 3 for _, gdids in asked.requests)
    counted = [g for _, gdids in asked.requests for g in gdids]
    assert sorted(counted) == sorted(m.gdid for m in kept.moves)
    assert _totals(dry) == _totals(kept)


def _totals(plan: ReshardPlan) -> tuple[Any, ...]:
    return plan.briefcases_in_partition, plan.briefcases_to_move, plan.rows_per_table(), plan.pairs(), plan.total_rows


def test_an_incoming_copy_is_not_the_servers_and_a_briefcase_on_two_servers_is_refused(store: Store) -> None:
    scan = scan_for(store, "user", "a")
    g = next(u for u in USERS if _home(u, ["a", "b"]) == "a" and _home(u, ["a", "b", "x"]) != "a")
    with store.transaction("b") as conn:  # g's root row on b as well: the copy of a move in progress
        conn.execute(insert(User.__table__).values(user_id=g, email="copy", name="copy"))
        set_state(conn, "user", g, STATE_INCOMING, "a", "m1")
    plan = plan_reshard(store, scan, "user", START, ["a", "b", "x"])
    assert [m.source for m in plan.moves if m.gdid == g] == ["a"]
    assert plan.briefcases_in_partition == len(USERS)
    with store.transaction("b") as conn:
        set_state(conn, "user", g, "resident", "a", "m1")
    with pytest.raises(RoutingError, match=rf"briefcase user/{g} has rows on both 'a' and 'b'"):
        plan_reshard(store, scan, "user", START, ["a", "b", "x"])


# -- documents -------------------------------------------------------------------------------------


def test_the_document_scan_streams_keys_in_order_and_counts_the_movers_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mongomock_ng")
    env = Env(tmp_path, shards=("m1", "m2", "m3"))  # the document type the other document tests use
    store = env.store()
    assert all(r.ok for r in apply_schema(store))
    users = [GDID(0, 0, i) for i in range(1, 19)]
    for n, uid in enumerate(users):
        with store.documents(env.dtype, uid) as bc:
            bc.root.insert_one({"email": f"{n}@x"})
            if n % 4:
                bc["orders"].insert_many([{"_id": GDID(0, 1, 100 * n + i), "number": i, "total": i} for i in range(n % 4)])
    old, new = ["m1", "m2", "m3"], ["m1", "m2"]
    scan = scan_for(store, "docs", "m1")
    with scan.reading("m1") as read:
        keys = list(read.keys(lambda g: True))
    assert keys == sorted((g for g in users if _home(g, old) == "m1"), key=bytes)
    asked = _Asked(scan, monkeypatch)
    with_nothing = plan_reshard(store, scan, "docs", START, old)
    assert (with_nothing.briefcases_in_partition, with_nothing.briefcases_to_move, asked.requests) == (len(users), 0, [])

    plan = plan_reshard(store, scan, "docs", START, new)
    movers = {g: _home(g, old) for g in users if _home(g, old) != _home(g, new)}
    assert sorted((g, s) for s, gdids in asked.requests for g in gdids) == sorted(movers.items())
    for m in plan.moves:
        db = store.mongo.database(m.source)
        assert m.rows == {name: db[name].count_documents({"user_id": bytes(m.gdid)}) for name in scan.units}
    assert {m.gdid for m in plan.moves} == set(movers)
    assert plan.rows_per_table()["orders"] == sum(n % 4 for n, g in enumerate(users) if g in movers)


# -- which keys a plan takes: the partition's range, as the router puts them ------------------------------------

RANGE_SETS_MAP = """\
version: 1
servers:
  s0: {primary: "sqlite:///s0.db"}
  s1: {primary: "sqlite:///s1.db"}
  s2: {primary: "sqlite:///s2.db"}
  s3: {primary: "sqlite:///s3.db"}
  s4: {primary: "sqlite:///s4.db"}
  s5: {primary: "sqlite:///s5.db"}
  s6: {primary: "sqlite:///s6.db"}
  s7: {primary: "sqlite:///s7.db"}
  s8: {primary: "sqlite:///s8.db"}
  s9: {primary: "sqlite:///s9.db"}
areas:
  central: {kind: central, shards: [s0]}
  user:
    range_sets:
      - breakpoint: "0:0:0"
        partitions:
          - {start: "0:0:0", shards: [s1]}
          - {start: "0:0:100", shards: [s2, s3]}
          - {start: "0:0:1000", shards: [s4]}
      - breakpoint: "0:0:5000"
        partitions:
          - {start: "0:0:0", shards: [s5]}
          - {start: "0:0:250", shards: [s6, s7]}
      - breakpoint: "2:0:0"
        partitions:
          - {start: "0:0:0", shards: [s8]}
"""


BOUNDARIES = [0, 1, 99, 100, 101, 999, 1000, 1001, 4999, 5000, 5001, 5249, 5250, 5251, 2**60 - 1]


@given(era=st.integers(0, 3), authority=st.integers(0, 15),
       counter=st.one_of(st.sampled_from(BOUNDARIES), st.integers(0, 6000), st.integers(0, 2**60 - 1)))
def test_partition_filter_takes_exactly_what_the_router_puts_in_the_partition(era: int, authority: int, counter: int) -> None:
    router = Router(parse_map(RANGE_SETS_MAP, "range-sets.yaml"))
    g = GDID(era, authority, counter)
    assume(not g.is_zero)
    home = router.default_placement("user", g).partition_start
    for start, _end, _shards in router.partitions("user"):
        assert router.partition_member("user", start)(g) == (start == home), (g, start, home)


def test_partition_filter_refuses_the_zero_gdid_as_routing_does() -> None:
    router = Router(parse_map(RANGE_SETS_MAP, "range-sets.yaml"))
    start, _, _ = router.partition("user", GDID(0, 0, 0))
    with pytest.raises(RoutingError, match="zero GDID"):
        router.partition_member("user", start)(GDID.ZERO)
