"""A stopped PostgreSQL server fails only its own shard's work, and says which server it was.

Three shards of one partition: two on pool servers, one on a server of the test's own that it
stops. Its URL carries a password (trust auth ignores it) that must never show up in errors,
partial results or the schema report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from sqlalchemy import func, select

from mdb import GDID, ServerUnavailableError, Store
from mdb.demo.models import Order, User, UserBriefcase
from support.failure import SECRET, schema_apply, with_password



def test_a_stopped_server_fails_only_its_own_shard(
    pg_databases: Any, pg_server_factory: Any, tmp_path: Path
) -> None:
    a, b = pg_databases(2)
    dedicated = pg_server_factory()
    s = with_password(dedicated.create_database())
    servers = {"a": a, "b": b, "s": s}
    path = write_map(tmp_path, servers, central=["a"], partitions=[("0:0:0", ["a", "b", "s"])])
    assert schema_apply(path).exit_code == 0

    store = Store.from_yaml(path, types=[UserBriefcase])
    users = [GDID(0, 0, n) for n in range(1, 10)]
    home = {g: store.router.locate("user", g).server for g in users}
    assert set(home.values()) == {"a", "b", "s"}
    for g in users:
        with store.briefcase(UserBriefcase, g) as session:
            session.add(User(user_id=g, email=f"{g.counter}@example.org", name=f"u{g.counter}"))
            session.flush()
            session.add(Order(order_id=GDID(0, 1, g.counter), total_cents=g.counter))
    everything = store.fan_out("user", select(Order.user_id).order_by(Order.user_id))
    assert [r.user_id for r in everything] == users

    dedicated.stop()
    try:
        statement = select(Order.user_id, Order.total_cents).order_by(Order.total_cents.desc())
        with pytest.raises(ServerUnavailableError) as raised:
            store.fan_out("user", statement)
        assert raised.value.server == "s" and "'s'" in str(raised.value)
        assert SECRET not in str(raised.value) and SECRET not in repr(raised.value)

        partial = store.fan_out("user", statement, allow_partial=True)
        alive = sorted((g for g in users if home[g] != "s"), key=lambda g: -g.counter)
        assert [r.user_id for r in partial] == alive
        assert not partial.complete and [f.server for f in partial.failed] == ["s"]
        assert SECRET not in partial.failed[0].error and "unavailable" in partial.failed[0].error
        limited = store.fan_out("user", statement.limit(2), allow_partial=True)
        assert [r.user_id for r in limited] == alive[:2]

        count = store.fan_out("user", select(func.count().label("n")).select_from(Order), aggregate=True,
                              allow_partial=True)
        assert count.rows[0].n == len(alive) and [f.server for f in count.failed] == ["s"]

        # Briefcase sessions on the other shards are untouched; the down shard's name their server.
        on_a = next(g for g in users if home[g] == "a")
        with store.briefcase(UserBriefcase, on_a) as session:
            session.add(Order(order_id=GDID(0, 1, 100), total_cents=1))
        with store.briefcase(UserBriefcase, on_a, readonly=True) as session:
            assert len(session.scalars(select(Order)).all()) == 2
        on_s = next(g for g in users if home[g] == "s")
        with pytest.raises(ServerUnavailableError) as down:
            with store.briefcase(UserBriefcase, on_s) as session:
                session.scalars(select(Order)).all()
        assert down.value.server == "s" and SECRET not in str(down.value)

        # Schema apply on a new map version with a new spare server: the spare and the live
        # shards are done, the down one reported, exit code 1.
        fresh = pg_databases(1)[0]
        write_map(tmp_path, {**servers, "n": fresh}, central=["a"], partitions=[("0:0:0", ["a", "b", "s"])], version=2)
        result = schema_apply(path, "--json")
        assert result.exit_code == 1
        shards = {r["server"]: r for r in json.loads(result.stdout)["shards"]}
        assert not shards["s"]["ok"] and "'s'" in shards["s"]["error"] and "unavailable" in shards["s"]["error"]
        assert shards["a"]["ok"] and shards["b"]["ok"] and shards["n"]["ok"]
        assert "orders" in shards["n"]["created"] and shards["a"]["created"] == []
        text = schema_apply(path)
        assert text.exit_code == 1 and "failed" in text.stdout and "1 of 4 shards not done: s" in text.stdout
    finally:
        store.close()
