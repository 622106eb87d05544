"""Shared by test_fanout and the suites beside it (moved out of test_fanout, which used to be imported by other test modules)."""

from __future__ import annotations

from pathlib import Path
from hypothesis import strategies as st
from support.mapfiles import write_map
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from mdb import GDID, Store
from mdb.demo.models import User, UserBriefcase
from mdb.schema import apply_schema
from datetime import datetime, timedelta, timezone
from mdb.demo.models import Order

STATUSES = ["a", "B", "b", "placed", "Zed", "é"]
PARTITIONS = [("0:0:0", ["u1", "u2"]), ("0:0:1000", ["u3"])]
UserRows = list[tuple[GDID, str, list[tuple[int, str, int, int]]]]
BASE_TIME = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_store(tmp_path: Path, urls: list[str], extra: dict[str, str] | None = None) -> Store:
    servers = {"u1": urls[0], "u2": urls[1], "u3": urls[2], **(extra or {})}
    path = write_map(tmp_path, servers, central=["u1"], partitions=PARTITIONS)
    store = Store.from_yaml(path, types=[UserBriefcase])
    reports = apply_schema(store)
    assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    return store


def insert_users(store: Store, reference: Engine | None, users: UserRows) -> None:
    for gdid, name, orders in users:
        with store.briefcase(UserBriefcase, gdid) as s:
            s.add(User(user_id=gdid, email=f"{name}@example.org", name=name))
            s.flush()
            s.add_all(_orders(gdid, orders))
    if reference is not None:
        with Session(reference) as s, s.begin():
            for gdid, name, orders in users:
                s.add(User(user_id=gdid, email=f"{name}@example.org", name=name))
            s.flush()
            for gdid, _name, orders in users:
                s.add_all(_orders(gdid, orders))


@st.composite
def user_rows(draw: st.DrawFn) -> UserRows:
    counters = draw(st.lists(st.integers(1, 2500), min_size=1, max_size=7, unique=True))
    order_ids = iter(range(1, 10_000))
    users = []
    for counter in counters:
        gdid = GDID(0, draw(st.integers(0, 2)), counter)
        orders = draw(st.lists(
            st.tuples(st.sampled_from(STATUSES), st.integers(0, 4), st.integers(0, 3)), max_size=5,
        ))
        users.append((gdid, draw(st.sampled_from(["ann", "bob", "Cy", "dee"])),
                      [(next(order_ids), *o) for o in orders]))
    return users


def _orders(gdid: GDID, orders: list[tuple[int, str, int, int]]) -> list[Order]:
    return [
        Order(user_id=gdid, order_id=GDID(0, 1, counter), status=status, total_cents=total,
              placed_at=BASE_TIME + timedelta(hours=hours))
        for counter, status, total, hours in orders
    ]


