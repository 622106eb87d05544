"""Async sessions and fan-outs feed the instruments sync ones feed (mdb.telemetry), on real PostgreSQL.

The SDK and its in-memory reader are tests/postgres/test_telemetry.py's (the global providers can be
set once per process); each test reads the deltas of the cumulative series around its workload.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from support.moves import make_cluster
from sqlalchemy import select, text
from support.telemetry import Otel, assert_no_gdid_or_key, otel, s  # noqa: F401 (otel: the suite's fixture)

from mdb.aio import AsyncStore
from mdb.demo.models import Address, User, UserBriefcase
from mdb.errors import StaleRouteError
from mdb.gdid import GDID
from mdb.moves.move import move_briefcase
from mdb.router import ShardLayout
from mdb.schema import stamp_layout
from mdb.store import Store
from mdb.telemetry import SECONDS_BUCKETS


async def add_user(aio: AsyncStore, gdid: GDID) -> None:
    async with aio.briefcase(UserBriefcase, gdid) as session:
        session.add(User(user_id=gdid, email=f"{gdid}@example.com", name=f"user {gdid.counter}"))
        session.add(Address(address_id=GDID(0, 1, gdid.counter), line1="1 Main St", city="Springfield", country="US"))


@pytest.mark.postgres
def test_async_sessions_stale_routes_and_fan_outs_record_the_sync_series(
    otel: Otel, pg_databases: Callable[[int], list[str]], tmp_path: Path
) -> None:
    """n sessions, one error, one stale route after a move, a fan-out and a partial one: exact deltas."""
    c, u1, u2 = pg_databases(3)
    cluster = make_cluster({"c": c, "u1": u1, "u2": u2}, tmp_path, [("0:0:0", ["u1"])])  # u2: a spare
    admin, stale = cluster.store(), cluster.store()
    n = 4

    async def main() -> None:
        async with AsyncStore(admin) as aio, AsyncStore(stale) as old:
            await old.router()  # routed before the move below: it goes stale
            before = otel.values()
            users = [await aio.new_gdid(UserBriefcase) for _ in range(n)]
            for g in users:
                await add_user(aio, g)
            with pytest.raises(ZeroDivisionError):
                async with aio.briefcase(UserBriefcase, users[0]):
                    1 / 0  # noqa: B018 - an application error inside the session
            assert otel.delta(before) == {
                s("mdb.briefcase.sessions", area="user", server="u1", outcome="ok"): n,
                s("mdb.briefcase.sessions", area="user", server="u1", outcome="error"): 1,
                s("mdb.gdid.blocks", scope="user"): 1,
            }
            spans = [sp for sp in otel.finished_spans() if sp.name == "mdb.briefcase"][-(n + 1):]
            assert Counter((sp.attributes or {}).get("mdb.outcome") for sp in spans) == {"ok": n, "error": 1}
            assert all((sp.attributes or {}).get("mdb.server") == "u1" for sp in spans)

            # Concurrent sessions on one loop: each span is a root of its own (no task sees another's).
            otel.spans.clear()
            await asyncio.gather(*(read_user(aio, g) for g in users * 3))
            spans = [sp for sp in otel.finished_spans() if sp.name == "mdb.briefcase"]
            assert len(spans) == 3 * n and all(sp.parent is None for sp in spans)

            result = await asyncio.to_thread(move_briefcase, admin, "user", users[0], "u2")
            assert result.status == "done"

            before = otel.values()
            assert await read_user(old, users[0]) == "u2"  # refused on u1 (fenced), refreshed, retried
            assert otel.delta(before) == {
                s("mdb.ownership.refusals", area="user", server="u1", reason="stale_route"): 1,
                s("mdb.route.stale_retries", area="user", server="u1", reason="stale_route"): 1,
                s("mdb.briefcase.sessions", area="user", server="u2", outcome="ok"): 1,
            }

            before = otel.values()
            out = await aio.fan_out("user", select(User.user_id))
            assert sorted(r.user_id for r in out) == sorted(users) and set(out.servers) == {"u1", "u2"}
            assert otel.delta(before) == {s("mdb.fanout.shard.duration", server=srv, outcome="ok"): 1 for srv in out.servers}
            assert otel.bounds("mdb.fanout.shard.duration") == {SECONDS_BUCKETS}

            # u2 loses its users table: a partial fan-out counts the missing shard and its failed read.
            async with aio.transaction("u2") as conn:
                await conn.execute(text(f"ALTER TABLE {User.__tablename__} RENAME TO users_elsewhere"))
            before = otel.values()
            partial = await aio.fan_out("user", select(User.user_id), allow_partial=True)
            assert [f.server for f in partial.failed] == ["u2"]
            assert sorted(r.user_id for r in partial) == sorted(users[1:])
            assert otel.delta(before) == {
                s("mdb.fanout.shard.duration", server="u1", outcome="ok"): 1,
                s("mdb.fanout.shard.duration", server="u2", outcome="error"): 1,
                s("mdb.fanout.partial_failures", server="u2"): 1,
            }
            keys = [str(g) for g in users] + [f"{g}@example.com" for g in users]
            assert_no_gdid_or_key(otel.all_label_values(), keys)
            assert_no_gdid_or_key([v for sp in otel.finished_spans() for v in (sp.attributes or {}).values()], keys)

    try:
        asyncio.run(main())
    finally:
        admin.close()
        stale.close()


async def read_user(aio: AsyncStore, gdid: GDID) -> str:
    async with aio.briefcase(UserBriefcase, gdid, readonly=True) as session:
        assert (await session.scalars(select(User.user_id))).one() == gdid
        return session.placement.server


@pytest.mark.postgres
def test_a_refused_async_session_counts_exactly_as_a_refused_sync_one(
    otel: Otel, pg_databases: Callable[[int], list[str]], tmp_path: Path
) -> None:
    """A shard stamped for another layout refuses every attempt: the sync Store and the AsyncStore
    record the same refusals, retries and failed session (server "-": it never got one)."""
    c, u1 = pg_databases(2)
    cluster = make_cluster({"c": c, "u1": u1}, tmp_path, [("0:0:0", ["u1"])])
    store = Store.from_yaml(cluster.path, types=[UserBriefcase], max_stale_retries=2)
    with store.transaction("u1") as conn:
        assert stamp_layout(conn, ShardLayout("user", GDID.ZERO, None, 0, 3), 1, replace=True) is None
    gdid = GDID(0, 0, 8)  # shard 2 of 3 under the stamp: refused on u1

    async def refused_async() -> None:
        async with AsyncStore(store) as aio:
            with pytest.raises(StaleRouteError):
                await add_user(aio, gdid)

    try:
        before = otel.values()
        with pytest.raises(StaleRouteError), store.briefcase(UserBriefcase, gdid):
            pass
        sync = otel.delta(before)
        before = otel.values()
        asyncio.run(refused_async())
        assert otel.delta(before) == sync == {
            s("mdb.ownership.refusals", area="user", server="u1", reason="stale_route"): 3,
            s("mdb.route.stale_retries", area="user", server="u1", reason="stale_route"): 2,
            s("mdb.briefcase.sessions", area="user", server="-", outcome="error"): 1,
        }
    finally:
        store.close()
