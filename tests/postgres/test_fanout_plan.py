"""The fan-out plan: decided before any I/O and run alike by the thread pool and by asyncio.

An ORM fan-out whose load is ONE statement goes out without BEGIN and COMMIT (one round trip
per shard, as a columns-only one); a load that runs further statements (a ``selectinload``)
keeps its transaction, so all of them read one snapshot. The merge of a top-N is a heap over
the shards' sorted streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from support.mapfiles import write_map
from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import selectinload
from support.briefcase import RoundTripCounter, _proxied

from mdb.aio import AsyncStore
from mdb.demo.models import Order, OrderLineItem, User, UserBriefcase
from mdb.fanout import merge_sorted, plan_fan_out
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store

WHEN = datetime(2026, 1, 1, tzinfo=timezone.utc)
TOP3 = select(Order).order_by(Order.total_cents.desc(), Order.order_id).limit(3)


def _fill(store: Store, users: int) -> None:
    """``users`` users with two orders each (one line item per order), on their routed shards."""
    for n in range(1, users + 1):
        gdid = GDID(0, 0, n)
        with store.briefcase(UserBriefcase, gdid) as session:
            session.add(User(user_id=gdid, email=f"{n}@example.org", name=f"u{n}", created_at=WHEN))
            for k in range(2):
                order_id = GDID(0, 1, n * 10 + k)
                session.add(Order(order_id=order_id, status="placed", total_cents=n * 100 + k, placed_at=WHEN))
                session.flush()
                session.add(OrderLineItem(line_id=GDID(0, 2, n * 10 + k), order_id=order_id, sku=f"sku-{n}-{k}",
                                          quantity=1, price_cents=1))


def test_the_plan_sends_an_orm_load_of_one_statement_without_a_transaction(tmp_sqlite_urls: Callable[[int], list[str]],
                                                                             tmp_path: Path) -> None:
    central, a, b = tmp_sqlite_urls(3)
    path = write_map(tmp_path, {"central": central, "a": a, "b": b}, central=["central"], partitions=[("0:0:0", ["a", "b"])])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
        plans = {
            "top3": plan_fan_out(store, store.router, "user", TOP3),
            "selectin": plan_fan_out(store, store.router, "user", TOP3.options(selectinload(Order.line_items))),
            "count": plan_fan_out(store, store.router, "user", select(func.count()).select_from(Order), aggregate=True),
        }
        assert plans["top3"].servers == ["a", "b"]
        assert {(n, p.query("a").orm, p.query("a").one_statement) for n, p in plans.items()} == {
            ("top3", True, True), ("selectin", True, False), ("count", False, True),
        }


def test_a_top_n_merge_pops_only_what_it_returns() -> None:
    """The merge is lazy: a top-2 over three sorted streams keys the heads and the rows it pops, not every row."""
    keyed: list[int] = []

    def key(value: int) -> int:
        keyed.append(value)
        return value

    streams = [list(range(s, 3000, 3)) for s in range(3)]
    assert merge_sorted(streams, key, offset=0, limit=2) == [0, 1]  # type: ignore[arg-type]
    assert len(keyed) <= 6, keyed


def test_an_orm_fan_out_costs_one_round_trip_per_shard_and_a_selectin_load_keeps_its_transaction(
    pg_databases: Callable[[int], list[str]], tmp_path: Path,
) -> None:
    central, a, b = pg_databases(3)
    proxies = {name: RoundTripCounter(make_url(url).host or "127.0.0.1", make_url(url).port or 5432) for name, url in (("a", a), ("b", b))}
    try:
        path = write_map(
            tmp_path, {"central": central, "a": _proxied(a, proxies["a"].port), "b": _proxied(b, proxies["b"].port)},
            central=["central"], partitions=[("0:0:0", ["a", "b"])],
        )
        with Store.from_yaml(path, types=[UserBriefcase]) as store:
            assert all(r.ok for r in apply_schema(store))
            _fill(store, 6)
            expected = [n * 100 + k for n in (6, 5) for k in (1, 0)][:3]

            def trips(statement: object) -> int:
                for _ in range(7):  # past psycopg's prepare_threshold, as test_briefcase_pg does
                    store.fan_out("user", statement)
                before = sum(p.ready_for_query for p in proxies.values())
                result = store.fan_out("user", statement)
                assert [o.total_cents for o in result.scalars()] == expected
                return sum(p.ready_for_query for p in proxies.values()) - before

            assert trips(TOP3) == 2  # one statement per shard, no BEGIN or COMMIT
            assert trips(TOP3.options(selectinload(Order.line_items))) == 2 * 4  # BEGIN, SELECT, SELECT IN, COMMIT
            loaded = store.fan_out("user", TOP3.options(selectinload(Order.line_items))).scalars()
            assert [[i.sku for i in o.line_items] for o in loaded] == [["sku-6-1"], ["sku-6-0"], ["sku-5-1"]]

            async def on_the_loop() -> tuple[list[int], list[list[str]], int]:
                aio = AsyncStore(store)
                try:
                    top = await aio.fan_out("user", TOP3)
                    eager = await aio.fan_out("user", TOP3.options(selectinload(Order.line_items)))
                    count = await aio.fan_out("user", select(func.count()).select_from(Order), aggregate=True)
                    return ([o.total_cents for o in top.scalars()], [[i.sku for i in o.line_items] for o in eager.scalars()],
                            count.rows[0][0])
                finally:
                    await aio.close()

            totals, skus, count = asyncio.run(on_the_loop())
            assert totals == expected and skus == [["sku-6-1"], ["sku-6-0"], ["sku-5-1"]] and count == 12
    finally:
        for proxy in proxies.values():
            proxy.close()
