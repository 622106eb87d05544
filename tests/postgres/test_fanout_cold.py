"""The cold first fan-out (a new Store over many shard databases) on real PostgreSQL.

A columns-only fan-out reads each shard with ONE statement and no BEGIN/COMMIT
(:func:`mdb.engines.one_statement`): what it reads must stay what a transaction of its own
reads (committed data of one moment), the connection budget must hold while many new
connections are opened at once, and a server that is down must still be reported as down.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from support.mapfiles import map_dict
from sqlalchemy import create_engine, func, insert, select, text

from mdb.budget import ConnectionBudget, instance_of
from mdb.demo.models import User, UserBriefcase
from mdb.engines import EngineRegistry, one_statement
from mdb.errors import ServerUnavailableError
from mdb.gdid import GDID
from mdb.partition_map import ServerSpec
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.testing.postgres import PostgresServer
from mdb.urls import sqlalchemy_url

pytestmark = pytest.mark.postgres

SHARDS = 20
CAP = 4
COUNT = select(func.count().label("n")).select_from(User)


def _shard_map(path: Path, central: str, shards: list[str], engine: dict[str, Any] | None = None) -> Path:
    names = [f"s{i}" for i in range(len(shards))]
    data = map_dict({"c": central, **dict(zip(names, shards))}, central=["c"], partitions=[("0:0:0", names)])
    if engine:
        data["engine_defaults"] = engine
    path.write_text(yaml.safe_dump(data))
    return path


def _fill(shards: list[str]) -> list[int]:
    """Shard i gets i + 1 users (written directly: a fan-out reads every row of every shard); their GDID counters."""
    counters: list[int] = []
    for i, url in enumerate(shards):
        engine = create_engine(sqlalchemy_url(url))
        rows = [{"user_id": GDID(0, 0, 1000 * i + k), "email": f"{i}-{k}@example.org", "name": f"u{i}-{k}"}
                for k in range(i + 1)]
        with engine.begin() as conn:
            conn.execute(insert(User), rows)
        engine.dispose()
        counters += [1000 * i + k for k in range(i + 1)]
    return counters


@pytest.mark.slow  # 36 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_a_cold_fan_out_over_more_shards_than_the_cap_completes_within_it(
    pg_server_factory: Callable[[], PostgresServer], tmp_path: Path
) -> None:
    """20 shard databases on one instance, a cap of 4 connections, 16 fan-out threads, a new Store:
    every shard is read, and the process never holds more than 4 connections at once.

    What the process holds, not what pg_stat_activity shows: PostgreSQL removes a backend a
    moment after its client closed the connection, so a connection closed to make room and
    the one opened in its place can both be listed for that moment (sampled here: 5 for a cap
    of 4); a refusal for capacity in that moment is retried (mdb.budget.connect_patiently).
    """
    server = pg_server_factory()
    urls = [server.create_database() for _ in range(SHARDS + 1)]
    path = _shard_map(tmp_path / "map.yaml", urls[0], urls[1:], {"max_connections_per_instance": CAP, "pool_timeout": 60})
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store, parallel=4))
    counters = _fill(urls[1:])
    instance = instance_of(sqlalchemy_url(urls[0]))
    assert instance is not None

    budget = ConnectionBudget()
    with Store.from_yaml(path, types=[UserBriefcase], budget=budget) as store:
        count = store.fan_out("user", COUNT, aggregate=True, max_workers=16)
        ids = store.fan_out("user", select(User.user_id).order_by(User.user_id), max_workers=16)
        users = store.fan_out("user", select(User).order_by(User.user_id).limit(5), max_workers=16)  # the ORM path
    assert count.rows[0].n == len(counters)
    assert [row.user_id.counter for row in ids] == sorted(counters)
    assert [u.user_id.counter for u in users.scalars()] == sorted(counters)[:5]
    assert len(count.servers) == SHARDS and count.complete
    assert budget.peak_connections(instance) <= CAP
    assert budget.peak_connections() <= CAP


@pytest.mark.slow  # 45 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_a_down_server_is_reported_as_down_by_a_cold_fan_out(
    pg_server_factory: Callable[[], PostgresServer], tmp_path: Path
) -> None:
    up, down = pg_server_factory(), pg_server_factory()
    central = up.create_database()
    shards = [(up if i % 2 == 0 else down).create_database() for i in range(6)]
    path = _shard_map(tmp_path / "map.yaml", central, shards)
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    counters = _fill(shards)
    down.stop()
    with Store.from_yaml(path, types=[UserBriefcase]) as store:  # nothing pooled yet: every connection is new
        with pytest.raises(ServerUnavailableError, match="server 's1' is unavailable") as raised:
            store.fan_out("user", COUNT, aggregate=True)
        assert raised.value.server == "s1"
        assert "'s3'" in "".join(raised.value.__notes__) and "'s5'" in "".join(raised.value.__notes__)
        partial = store.fan_out("user", select(User.user_id).order_by(User.user_id), allow_partial=True)
    assert sorted(f.server for f in partial.failed) == ["s1", "s3", "s5"]
    on_up = sorted(c for c in counters if (c // 1000) % 2 == 0)
    assert [row.user_id.counter for row in partial] == on_up


def _registry(url: str) -> EngineRegistry:
    return EngineRegistry({"db": ServerSpec(primary=url)})


def test_one_statement_runs_without_begin_and_the_next_transaction_begins_again(pg_databases: Any) -> None:
    """The server's transaction status (sent with every ReadyForQuery): after a statement sent
    alone no transaction is open (the statement's own ended with it), after BEGIN and a
    statement one is, until COMMIT."""
    (url,) = pg_databases(1)
    registry = _registry(url)
    status = psycopg.pq.TransactionStatus
    try:
        with registry.engine("db").connect() as conn:
            driver = conn.connection.dbapi_connection
            assert driver is not None
            one_statement(conn)
            assert conn.execute(text("SELECT 41 + 1")).scalar_one() == 42
            assert driver.info.transaction_status == status.IDLE
            conn.commit()
            assert conn.execute(text("SELECT 41 + 1")).scalar_one() == 42  # taken once: BEGIN again
            assert driver.info.transaction_status == status.INTRANS
            conn.commit()
            assert driver.info.transaction_status == status.IDLE
    finally:
        registry.dispose()


def test_a_cold_fan_out_reads_committed_data_only(pg_databases: Any, tmp_path: Path) -> None:
    central, a, b = pg_databases(3)
    path = _shard_map(tmp_path / "map.yaml", central, [a, b])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    counters = _fill([a, b])
    writer = psycopg.connect(sqlalchemy_url(b).render_as_string(hide_password=False).replace("+psycopg", ""))
    try:
        writer.execute("INSERT INTO users (user_id, email, name, created_at) VALUES (%s, 'w@example.org', 'w', now())",
                       (bytes(GDID(0, 0, 99_999)),))  # open, not committed
        with Store.from_yaml(path, types=[UserBriefcase]) as store:
            assert store.fan_out("user", COUNT, aggregate=True).rows[0].n == len(counters)
            writer.commit()
            assert store.fan_out("user", COUNT, aggregate=True).rows[0].n == len(counters) + 1
    finally:
        writer.close()
