"""tests/postgres/test_shard_failure.py for async code: a stopped server fails only its own shard, named, secret masked."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from sqlalchemy import func, select
from support.failure import SECRET, schema_apply, with_password

from mdb import GDID, ServerUnavailableError, Store
from mdb.aio import AsyncStore
from mdb.demo.models import Order, User, UserBriefcase


def test_a_stopped_server_fails_only_its_own_shard_in_async_fan_out_and_sessions(
    pg_databases: Any, pg_server_factory: Any, tmp_path: Path
) -> None:
    a, b = pg_databases(2)
    dedicated = pg_server_factory()
    path = write_map(tmp_path, {"a": a, "b": b, "s": with_password(dedicated.create_database())}, central=["a"],
                     partitions=[("0:0:0", ["a", "b", "s"])])
    assert schema_apply(path).exit_code == 0
    users = [GDID(0, 0, n) for n in range(1, 10)]
    statement = select(Order.user_id, Order.total_cents).order_by(Order.total_cents.desc())

    async def main() -> None:
        async with AsyncStore(Store.from_yaml(path, types=[UserBriefcase]), owns_store=True) as aio:
            router = await aio.router()
            home = {g: router.locate("user", g).server for g in users}
            for g in users:
                async with aio.briefcase(UserBriefcase, g) as session:
                    session.add(User(user_id=g, email=f"{g.counter}@example.org", name=f"u{g.counter}"))
                    await session.flush()
                    session.add(Order(order_id=GDID(0, 1, g.counter), total_cents=g.counter))
            assert [r.user_id for r in await aio.fan_out("user", select(Order.user_id).order_by(Order.user_id))] == users

            dedicated.stop()
            with pytest.raises(ServerUnavailableError) as raised:
                await aio.fan_out("user", statement)
            assert raised.value.server == "s" and SECRET not in str(raised.value) and SECRET not in repr(raised.value)
            partial = await aio.fan_out("user", statement, allow_partial=True)
            alive = sorted((g for g in users if home[g] != "s"), key=lambda g: -g.counter)
            assert [r.user_id for r in partial] == alive
            assert not partial.complete and [f.server for f in partial.failed] == ["s"]
            assert SECRET not in partial.failed[0].error and "unavailable" in partial.failed[0].error
            assert [r.user_id for r in await aio.fan_out("user", statement.limit(2), allow_partial=True)] == alive[:2]
            count = await aio.fan_out("user", select(func.count().label("n")).select_from(Order), aggregate=True,
                                      allow_partial=True)
            assert count.rows[0].n == len(alive) and [f.server for f in count.failed] == ["s"]

            on_a = next(g for g in users if home[g] == "a")
            async with aio.briefcase(UserBriefcase, on_a, readonly=True) as session:
                assert len((await session.scalars(select(Order))).all()) == 1
            on_s = next(g for g in users if home[g] == "s")
            with pytest.raises(ServerUnavailableError) as down:
                async with aio.briefcase(UserBriefcase, on_s) as session:
                    (await session.scalars(select(Order))).all()
            assert down.value.server == "s" and SECRET not in str(down.value)
            assert all(gate.in_use == 0 for gate in aio.engines.gates())  # no slot kept by a failure

    asyncio.run(main())
