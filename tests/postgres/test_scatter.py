"""A warm fan-out sent from one thread to every shard (mdb.scatter) on three real PostgreSQL shards.

It must read what the thread-pool path reads (the same rows, keys and types: GDIDs, aware
datetimes, Decimals, NULLs), raise what it raises, and leave the pools as it found them: no
connection returned busy, by an error, by Ctrl-C, or by a prepared statement dropped behind its
back; and it must prepare each statement once per connection, never more than the cap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import Column, Engine, event, func, literal_column, select, text
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Session
from sqlalchemy.orm.exc import DetachedInstanceError
from support.fanout import insert_users

from mdb import GDID, Store
from mdb.aio import AsyncStore
from mdb import scatter
from mdb.demo.models import Order, User, UserBriefcase
from mdb.engines import prepared_names
from mdb.errors import SchemaError
from mdb.schema import apply_schema
from mdb.fanout import FanOutResult, gather, plan_fan_out, run_shard
from support.fanout import PARTITIONS, make_store
from support.mapfiles import map_dict

pytestmark = pytest.mark.postgres

SHARDS = ("u1", "u2", "u3")
RECYCLE = 2.0  # seconds: a connection older than this is replaced at checkout
USERS = [
    (GDID(0, 0, 5), "ann", [(1, "placed", 10, 0), (2, "B", 7, 3)]),
    (GDID(0, 1, 6), "bob", [(3, "é", 3, 1)]),
    (GDID(0, 2, 1500), "Cy", [(4, "placed", 0, 2), (5, "a", 99, 5), (6, "Zed", 42, 4)]),
    (GDID(0, 0, 1700), "dee", []),  # no orders: NULLs in an outer join
    (GDID(0, 1, 40), "eve", [(7, "b", 5, 6)]),
]

STATEMENTS: dict[str, tuple[Any, bool]] = {
    "columns, top-N": (select(Order.user_id, Order.order_id, Order.status, Order.total_cents, Order.placed_at)
                       .order_by(Order.placed_at.desc(), Order.order_id).limit(4), False),
    "all rows, unordered": (select(Order.order_id, Order.total_cents), False),
    "outer join: NULLs": (select(User.name, Order.order_id, Order.placed_at).outerjoin(User.orders)
                          .order_by(User.name.collate("C"), Order.order_id), False),
    "labels and literals": (select(User.user_id, literal_column("3").label("three"), (User.name + "!").label("loud"))
                            .order_by(User.user_id), False),
    "grouped aggregates": (select(Order.status, func.count().label("n"), func.avg(Order.total_cents).label("mean"),
                                  func.max(Order.placed_at)).group_by(Order.status).order_by(Order.status.collate("C")), True),
    "count": (select(func.count()).select_from(Order), True),
    "expanding IN: the SQLAlchemy way": (select(Order.order_id).where(Order.status.in_(["a", "b", "placed"]))
                                         .order_by(Order.order_id), False),
}


@pytest.fixture
def store(pg_databases: Any, tmp_path: Path) -> Iterator[Store]:
    store = make_store(tmp_path, pg_databases(3))
    insert_users(store, None, USERS)
    yield store
    store.close()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many shards each fan-out sent through :func:`mdb.scatter.read_many` (the real one, counted)."""
    counts: list[int] = []
    real = scatter.read_many

    def counted(targets: Any, *args: Any, **kwargs: Any) -> Any:
        counts.append(len(targets))
        return real(targets, *args, **kwargs)

    monkeypatch.setattr("mdb.fanout.read_many", counted)
    return counts


def _on_threads(store: Store, statement: Any, aggregate: bool) -> FanOutResult:
    """The fan-out the SQLAlchemy way: every shard run by the thread pool (the path before mdb.scatter)."""
    plan = plan_fan_out(store, store.router, "user", statement, aggregate=aggregate)
    per_shard, failed = gather(store, plan.servers, lambda s: run_shard(store, s, plan.query(s), False),
                               allow_partial=False, max_workers=None)
    return plan.result(per_shard, failed)


def _engines(store: Store) -> list[Engine]:
    return [store.engines.engine(s) for s in SHARDS]


def _checked_out(store: Store) -> int:
    return sum(engine.pool.checkedout() for engine in _engines(store))  # type: ignore[attr-defined]


def _one_connection(engine: Engine, sql: str) -> list[tuple[Any, ...]]:
    """``sql`` on the connection a checkout gives next (the pool reuses the newest idle one)."""
    fairy = engine.raw_connection()
    try:
        cursor = fairy.cursor()
        cursor.execute(sql)
        rows = list(cursor.fetchall()) if cursor.description else []
        cursor.close()
        return rows
    finally:
        fairy.close()


@pytest.mark.parametrize("name", list(STATEMENTS))
def test_a_warm_fan_out_reads_what_the_thread_pool_reads(store: Store, sent: list[int], name: str) -> None:
    statement, aggregate = STATEMENTS[name]
    cold = _on_threads(store, statement, aggregate)
    warm = [store.fan_out("user", statement, aggregate=aggregate) for _ in range(3)]  # the 2nd, 3rd: prepared
    expanding = name.startswith("expanding")
    assert sent == ([] if expanding else [3, 3, 3])
    for result in warm:
        assert [tuple(r) for r in result.rows] == [tuple(r) for r in cold.rows]
        assert [r._fields for r in result.rows] == [r._fields for r in cold.rows]
        assert [[type(v) for v in r] for r in result.rows] == [[type(v) for v in r] for r in cold.rows]
        if not aggregate:  # rows are keyed by the selected columns too, as a CursorResult's are
            for column in statement.selected_columns:
                if isinstance(column, Column):
                    assert [r._mapping[column] for r in result.rows] == [r._mapping[column] for r in cold.rows]
    assert len(cold.rows) > 0
    assert _checked_out(store) == 0


ENTITY_STATEMENTS = {
    "top-N of an entity": select(Order).order_by(Order.placed_at.desc(), Order.order_id).limit(4),
    "top-N with OFFSET and a WHERE": select(Order).where(Order.total_cents < 50).order_by(Order.total_cents, Order.order_id)
    .offset(1).limit(3),
    "every row of an entity": select(User).order_by(User.name.collate("C")),
}


def _state(instance: Any) -> tuple[Any, ...]:
    state = sa_inspect(instance)
    columns = tuple(getattr(instance, c.key) for c in state.mapper.column_attrs)
    return type(instance), columns, state.key, state.detached, state.modified, sorted(state.unloaded)


@pytest.mark.parametrize("name", list(ENTITY_STATEMENTS))
def test_a_warm_orm_fan_out_returns_the_instances_the_thread_pool_returns(store: Store, sent: list[int], name: str) -> None:
    statement = ENTITY_STATEMENTS[name]
    cold = _on_threads(store, statement, False)
    warm = store.fan_out("user", statement)
    assert sent == [3]
    assert [r._fields for r in warm.rows] == [r._fields for r in cold.rows]
    assert [_state(r[0]) for r in warm.rows] == [_state(r[0]) for r in cold.rows]
    entity = statement.column_descriptions[0]["entity"]
    assert [r._mapping[entity] for r in warm.rows] == [r[0] for r in warm.rows]
    assert len(warm.rows) > 1
    relationship = "orders" if entity is User else "line_items"
    for row in (warm.rows[0], cold.rows[0]):  # detached: a lazy load raises, as on an instance whose Session closed
        with pytest.raises(DetachedInstanceError):
            getattr(row[0], relationship)
    with Session(store.engines.engine("u1")) as session:  # and it can be attached again, unchanged
        merged = session.merge(warm.rows[0][0], load=False)
        assert not session.dirty and sa_inspect(merged).persistent


def test_an_entity_with_a_load_listener_is_loaded_through_a_session(store: Store, sent: list[int]) -> None:
    loaded: list[Any] = []

    def on_load(target: Any, context: Any) -> None:
        loaded.append(target)

    event.listen(User, "load", on_load)
    try:
        result = store.fan_out("user", select(User).order_by(User.name.collate("C")))
    finally:
        event.remove(User, "load", on_load)
    assert sent == []  # not sent the scatter way: its instances must be loaded, with their events
    assert sorted(id(r[0]) for r in result.rows) == sorted(id(u) for u in loaded) and loaded


def test_from_gdid_binds_a_gdid_as_the_thread_pool_does(store: Store, sent: list[int]) -> None:
    statement = select(Order.user_id, Order.order_id).order_by(Order.user_id, Order.order_id)
    start = GDID(0, 0, 1000)
    plan = plan_fan_out(store, store.router, "user", statement, from_gdid=start)
    per_shard, failed = gather(store, plan.servers, lambda s: run_shard(store, s, plan.query(s), False),
                               allow_partial=False, max_workers=None)
    cold = plan.result(per_shard, failed)
    warm = store.fan_out("user", statement, from_gdid=start)
    assert sent == [len(warm.servers)]
    assert [tuple(r) for r in warm] == [tuple(r) for r in cold]
    expected = sorted((gdid, GDID(0, 1, counter)) for gdid, _, orders in USERS for counter, *_ in orders
                      if gdid.sharding_value >= start.sharding_value)
    assert [tuple(r) for r in warm] == expected and expected


def test_a_shard_error_is_raised_as_the_thread_pool_raises_it_and_no_connection_stays_out(store: Store, sent: list[int]) -> None:
    count = select(func.count()).select_from(Order)
    with store.engines.engine("u2").begin() as conn:
        conn.execute(text("DROP TABLE orders CASCADE"))
    with pytest.raises(SchemaError) as raised:
        store.fan_out("user", count, aggregate=True)
    assert "'u2'" in str(raised.value)
    assert sent == [3]  # sent the scatter way, raised as the thread-pool path raises it (it ran the shard again)
    assert _checked_out(store) == 0


def test_a_statement_is_prepared_once_per_connection_and_never_more_than_the_cap(store: Store) -> None:
    count = select(func.count()).select_from(Order)
    prepared = f"SELECT name FROM pg_prepared_statements WHERE name LIKE '{scatter.PREPARED_PREFIX}%'"
    store.fan_out("user", count, aggregate=True)  # cold: one idle connection per shard afterwards
    for _ in range(5):
        assert store.fan_out("user", count, aggregate=True).rows[0][0] == 7
    for engine in _engines(store):
        assert len(_one_connection(engine, prepared)) == 1
    for k in range(scatter.MAX_PREPARED + 6):  # distinct statements: a literal of their own each
        distinct = select(func.count()).select_from(Order).where(Order.total_cents > literal_column(str(-1 - k)))
        assert store.fan_out("user", distinct, aggregate=True).rows == [(7,)]
    for engine in _engines(store):
        assert len(_one_connection(engine, prepared)) == scatter.MAX_PREPARED


def test_a_prepared_statement_dropped_behind_its_back_is_sent_again_on_the_same_connection(store: Store) -> None:
    count = select(func.count()).select_from(Order)
    for _ in range(3):
        store.fan_out("user", count, aggregate=True)
    engine = store.engines.engine("u1")
    pid = _one_connection(engine, "SELECT pg_backend_pid()")
    _one_connection(engine, "DEALLOCATE ALL")  # what psycopg does after a ROLLBACK where it prepared
    assert store.fan_out("user", count, aggregate=True).rows[0][0] == 7
    assert _one_connection(engine, "SELECT pg_backend_pid()") == pid  # the connection was kept, not replaced
    assert _checked_out(store) == 0


def test_a_prepared_statement_off_the_record_is_used_on_the_same_connection(store: Store) -> None:
    """The record of what a connection holds lost a name the server still has (mdb.ownership
    re-reads only its own names after a PREPARE failed half-way): PREPARE answers "already
    exists", and the statement under that name is the one meant (the name is its hash)."""
    count = select(func.count()).select_from(Order)
    for _ in range(3):
        store.fan_out("user", count, aggregate=True)
    engine = store.engines.engine("u2")
    pid = _one_connection(engine, "SELECT pg_backend_pid()")
    fairy = engine.raw_connection()
    known = prepared_names(fairy).known
    assert known is not None and any(n.startswith(scatter.PREPARED_PREFIX) for n in known)
    known.difference_update({n for n in known if n.startswith(scatter.PREPARED_PREFIX)})
    fairy.close()
    for _ in range(2):
        assert store.fan_out("user", count, aggregate=True).rows[0][0] == 7
    assert _one_connection(engine, "SELECT pg_backend_pid()") == pid
    assert _checked_out(store) == 0


def test_a_connection_due_for_recycling_is_reconnected_on_the_threads(pg_databases: Any, tmp_path: Path,
                                                                       sent: list[int]) -> None:
    """``pool_recycle`` makes a checkout connect anew: that shard must not connect on the
    sending thread (one after the other), so a pool whose idle connection is due counts as cold."""
    data = map_dict(dict(zip(("u1", "u2", "u3"), pg_databases(3))), central=["u1"], partitions=PARTITIONS)
    data["engine_defaults"] = {"pool_recycle": RECYCLE}
    path = tmp_path / "map.yaml"
    path.write_text(yaml.safe_dump(data))
    recycled = Store.from_yaml(path, types=[UserBriefcase])
    try:
        assert all(r.ok for r in apply_schema(recycled))
        insert_users(recycled, None, USERS)
        count = select(func.count()).select_from(Order)
        recycled.engines.dispose()
        assert recycled.fan_out("user", count, aggregate=True).rows == [(7,)]  # cold: the threads connect now
        sent.clear()
        assert recycled.fan_out("user", count, aggregate=True).rows == [(7,)]
        assert sent == [3]  # warm: every pool's idle connection young enough
        time.sleep(RECYCLE + 0.3)
        assert not any(scatter.has_idle_connection(recycled.engines.engine(s)) for s in SHARDS)
        assert recycled.fan_out("user", count, aggregate=True).rows == [(7,)]
        assert sent == [3]  # every shard reconnected on the thread pool
        assert recycled.fan_out("user", count, aggregate=True).rows == [(7,)]
        assert sent == [3, 3]  # and the fresh connections are sent to again
    finally:
        recycled.close()


def test_an_interrupted_scatter_puts_no_busy_connection_back(store: Store) -> None:
    count = select(func.count()).select_from(Order)
    store.fan_out("user", count, aggregate=True)
    plan = plan_fan_out(store, store.router, "user", count, aggregate=True)
    engines = [store.engines.engine(s) for s in plan.servers]
    read = scatter.compile_read(plan.query(plan.servers[0]).statement, engines[0].dialect)
    assert read is not None

    def interrupt(index: int, started: float, ended: float) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the other shards' statements are in flight

    with pytest.raises(KeyboardInterrupt):
        scatter.read_many([(e, read) for e in engines], 16, interrupt)
    assert _checked_out(store) == 0
    for _ in range(2):
        assert store.fan_out("user", count, aggregate=True).rows[0][0] == 7


def test_only_mdbs_postgresql_dialect_is_sent_this_way(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    sqlite = make_store(tmp_path, tmp_sqlite_urls(3))
    try:
        assert scatter.compile_read(select(func.count()).select_from(Order), sqlite.engines.engine("u1").dialect) is None
    finally:
        sqlite.close()


# -- the async fan-out sends warm shards the same way (mdb.aio.fanout) --------------------------


def _async_gates_in_use(aio: AsyncStore) -> int:
    return sum(aio.engines.gate(s).in_use for s in SHARDS)


def _async_checked_out(aio: AsyncStore) -> int:
    return sum(aio.engines.engine(s).sync_engine.pool.checkedout() for s in SHARDS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", list(STATEMENTS))
def test_a_warm_async_fan_out_reads_what_the_thread_pool_reads(store: Store, sent: list[int], name: str) -> None:
    statement, aggregate = STATEMENTS[name]
    cold = _on_threads(store, statement, aggregate)

    async def main() -> tuple[list[FanOutResult], int, int]:
        async with AsyncStore(store) as aio:
            results = [await aio.fan_out("user", statement, aggregate=aggregate) for _ in range(3)]  # cold, warm, prepared
            return results, _async_checked_out(aio), _async_gates_in_use(aio)

    results, checked_out, gates = asyncio.run(main())
    expanding = name.startswith("expanding")
    assert sent == ([] if expanding else [3, 3])  # the first found no idle async connection
    for result in results:
        assert [tuple(r) for r in result.rows] == [tuple(r) for r in cold.rows]
        assert [r._fields for r in result.rows] == [r._fields for r in cold.rows]
        assert [[type(v) for v in r] for r in result.rows] == [[type(v) for v in r] for r in cold.rows]
    assert len(cold.rows) > 0
    assert checked_out == 0 and gates == 0


@pytest.mark.parametrize("name", list(ENTITY_STATEMENTS))
def test_a_warm_async_orm_fan_out_returns_the_instances_the_thread_pool_returns(store: Store, sent: list[int], name: str) -> None:
    statement = ENTITY_STATEMENTS[name]
    cold = _on_threads(store, statement, False)

    async def main() -> FanOutResult:
        async with AsyncStore(store) as aio:
            await aio.fan_out("user", statement)
            return await aio.fan_out("user", statement)

    warm = asyncio.run(main())
    assert sent == [3]
    assert [r._fields for r in warm.rows] == [r._fields for r in cold.rows]
    assert [_state(r[0]) for r in warm.rows] == [_state(r[0]) for r in cold.rows]
    assert len(warm.rows) > 1


def test_an_async_shard_whose_gate_is_full_waits_its_turn_and_a_failed_one_is_raised(store: Store, sent: list[int]) -> None:
    """A shard whose server's gate has no free slot is not sent the scatter way (it would jump the
    queue): it runs as its own task once a slot is free. A shard that fails there is run again the
    task way and raised as that way raises it, naming the shard; no connection or slot stays out."""
    count = select(func.count()).select_from(Order)

    async def main() -> tuple[FanOutResult, int, int]:
        async with AsyncStore(store) as aio:
            await aio.fan_out("user", count, aggregate=True)  # warm: one idle connection per shard
            gate = aio.engines.gate("u2")
            taken = 0
            while gate.try_acquire():
                taken += 1

            async def free_later() -> None:
                await asyncio.sleep(0.05)
                for _ in range(taken):
                    gate.release()

            freeing = asyncio.create_task(free_later())
            queued = await aio.fan_out("user", count, aggregate=True)
            await freeing
            with store.engines.engine("u2").begin() as conn:
                conn.execute(text("DROP TABLE orders CASCADE"))
            with pytest.raises(SchemaError) as raised:
                await aio.fan_out("user", count, aggregate=True)
            assert "'u2'" in str(raised.value)
            return queued, _async_checked_out(aio), _async_gates_in_use(aio)

    queued, checked_out, gates = asyncio.run(main())
    assert queued.scalars() == [sum(len(orders) for _, _, orders in USERS)]
    assert sent == [2, 3]  # u2 left out while its gate was full; then all three, u2 failing there
    assert checked_out == 0 and gates == 0


def test_a_warm_async_fan_out_compiles_its_statement_once(store: Store, sent: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each async engine has a dialect of its own; the shards' statement is still compiled once
    per fan-out (one class, server version and pooler setting: :func:`mdb.scatter.compile_key`)."""
    compiled: list[Any] = []
    real = scatter.compile_read

    def counted(statement: Any, dialect: Any) -> Any:
        compiled.append(dialect)
        return real(statement, dialect)

    top = ENTITY_STATEMENTS["top-N of an entity"]

    async def main() -> None:
        async with AsyncStore(store) as aio:
            await aio.fan_out("user", top)  # cold: every shard connects
            dialects = {id(aio.engines.engine(s).sync_engine.dialect) for s in SHARDS}
            assert len(dialects) == 3  # what makes the point: one dialect instance per async engine
            monkeypatch.setattr("mdb.fanout.compile_read", counted)
            await aio.fan_out("user", top)

    asyncio.run(main())
    assert sent == [3] and len(compiled) == 1


def test_a_cancelled_async_scatter_puts_no_busy_connection_back(store: Store, sent: list[int]) -> None:
    """A fan-out task cancelled while a shard's answer is awaited (u2's count waits on a lock):
    the connections in flight are invalidated, never returned busy; every gate slot is given
    back; the next fan-out reads the right count."""
    count = select(func.count()).select_from(Order)
    total = sum(len(orders) for _, _, orders in USERS)

    async def main() -> tuple[int, int, list[Any]]:
        async with AsyncStore(store) as aio:
            await aio.fan_out("user", count, aggregate=True)  # connects: one idle connection per shard after it
            with store.engines.engine("u2").begin() as locker:
                locker.execute(text("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE"))
                task = asyncio.create_task(aio.fan_out("user", count, aggregate=True))
                await asyncio.sleep(0.3)
                assert not task.done()  # waiting for u2's answer
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            after = await aio.fan_out("user", count, aggregate=True)
            return _async_checked_out(aio), _async_gates_in_use(aio), after.scalars()

    checked_out, gates, after = asyncio.run(main())
    assert sent[0] == 3  # the cancelled fan-out went the scatter way (the first one connected)
    assert checked_out == 0 and gates == 0
    assert after == [total]
