"""Briefcase sessions on real PostgreSQL servers (and the same checks on SQLite files).

The map: CENTRAL on one database, area ``user`` with two partitions, [0:0:0, 0:0:1000) on 2
shards and [0:0:1000, open) on 3 shards. The six databases are spread over three PostgreSQL
servers, so neighbouring shards really are on different servers. Every placement claim is
checked by querying every shard directly, not by asking the router again.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from sqlalchemy import delete, event, func, lambda_stmt, select, text, true, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import (
    DeclarativeBase,
    ORMExecuteState,
    Session,
    aliased,
    joinedload,
    selectinload,
    subqueryload,
)

from mdb.demo.models import (
    LEDGER,
    LEDGER_TABLES,
    AccountAuthorizationHistory,
    Address,
    Balance,
    Order,
    OrderLineItem,
    PayAccount,
    Transaction,
    User,
    UserBriefcase,
)
from mdb.errors import CrossBriefcaseError, MdbError, QueryError, StaleRouteError
from mdb.gdid import GDID
from mdb.router import ShardLayout
from mdb.schema import apply_schema, stamp_layout
from mdb.dialects import sql_dialect
from mdb.session import BriefcaseSession, _confined
from mdb.store import Store
from mdb.system_tables import briefcase_state
from support.briefcase import RoundTripCounter, _proxied, child_id, pg_store, sqlite_store, store  # noqa: F401 (fixtures: pg_store, sqlite_store, store)
from support.briefcase import SERVERS

USER_SERVERS = SERVERS[1:]


# What fill_briefcase leaves in each table: one row, but the ledger's snapshot table holds the
# stream's head row (snapshot 0) and the snapshot that folded the one event.
ROWS_PER_BRIEFCASE = {t.name: 1 for t in UserBriefcase.tables} | {LEDGER_TABLES.snapshots.name: 2}


def fill_briefcase(session: Session, gdid: GDID, tag: str = "") -> None:
    """Rows in every table of the user briefcase; children leave the key for the session to fill."""
    user = User(user_id=gdid, email=f"{gdid}{tag}@example.com", name=f"user {gdid}{tag}")
    account = PayAccount(account_id=child_id(), kind="card", masked_number="**** 4242")
    order = Order(order_id=child_id(), total_cents=1250)
    session.add_all([user, account, order])
    session.flush()
    session.add_all(
        [
            AccountAuthorizationHistory(authorization_id=child_id(), account_id=account.account_id, amount=1250, approved=True),
            Address(address_id=child_id(), line1="1 Main St", city="Springfield", country="US"),
            OrderLineItem(line_id=child_id(), order_id=order.order_id, sku="SKU-1", quantity=1, price_cents=1250),
            Transaction(transaction_id=child_id(), amount_cents=-1250, memo="order"),
            Balance(balance_id=child_id(), currency="USD", amount_cents=100),
        ]
    )
    session.flush()
    assert LEDGER.append(session, "ledger", child_id(), "transaction", {"amount_cents": -1250})
    assert LEDGER.snapshot(session, "ledger").folded == 1


def rows_on_every_shard(store: Store, gdid: GDID) -> dict[str, dict[str, int]]:
    """server -> table -> rows carrying ``gdid``, read from each shard directly (no session)."""
    out: dict[str, dict[str, int]] = {}
    for server in USER_SERVERS:
        with store.transaction(server) as conn:
            out[server] = {
                table.name: conn.execute(
                    select(func.count()).select_from(table).where(UserBriefcase.key_column(table) == gdid)
                ).scalar_one()
                for table in UserBriefcase.tables
            }
    return out


def holders(counts: dict[str, dict[str, int]]) -> set[str]:
    return {server for server, tables in counts.items() if any(tables.values())}


# Briefcase ids covering every shard of both partitions: counters 2, 3 -> u1, u2; 1500..1502 -> u3..u5.
SPREAD = [GDID(0, 0, c) for c in (2, 3, 1500, 1501, 1502)]


def test_every_row_lands_on_the_routed_shard_and_nowhere_else(store: Store) -> None:
    expected = {}
    for gdid in SPREAD:
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
            expected[gdid] = session.placement.server
    assert sorted(expected.values()) == USER_SERVERS  # the ids really cover every shard
    for gdid, server in expected.items():
        counts = rows_on_every_shard(store, gdid)
        assert counts[server] == ROWS_PER_BRIEFCASE, (gdid, counts)
        assert holders(counts) == {server}
        assert store.router.locate("user", gdid).server == server


def test_key_is_filled_in_for_new_rows(store: Store) -> None:
    gdid = GDID(0, 0, 7)
    with store.briefcase(UserBriefcase, gdid) as session:
        fill_briefcase(session, gdid)
    with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
        for model in UserBriefcase.models:
            keys = session.scalars(select(model.user_id)).all()
            assert keys == [gdid] * ROWS_PER_BRIEFCASE[model.__table__.name], model.__name__


def test_reads_see_only_their_briefcase(store: Store) -> None:
    mine, neighbour = GDID(0, 0, 10), GDID(0, 0, 12)  # both even: the same shard u1
    for gdid in (mine, neighbour):
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
    assert store.router.locate("user", mine).server == store.router.locate("user", neighbour).server == "u1"
    with store.briefcase(UserBriefcase, mine, readonly=True) as session:
        for model in UserBriefcase.models:
            assert session.scalars(select(model.user_id)).all() == [mine] * ROWS_PER_BRIEFCASE[model.__table__.name], model.__name__
            assert session.execute(select(func.count()).select_from(model)).scalar_one() == ROWS_PER_BRIEFCASE[model.__table__.name], model.__name__
        assert session.get(User, neighbour) is None
        user = session.get(User, mine)
        assert user is not None and [o.user_id for o in user.orders] == [mine]
        joined = session.execute(select(Order.order_id, OrderLineItem.line_id).join(OrderLineItem, OrderLineItem.order_id == Order.order_id)).all()
        assert len(joined) == 1
        # Raw SQL is the escape hatch: it is not filtered (documented in docs/briefcases.md).
        assert session.execute(text("SELECT count(*) FROM users")).scalar_one() == 2


def test_confinement_covers_aliases_joins_subqueries_eager_loads_and_bulk_deletes(store: Store) -> None:
    """Every way the ORM can reach a table of the type is filtered, and the cached compiled form
    of a statement carries each session's own GDID (it is a bound parameter, not a literal)."""
    mine, neighbour = GDID(0, 0, 40), GDID(0, 0, 42)  # both on u1
    for gdid in (mine, neighbour):
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
    orders = aliased(Order)
    statements = {
        "aliased": select(orders.user_id),
        "cross join": select(Order.user_id).join(OrderLineItem, true()),
        "subquery": select(func.count()).select_from(select(Order).subquery()),
        "exists": select(User.user_id).where(select(Order.order_id).where(Order.user_id != User.user_id).exists()),
        "union": select(Address.user_id).union_all(select(Transaction.user_id)),
    }
    for gdid in (mine, neighbour):  # the same statement objects: the second run hits the compiled cache
        with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
            assert session.scalars(statements["aliased"]).all() == [gdid]
            assert session.scalars(statements["cross join"]).all() == [gdid]
            assert session.scalar(statements["subquery"]) == 1
            assert session.scalars(statements["exists"]).all() == []  # the neighbour's order is invisible
            assert session.scalars(statements["union"]).all() == [gdid, gdid]
            for loader in (selectinload, joinedload, subqueryload):
                user = session.scalars(
                    select(User).options(loader(User.orders).options(loader(Order.line_items))).execution_options(populate_existing=True)
                ).unique().one()
                assert user.user_id == gdid and {o.user_id for o in user.orders} == {gdid}, loader.__name__
                assert {li.user_id for o in user.orders for li in o.line_items} == {gdid}, loader.__name__
    with store.briefcase(UserBriefcase, mine) as session:
        assert session.execute(delete(Address)).rowcount == 1
    with store.briefcase(UserBriefcase, neighbour, readonly=True) as session:
        assert session.scalars(select(Address.user_id)).all() == [neighbour]


def test_the_orms_own_loads_are_confined_once(store: Store) -> None:
    """A lazy load, a refresh and a selectin load are executions of the briefcase session, confined
    there like the application's: each carries the confining criterion once (the option does not
    also propagate to loaders, which put it in twice) and sees no neighbour's rows."""
    mine, neighbour = GDID(0, 0, 50), GDID(0, 0, 52)  # both on u1
    for gdid in (mine, neighbour):
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(" ".join(statement.split()))

    engine = store.engine("u1", True)
    event.listen(engine, "before_cursor_execute", record)
    try:
        with store.briefcase(UserBriefcase, mine, readonly=True) as session:
            user = session.get(User, mine)
            assert user is not None
            sent.clear()
            assert {o.user_id for o in user.orders} == {mine}  # lazy
            session.expire(user)
            assert user.email  # refresh
            session.scalars(select(Order).options(selectinload(Order.line_items))).all()  # selectin
            loads = list(sent)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert len(loads) == 4, loads
    for sql in loads:
        table = sql.split(" FROM ", 1)[1].split()[0]
        where = sql.split(" WHERE ", 1)[1]
        # The relationship's own join condition may name the key column too; the criterion is
        # "<table>.user_id = <parameter>" with the parameter second.
        criteria = [part for part in where.split(" AND ") if part.startswith(f"{table}.user_id = ")]
        assert len(criteria) == 1, sql


def test_a_confined_statement_inlined_compares_the_key_as_its_column_stores_it(store: Store) -> None:
    """The confining parameter carries the key's 12 stored bytes (no column type converts them per
    statement); compiled with ``literal_binds`` it renders as the binary literal of the column
    and, run as raw SQL on the shard, selects the briefcase's rows and no neighbour's."""
    mine, neighbour = GDID(0, 0, 70), GDID(0, 0, 72)  # both on u1
    for gdid in (mine, neighbour):
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
    with store.briefcase(UserBriefcase, mine, readonly=True) as session:
        assert session.briefcase.key == bytes(mine)
        statement, params = _confined(session.briefcase, select(Address.address_id), None)
        assert params == {"mdb_briefcase_key": bytes(mine)}
        bound = statement.params(params)
        dialect = session.get_bind().dialect
        sql = str(bound.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
        assert sql_dialect(dialect).gdid_literal(mine.hex) in sql, sql
        inlined = [GDID.from_bytes(bytes(value)) for value in session.execute(text(sql)).scalars()]
        assert inlined == session.scalars(select(Address.address_id)).all()
        assert len(inlined) == ROWS_PER_BRIEFCASE[Address.__table__.name]


def test_a_statement_executed_again_keeps_its_confined_copy_and_each_session_its_own_rows(store: Store) -> None:
    """A select the application builds once and executes in many sessions keeps one confined copy
    (the key is a parameter, so the copy is the same for every briefcase of the type, and its
    cache key is computed once); each session still reads only its own briefcase's rows. A
    statement derived from it (``.where()``) is another statement: it is confined with its own
    criteria, never answered with the copy of the one it came from."""
    mine, neighbour = GDID(0, 0, 80), GDID(0, 0, 82)  # both on u1
    for gdid in (mine, neighbour):
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
            session.add(Address(address_id=child_id(), line1="2 Side St", city="Shelbyville", country="US"))
    every_address = select(Address.user_id, Address.city).order_by(Address.city)
    copies = []
    for gdid in (mine, neighbour, mine):
        with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
            assert session.execute(every_address).all() == [(gdid, "Shelbyville"), (gdid, "Springfield")]
            copies.append(_confined(session.briefcase, every_address, None)[0])
    assert copies[0] is copies[1] is copies[2] and copies[0] is not every_address
    in_springfield = every_address.where(Address.city == "Springfield")  # made after the copy was kept
    with store.briefcase(UserBriefcase, neighbour, readonly=True) as session:
        assert session.execute(in_springfield).all() == [(neighbour, "Springfield")]
        assert _confined(session.briefcase, in_springfield, None)[0] is not copies[0]
        assert session.execute(every_address).all() == [(neighbour, "Shelbyville"), (neighbour, "Springfield")]
        # A copy that carried the entry anyway (two threads memoizing on one statement can lose
        # the name that keeps it out of copies): the entry names another statement, so unused.
        in_shelbyville = every_address.where(Address.city == "Shelbyville")
        in_shelbyville.__dict__["_mdb_confined"] = every_address.__dict__["_mdb_confined"]
        assert session.execute(in_shelbyville).all() == [(neighbour, "Shelbyville")]


def test_threads_sharing_statements_each_read_their_own_briefcase(store: Store) -> None:
    """Eight threads execute one shared select, and selects each derives from it afresh, in sessions
    of four briefcases at once: whatever order their memoizations on the shared statement land
    in, every session reads exactly its own briefcase's rows, filtered as its statement says."""
    gdids = [GDID(0, 0, n) for n in (90, 92, 94, 96)]  # all on u1
    for gdid in gdids:
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
    shared = select(Address.user_id, Address.city)

    def work(worker: int) -> list[str]:
        wrong = []
        for n in range(40):
            gdid = gdids[(worker + n) % len(gdids)]
            city = "Springfield" if n % 2 else "Nowhere"
            derived = shared.where(Address.city == city)
            with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
                if (rows := session.execute(shared).all()) != [(gdid, "Springfield")]:
                    wrong.append(f"{gdid} shared: {rows}")
                expected = [(gdid, "Springfield")] if city == "Springfield" else []
                if (rows := session.execute(derived).all()) != expected:
                    wrong.append(f"{gdid} {city}: {rows}")
        return wrong

    with ThreadPoolExecutor(max_workers=8) as pool:
        wrong = [w for found in pool.map(work, range(8)) for w in found]
    assert wrong == []


def test_confinement_covers_every_form_of_statement_and_statements_a_listener_substitutes(store: Store) -> None:
    """A legacy Query, a lambda statement and a statement that an application's own
    ``do_orm_execute`` listener runs instead of the one it was given are confined like any other:
    confinement sits where every ORM execution passes, not in a listener whose turn comes
    before or after the application's (docs/dev/0018)."""
    mine, neighbour = GDID(0, 0, 60), GDID(0, 0, 62)  # both on u1
    for gdid in (mine, neighbour):
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
    with store.briefcase(UserBriefcase, mine, readonly=True) as session:
        assert [a.user_id for a in session.query(Address)] == [mine]
        assert session.scalars(lambda_stmt(lambda: select(Address.user_id))).all() == [mine]

    def instead(state: ORMExecuteState) -> Any:
        if state.is_select and not state.execution_options.get("instead"):
            return state.invoke_statement(statement=select(Order.user_id).execution_options(instead=True))
        return None

    event.listen(BriefcaseSession, "do_orm_execute", instead)
    try:
        with store.briefcase(UserBriefcase, mine, readonly=True) as session:
            assert session.scalars(select(Address.user_id)).all() == [mine]  # the orders' keys, the neighbour's invisible
    finally:
        event.remove(BriefcaseSession, "do_orm_execute", instead)


def test_cross_briefcase_writes_are_refused_and_nothing_is_written(store: Store) -> None:
    mine, other = GDID(0, 0, 20), GDID(0, 0, 22)
    with store.briefcase(UserBriefcase, other) as session:
        fill_briefcase(session, other)
    before = {g: rows_on_every_shard(store, g) for g in (mine, other)}

    with pytest.raises(CrossBriefcaseError, match=r"user_id=0:0:22 cannot be written in the session of briefcase user/0:0:20"):
        with store.briefcase(UserBriefcase, mine) as session:
            fill_briefcase(session, mine)  # a legitimate row in the same transaction...
            session.add(Address(user_id=other, address_id=child_id(), line1="x", city="y", country="US"))

    with pytest.raises(CrossBriefcaseError):
        with store.briefcase(UserBriefcase, mine) as session:
            session.add(User(user_id=mine, email="m@example.com", name="m"))
            session.flush()
            address = Address(address_id=child_id(), line1="x", city="y", country="US")
            session.add(address)
            session.flush()
            address.user_id = other  # moving a row into another briefcase

    with pytest.raises(CrossBriefcaseError, match="is not part of briefcase type UserBriefcase"):
        with store.briefcase(UserBriefcase, mine) as session:
            session.add(briefcase_state_row())

    # ...and nothing at all was written, neither the legitimate rows nor the foreign ones.
    assert {g: rows_on_every_shard(store, g) for g in (mine, other)} == before

    # A bulk ORM UPDATE inside a session only touches its own briefcase.
    with store.briefcase(UserBriefcase, mine) as session:
        fill_briefcase(session, mine)
    with store.briefcase(UserBriefcase, mine) as session:
        result = session.execute(update(Order).values(status="shipped"))
        assert result.rowcount == 1
    with store.briefcase(UserBriefcase, other, readonly=True) as session:
        assert session.scalars(select(Order.status)).all() == ["placed"]


class _ForeignBase(DeclarativeBase):
    pass


class ForeignRow(_ForeignBase):
    """A mapped class outside the user briefcase (mdb's own state table)."""

    __table__ = briefcase_state


def briefcase_state_row() -> Any:
    return ForeignRow(area="user", gdid=GDID(0, 0, 20), state="gone", peer="u2")


def test_an_exception_inside_the_block_rolls_back(store: Store) -> None:
    gdid = GDID(0, 0, 30)
    with pytest.raises(ZeroDivisionError):
        with store.briefcase(UserBriefcase, gdid) as session:
            fill_briefcase(session, gdid)
            session.flush()  # the rows reached the server inside the transaction
            assert session.execute(select(func.count()).select_from(Order)).scalar_one() == 1
            raise ZeroDivisionError("the application's block fails after its rows were flushed")
    assert holders(rows_on_every_shard(store, gdid)) == set()


def test_readonly_session_refuses_writes(store: Store) -> None:
    gdid = GDID(0, 0, 40)
    with store.briefcase(UserBriefcase, gdid) as session:
        fill_briefcase(session, gdid)
    before = rows_on_every_shard(store, gdid)
    with pytest.raises(MdbError, match="readonly session cannot write"):
        with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
            session.add(Address(address_id=child_id(), line1="x", city="y", country="US"))
    with pytest.raises(MdbError, match="readonly session cannot update or delete"):
        with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
            session.execute(update(Order).values(status="void"))
    assert rows_on_every_shard(store, gdid) == before


def test_ownership_check_refuses_a_fenced_or_restamped_shard(store: Store) -> None:
    """The check itself, on both backends: no newer map exists, so the retries end in StaleRouteError."""
    fenced, restamped = GDID(0, 0, 50), GDID(0, 0, 1503)  # u1; 1503 % 3 = 0 -> u3
    with store.transaction("u1") as conn:
        conn.execute(briefcase_state.insert().values(area="user", gdid=fenced, state="gone", peer="u2"))
    with store.transaction("u3") as conn:
        layout = ShardLayout("user", GDID(0, 0, 1000), None, 0, 4)
        assert stamp_layout(conn, layout, 1, replace=True) is None
    # The fence on u1 sends the session to u2 (its peer); u2 holds no resident record of it and refuses too.
    with pytest.raises(StaleRouteError, match=r"briefcase user/0:0:50 on server 'u2': .* no resident record"):
        with store.briefcase(UserBriefcase, fenced) as session:
            fill_briefcase(session, fenced)
    with pytest.raises(StaleRouteError, match=r"stamped partition \[0:0:1000, open\) shard 0 of 4 .* routed it to partition \[0:0:1000, open\) shard 0 of 3"):
        with store.briefcase(UserBriefcase, restamped, readonly=True) as session:
            session.scalars(select(User)).all()
    assert holders(rows_on_every_shard(store, fenced)) == set()


# -- replica ---------------------------------------------------------------------------------


def test_readonly_sessions_read_from_the_replica(
    pg_replica_pair: Any, pg_databases: Callable[[int], list[str]], tmp_path: Path
) -> None:
    primary, replica = pg_replica_pair.primary_url, pg_replica_pair.replica_url
    (central,) = pg_databases(1)
    path = write_map(
        tmp_path, {"central": central, "u1": primary}, central=["central"], partitions=[("0:0:0", ["u1"])],
        replicas={"u1": replica},
    )
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
        gdid = GDID(0, 0, 60)
        with store.briefcase(UserBriefcase, gdid) as session:
            assert session.execute(text("SELECT pg_is_in_recovery()")).scalar_one() is False
            fill_briefcase(session, gdid)
        pg_replica_pair.wait_for_replay()
        with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
            assert session.execute(text("SELECT pg_is_in_recovery()")).scalar_one() is True
            assert session.scalars(select(User.email)).all() == [f"{gdid}@example.com"]
        # Even raw SQL cannot write through a readonly session: the server itself is a standby
        # (and the session's transaction is READ ONLY), named as mdb's error with the driver's as its cause.
        with pytest.raises(QueryError, match="read-only transaction.*a readonly briefcase session, or a replica, cannot write") as raised:
            with store.briefcase(UserBriefcase, gdid, readonly=True) as session:
                session.execute(text("DELETE FROM balances"))
        assert isinstance(raised.value.__cause__, DBAPIError)
        with store.briefcase(UserBriefcase, gdid) as session:
            assert session.execute(select(func.count()).select_from(Balance)).scalar_one() == 1


# -- the ownership check's cost --------------------------------------------------------------


def test_ownership_check_costs_no_extra_round_trip(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """Count round trips of a briefcase session against the same work in a plain Session.

    Both run on the same engine (driver autocommit, BEGIN issued by mdb), so both cost BEGIN,
    the SELECT and COMMIT; the briefcase session's BEGIN also carries the advisory lock and the
    ownership check in the same simple-protocol string. If the check cost a statement of its
    own, the briefcase session would show one more ReadyForQuery than the plain one; the
    control with one extra ``SELECT 1`` shows the counter does see a single extra round trip.
    """
    from sqlalchemy.engine import make_url

    central, shard = pg_databases(2)
    parsed = make_url(shard)
    proxy = RoundTripCounter(parsed.host or "127.0.0.1", parsed.port or 5432)
    try:
        path = write_map(
            tmp_path, {"central": central, "u1": _proxied(shard, proxy.port)}, central=["central"],
            partitions=[("0:0:0", ["u1"])],
        )
        with Store.from_yaml(path, types=[UserBriefcase]) as store:
            assert all(r.ok for r in apply_schema(store))
            gdid = GDID(0, 0, 70)
            with store.briefcase(UserBriefcase, gdid) as session:
                fill_briefcase(session, gdid)
            engine = store.engine("u1")

            def briefcase_read(exclusive: bool = False) -> None:
                with store.briefcase(UserBriefcase, gdid, exclusive=exclusive) as session:
                    assert session.scalars(select(User).where(User.user_id == gdid)).one().user_id == gdid
                    session.expunge_all()

            def plain_read(extra: bool = False) -> None:
                with Session(engine) as session, session.begin():
                    if extra:
                        session.execute(text("SELECT 1"))
                    assert session.scalars(select(User).where(User.user_id == gdid)).one().user_id == gdid

            def trips(fn: Callable[[], None]) -> int:
                # Warm-up past psycopg's prepare_threshold (5): the run that prepares a statement
                # costs one extra round trip (Parse), later runs reuse it. Then the steady state.
                for _ in range(7):
                    fn()
                before = proxy.ready_for_query
                for _ in range(3):
                    fn()
                total = proxy.ready_for_query - before
                assert total % 3 == 0, total
                return total // 3

            plain = trips(plain_read)
            assert plain == 3  # BEGIN, SELECT, COMMIT
            assert trips(lambda: plain_read(extra=True)) == plain + 1  # the counter sees one more
            assert trips(briefcase_read) == plain  # the check rode along with BEGIN
            assert trips(lambda: briefcase_read(exclusive=True)) == plain  # so does the exclusive lock
    finally:
        proxy.close()


def test_the_check_is_prepared_once_per_connection_and_prepared_again_when_lost(pg_store: Store) -> None:
    """The check runs as server-side prepared statements, made once per pooled connection.

    ``prepare_time`` in ``pg_prepared_statements`` does not change between two sessions on the
    same connection (not prepared again); after the statements are dropped behind mdb's back
    (as DISCARD/DEALLOCATE or a pooler swapping the server session would), the next session
    prepares them again and still runs its check instead of failing.
    """
    gdid = GDID(0, 0, 2)  # u1
    with pg_store.briefcase(UserBriefcase, gdid) as session:
        fill_briefcase(session, gdid)

    def prepared(readonly: bool) -> tuple[int, dict[str, Any]]:
        with pg_store.briefcase(UserBriefcase, gdid, readonly=readonly) as session:
            assert session.scalars(select(User)).one().user_id == gdid
            pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
            rows = session.execute(
                text("SELECT name, prepare_time FROM pg_prepared_statements WHERE name LIKE 'mdb_ownership_%'")
            ).all()
            return pid, dict(rows)  # type: ignore[arg-type]

    pid, first = prepared(readonly=False)
    assert set(first) == {"mdb_ownership_lock", "mdb_ownership_lock_x", "mdb_ownership_read", "mdb_ownership_write"}
    again_pid, again = prepared(readonly=True)
    assert again_pid == pid, "sequential sessions should reuse the one pooled connection"
    assert again == first  # same prepare_time: not prepared a second time

    with pg_store.briefcase(UserBriefcase, gdid) as session:
        session.execute(text("DEALLOCATE mdb_ownership_write"))
        session.execute(text("DEALLOCATE mdb_ownership_read"))
    after_pid, after = prepared(readonly=False)
    assert after_pid == pid
    assert set(after) == set(first)
    assert after["mdb_ownership_write"] > first["mdb_ownership_write"]

    # psycopg itself drops them: rolling back on a connection where it auto-prepared a query
    # (the same SELECT, more than prepare_threshold times) makes it send DEALLOCATE ALL.
    for _ in range(7):
        prepared(readonly=True)
    with pytest.raises(ZeroDivisionError), pg_store.briefcase(UserBriefcase, gdid) as session:
        session.scalars(select(User)).one()
        1 / 0  # noqa: B018
    last_pid, last = prepared(readonly=False)
    assert last_pid == pid
    assert set(last) == set(first)
    assert last["mdb_ownership_read"] > after["mdb_ownership_read"]
