"""Fan-out reads on three real PostgreSQL shards, checked against one database holding every row.

The same random rows go into the shards (through real briefcase sessions, so they land where
the router says) and into a reference database; then random ORDER BY / LIMIT / OFFSET queries
and aggregates must give exactly the reference answer. Relocated briefcases must be found on
their new server, and a copy still marked 'incoming' must not be counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.mapfiles import write_map
from sqlalchemy import Engine, create_engine, delete, desc, func, insert, select, text
from sqlalchemy.orm import Session

from mdb import GDID, Store
from mdb.demo.models import DemoBase, Order, User, UserBriefcase
from mdb.urls import sqlalchemy_url
from mdb.errors import QueryError
from mdb.fanout import fan_out_aggregate, fan_out_servers
from mdb.relocations import set_relocation
from mdb.schema import apply_schema
from mdb.system_tables import STATE_INCOMING, STATE_RESIDENT, briefcase_state
from support.fanout import insert_users, make_store, user_rows
from support.fanout import UserRows



"""(user id, name, [(order counter, status, total_cents, hours after BASE_TIME)])."""


def truncate(engines: list[Engine]) -> None:
    for engine in engines:
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE users CASCADE"))


@pytest.fixture
def shards(pg_databases: Any, pg_url: str, tmp_path: Path) -> Iterator[tuple[Store, Engine]]:
    store = make_store(tmp_path, pg_databases(3))
    reference = create_engine(sqlalchemy_url(pg_url))
    DemoBase.metadata.create_all(reference)
    yield store, reference
    store.close()
    reference.dispose()


# -- strategies ----------------------------------------------------------------------------------



SORTABLE = {
    "total_cents": Order.total_cents,
    "status": Order.status,
    "placed_at": Order.placed_at,
    "order_id": Order.order_id,
    "name": User.name,
    "user_id": User.user_id,
}

query_specs = st.fixed_dictionaries({
    "shape": st.sampled_from(["entity", "columns", "outer"]),
    "terms": st.lists(
        st.tuples(st.sampled_from(sorted(SORTABLE)), st.booleans(), st.sampled_from([None, True, False])),
        min_size=0, max_size=2,
    ),
    "limit": st.none() | st.integers(0, 12),
    "offset": st.none() | st.integers(0, 8),
    "from_counter": st.none() | st.integers(0, 2600),
})


def build(spec: dict[str, Any], *, reference: bool) -> tuple[Any, Any]:
    """(statement, function turning a result row into comparable values)."""
    shape = spec["shape"]
    terms = [t for t in spec["terms"] if shape != "entity" or SORTABLE[t[0]].class_ is Order]
    if shape == "entity":
        stmt = select(Order)
        tiebreak = [Order.user_id, Order.order_id]

        def values(row: Any) -> tuple[Any, ...]:
            o = row[0]
            return (o.user_id, o.order_id, o.status, o.total_cents, o.placed_at)
    else:
        stmt = select(User.user_id, User.name, Order.order_id, Order.status, Order.total_cents, Order.placed_at)
        stmt = stmt.outerjoin(User.orders) if shape == "outer" else stmt.join(User.orders)
        tiebreak = [User.user_id, Order.order_id]

        def values(row: Any) -> tuple[Any, ...]:
            return tuple(row)
    order_by = []
    for name, descending, nulls_first in terms:
        expr = SORTABLE[name]
        if reference and name in ("status", "name"):
            expr = expr.collate("C")  # the fan-out's documented string order (code points)
        term = expr.desc() if descending else expr.asc()
        if nulls_first is not None:
            term = term.nulls_first() if nulls_first else term.nulls_last()
        order_by.append(term)
    stmt = stmt.order_by(*order_by, *tiebreak)
    if spec["from_counter"] is None or reference:  # the reference filters by GDID in Python
        if spec["limit"] is not None:
            stmt = stmt.limit(spec["limit"])
        if spec["offset"] is not None:
            stmt = stmt.offset(spec["offset"])
    return stmt, values


def reference_rows(reference: Engine, spec: dict[str, Any]) -> list[tuple[Any, ...]]:
    stmt, values = build(spec, reference=True)
    if spec["from_counter"] is None:
        with Session(reference) as s:
            return [values(r) for r in s.execute(stmt).all()]
    start = GDID(0, 0, spec["from_counter"]).sharding_value
    full = build({**spec, "limit": None, "offset": None}, reference=True)[0]
    with Session(reference) as s:
        rows = [values(r) for r in s.execute(full).all()]
    rows = [r for r in rows if r[0].sharding_value >= start]
    offset = spec["offset"] or 0
    return rows[offset: None if spec["limit"] is None else offset + spec["limit"]]


def fanout_rows(store: Store, spec: dict[str, Any]) -> list[tuple[Any, ...]]:
    stmt, values = build(spec, reference=False)
    if spec["from_counter"] is not None:
        if spec["limit"] is not None:
            stmt = stmt.limit(spec["limit"])
        if spec["offset"] is not None:
            stmt = stmt.offset(spec["offset"])
    from_gdid = None if spec["from_counter"] is None else GDID(0, 0, spec["from_counter"])
    return [values(r) for r in store.fan_out("user", stmt, from_gdid=from_gdid)]


# -- properties ----------------------------------------------------------------------------------

@pytest.mark.slow  # 58 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_fan_out_equals_one_database(shards: tuple[Store, Engine]) -> None:
    store, reference = shards
    engines = [store.engine(s) for s in ("u1", "u2", "u3")] + [reference]
    seen_shards: set[str] = set()

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(users=user_rows(), specs=st.lists(query_specs, min_size=1, max_size=6))
    def check(users: UserRows, specs: list[dict[str, Any]]) -> None:
        truncate(engines)
        insert_users(store, reference, users)
        for gdid, _name, _orders in users:
            seen_shards.add(store.router.locate("user", gdid).server)
        for spec in specs:
            assert fanout_rows(store, spec) == reference_rows(reference, spec), spec

    check()
    assert seen_shards == {"u1", "u2", "u3"}  # the examples really spread over the shards


@pytest.mark.slow  # 25 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_aggregates_equal_one_database(shards: tuple[Store, Engine]) -> None:
    store, reference = shards
    engines = [store.engine(s) for s in ("u1", "u2", "u3")] + [reference]

    statements = [
        select(func.count().label("n"), func.sum(Order.total_cents).label("total"),
               func.min(Order.placed_at).label("first"), func.max(Order.placed_at).label("last")),
        select(Order.status, func.count(Order.order_id).label("n"), func.sum(Order.total_cents),
               func.max(Order.total_cents), func.avg(Order.total_cents).label("mean"))
        .group_by(Order.status).order_by(Order.status.collate("C")),
        select(User.name, func.count(Order.order_id).label("orders"), func.min(Order.total_cents).label("low"))
        .outerjoin(User.orders).group_by(User.name).order_by(desc("orders"), User.name.collate("C")).limit(2),
    ]

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(users=user_rows())
    def check(users: UserRows) -> None:
        truncate(engines)
        insert_users(store, reference, users)
        for stmt in statements:
            with Session(reference) as s:
                expected = [tuple(r) for r in s.execute(stmt).all()]
            got = [tuple(r) for r in fan_out_aggregate(store, "user", stmt)]
            assert len(got) == len(expected), (stmt, got, expected)
            for g, e in zip(got, expected):
                for gv, ev in zip(g, e):
                    if isinstance(ev, Decimal) and isinstance(gv, Decimal):
                        assert abs(gv - ev) < Decimal("1e-12"), (stmt, got, expected)
                    else:
                        assert gv == ev, (stmt, got, expected)

    check()


def test_aggregate_row_labels_and_empty_area(shards: tuple[Store, Engine]) -> None:
    store, _ = shards
    result = store.fan_out("user", select(func.count().label("n"), func.sum(Order.total_cents).label("s"),
                                          func.avg(Order.total_cents).label("a")), aggregate=True)
    assert [(r.n, r.s, r.a) for r in result] == [(0, None, None)]
    assert result.complete and sorted(result.servers) == ["u1", "u2", "u3"]


def test_statements_that_cannot_be_merged_are_refused(shards: tuple[Store, Engine]) -> None:
    store, _ = shards
    with pytest.raises(QueryError, match="aggregate=True"):
        store.fan_out("user", select(func.count()).select_from(Order))
    with pytest.raises(QueryError, match="aggregate=True"):
        store.fan_out("user", select(Order.status).group_by(Order.status))
    with pytest.raises(QueryError, match="DISTINCT"):
        store.fan_out("user", select(func.count(Order.status.distinct())), aggregate=True)
    with pytest.raises(QueryError, match="HAVING"):
        store.fan_out("user", select(Order.status, func.count()).group_by(Order.status).having(func.count() > 1),
                      aggregate=True)
    with pytest.raises(QueryError, match="'total_cents'"):
        store.fan_out("user", select(Order.total_cents, func.count()).group_by(Order.status), aggregate=True)
    with pytest.raises(QueryError, match="ORDER BY"):
        store.fan_out("user", select(Order.order_id).order_by(Order.total_cents + 1))
    with pytest.raises(QueryError, match="no briefcase table"):
        store.fan_out("user", select(briefcase_state.c.gdid))


# -- relocations and incoming copies -------------------------------------------------------------

def test_relocated_briefcases_included_and_incoming_copies_excluded(
    pg_databases: Any, pg_url: str, tmp_path: Path
) -> None:
    store = make_store(tmp_path, pg_databases(3), extra={"spare": pg_url})
    try:
        users: UserRows = [
            (GDID(0, 0, 10), "ann", [(1, "a", 3, 0), (2, "b", 1, 1)]),
            (GDID(0, 0, 11), "bob", [(3, "a", 5, 2)]),
            (GDID(0, 0, 1500), "Cy", [(4, "b", 7, 3)]),
        ]
        insert_users(store, None, users)
        moved = GDID(0, 0, 10)
        home = store.router.locate("user", moved).server
        assert "spare" not in store.router.area_servers("user")

        # A finished move to the spare server: rows copied there and deleted at home, the spare
        # marks the briefcase resident, the directory in CENTRAL points at it.
        with store.transaction(home) as src, store.transaction("spare") as dst:
            for table in (User.__table__, Order.__table__):
                rows = [dict(r._mapping) for r in src.execute(select(table).where(table.c.user_id == moved))]
                dst.execute(insert(table), rows)
            src.execute(delete(Order.__table__).where(Order.__table__.c.user_id == moved))
            src.execute(delete(User.__table__).where(User.__table__.c.user_id == moved))
            dst.execute(insert(briefcase_state).values(area="user", gdid=moved, state=STATE_RESIDENT))
        set_relocation(store, "user", moved, "spare")
        store.refresh()
        assert "spare" in fan_out_servers(store.router, "user")
        assert "spare" not in fan_out_servers(store.router, "user", GDID(0, 0, 1000))
        assert not store.router.directory_loaded  # the server list reads the directory's summary, not its entries

        # A move in progress of bob's briefcase to u3: the copy is there, marked incoming.
        copying = GDID(0, 0, 11)
        bob_home = store.router.locate("user", copying).server
        assert bob_home != "u3"
        with store.transaction(bob_home) as src, store.transaction("u3") as dst:
            for table in (User.__table__, Order.__table__):
                rows = [dict(r._mapping) for r in src.execute(select(table).where(table.c.user_id == copying))]
                dst.execute(insert(table), rows)
            dst.execute(insert(briefcase_state).values(area="user", gdid=copying, state=STATE_INCOMING, move_id="m1"))

        ids = [(o.user_id, o.order_id) for o in store.fan_out("user", select(Order).order_by(Order.order_id)).scalars()]
        assert ids == [(GDID(0, 0, 10), GDID(0, 1, 1)), (GDID(0, 0, 10), GDID(0, 1, 2)),
                       (GDID(0, 0, 11), GDID(0, 1, 3)), (GDID(0, 0, 1500), GDID(0, 1, 4))]
        joined = store.fan_out("user", select(User.name, Order.order_id).join(User.orders).order_by(Order.order_id))
        assert [r.name for r in joined] == ["ann", "ann", "bob", "Cy"]
        counts = fan_out_aggregate(store, "user", select(func.count().label("n")).select_from(User))
        assert counts.rows[0].n == 3
        # Only from 0:0:1000 on: the relocated briefcase (0:0:10) is outside, Cy's is inside.
        later = store.fan_out("user", select(User.user_id).order_by(User.user_id), from_gdid="0:0:1000")
        assert [r.user_id for r in later] == [GDID(0, 0, 1500)] and later.servers == ["u3"]
    finally:
        store.close()


def test_readonly_fan_out_reads_replicas(pg_replica_pair: Any, pg_databases: Any, tmp_path: Path) -> None:
    c, u2 = pg_databases(2)
    servers = {"c": c, "u1": pg_replica_pair.primary_url, "u2": u2}
    path = write_map(tmp_path, servers, central=["c"], partitions=[("0:0:0", ["u1", "u2"])],
                     replicas={"u1": pg_replica_pair.replica_url})
    store = Store.from_yaml(path, types=[UserBriefcase])
    try:
        assert all(r.ok for r in apply_schema(store))
        users: UserRows = [(GDID(0, 0, n), f"n{n}", [(n, "a", n, 0)]) for n in range(1, 7)]
        insert_users(store, None, users)
        pg_replica_pair.wait_for_replay()
        stmt = select(Order.user_id, func.pg_is_in_recovery().label("on_replica")).order_by(Order.user_id)
        primary = store.fan_out("user", stmt)
        replica = store.fan_out("user", stmt, readonly=True)
        assert [r.user_id for r in replica] == [r.user_id for r in primary] == [u[0] for u in users]
        assert not any(r.on_replica for r in primary)
        # u1 has a replica and is read there; u2 has none and is read on its primary.
        assert {r.user_id: r.on_replica for r in replica} == {
            u[0]: store.router.locate("user", u[0]).server == "u1" for u in users
        }
    finally:
        store.close()


def test_sqlite_shards_follow_the_documented_null_order(tmp_sqlite_urls: Any, tmp_path: Path) -> None:
    # SQLite's own default puts NULLs first in ASC; the fan-out makes every shard sort them as
    # PostgreSQL does (NULL above every value) unless the statement says otherwise.
    store = make_store(tmp_path, tmp_sqlite_urls(3))
    try:
        users: UserRows = [
            (GDID(0, 0, 1), "a", [(1, "a", 5, 0)]), (GDID(0, 0, 2), "b", []),
            (GDID(0, 0, 1001), "c", [(2, "a", 3, 0)]), (GDID(0, 0, 4), "d", []),
        ]
        insert_users(store, None, users)
        stmt = select(User.name, Order.total_cents).outerjoin(User.orders)
        asc = store.fan_out("user", stmt.order_by(Order.total_cents, User.name))
        assert [(r.name, r.total_cents) for r in asc] == [("c", 3), ("a", 5), ("b", None), ("d", None)]
        desc_ = store.fan_out("user", stmt.order_by(Order.total_cents.desc(), User.name))
        assert [r.name for r in desc_] == ["b", "d", "a", "c"]
        first = store.fan_out("user", stmt.order_by(Order.total_cents.nulls_first(), User.name).offset(1).limit(2))
        assert [r.name for r in first] == ["d", "c"]
    finally:
        store.close()
