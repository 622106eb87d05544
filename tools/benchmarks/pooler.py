"""Behind PgBouncer (transaction pooling): routed point read vs a plain Session through the same pooler.

Both sides go through one PgBouncer (``pool_mode = transaction``, 3 server connections per
database) to the same row of the same database. The baseline is what an application without
mdb writes behind such a pooler: ``Session(engine)`` on an engine with psycopg's automatic
prepare off (``prepare_threshold=None``, which any psycopg application behind PgBouncer < 1.21
in transaction mode needs). The routed side sends the ownership check with BEGIN as a call of its PL/pgSQL function.

A second pair prices the pooled form of the check itself, on a direct connection with raw
psycopg: BEGIN + the check + COMMIT, as a call of the PL/pgSQL check functions (what a pooled
engine sends) vs ``EXECUTE`` of the prepared statements (what a direct engine sends).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import psycopg
import yaml
from sqlalchemy import create_engine, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from benchmarks import BenchContext, Result, compare
from mdb.demo.models import User, UserBriefcase
from mdb.gdid import GDID
from mdb.ownership import PG_PREPARED, Prelude, ownership_prelude
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.testing.pgbouncer import PgBouncer

ROWS = 1000
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _store(directory: Path, pooled: list[str], direct: list[str]) -> Store:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "map.yaml"
    servers = {
        name: {"primary": p, "pooler": "transaction", "direct": d}
        for name, p, d in zip(("central", "u1"), pooled, direct, strict=True)
    }
    path.write_text(yaml.safe_dump({
        "version": 1, "servers": servers,
        "areas": {"central": {"kind": "central", "shards": ["central"]}, "user": {"partitions": [{"start": "0:0:0", "shards": ["u1"]}]}},
    }))
    tools = Store.from_yaml(path, types=[UserBriefcase])
    tools.engines.use_direct()
    try:
        failed = [r for r in apply_schema(tools) if not r.ok]
        if failed:
            raise RuntimeError(f"schema apply failed: {failed}")
    finally:
        tools.close()
    return Store.from_yaml(path, types=[UserBriefcase])


def _routed_vs_plain(ctx: BenchContext, store: Store, pooled_shard: str, ids: list[GDID]) -> list[Result]:
    plain = create_engine(pooled_shard, connect_args={"prepare_threshold": None})
    order = ids * 20
    random.Random(7).shuffle(order)
    cursor = iter(order * 1000)

    def routed(readonly: bool) -> Callable[[], object]:
        def read() -> object:
            g = next(cursor)
            with store.briefcase(UserBriefcase, g, readonly=readonly) as session:
                return session.scalars(select(User).where(User.user_id == g)).one()

        return read

    def baseline() -> object:
        g = next(cursor)
        with Session(plain) as session:
            return session.scalars(select(User).where(User.user_id == g)).one()

    iterations, rounds = ctx.iterations(2000, 200), ctx.iterations(5, 2)
    results = []
    try:
        for readonly in (True, False):  # the steady state: every briefcase's route kept in each mode (as benchmarks.briefcase does)
            for g in ids * 2:
                with store.briefcase(UserBriefcase, g, readonly=readonly) as session:
                    session.scalars(select(User).where(User.user_id == g)).one()
        for readonly in (True, False):
            value, base = compare(routed(readonly), baseline, iterations=iterations, rounds=rounds, warmup=ctx.iterations(300, 50))
            kind = "readonly" if readonly else "write"
            results.append(Result(
                "pooler", f"PgBouncer: routed point read ({kind} session)", value * 1e6, "µs/read",
                "plain Session through the same PgBouncer", base * 1e6, f"{iterations} reads x {rounds} rounds, median; pool of 3",
            ))
    finally:
        plain.dispose()
    return results


def _function_vs_prepared(ctx: BenchContext, store: Store, direct_shard: str, ids: list[GDID]) -> list[Result]:
    """Raw psycopg on a direct connection: the check function vs the prepared check."""
    u = make_url(direct_shard)
    conn = psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database, autocommit=True)
    conn.execute("; ".join(f"PREPARE {name} {definition}" for name, definition in PG_PREPARED.items()))
    cursor = iter(ids * 10_000)
    results = []

    def transaction(lock: bool, function: bool) -> Callable[[], object]:
        def run() -> object:
            prelude: Prelude = ownership_prelude("postgresql", store.router.locate("user", next(cursor)), lock=lock)
            conn.execute("; ".join(["BEGIN", *(prelude.unprepared if function else prelude.statements)]))
            return conn.execute("COMMIT")

        return run

    iterations, rounds = ctx.iterations(3000, 200), ctx.iterations(5, 2)
    try:
        for lock in (False, True):
            value, base = compare(transaction(lock, True), transaction(lock, False), iterations=iterations, rounds=rounds,
                                  warmup=ctx.iterations(300, 50))
            kind = "write check (locks + freeze marker)" if lock else "read check"
            results.append(Result(
                "pooler", f"direct psycopg: BEGIN + {kind} function + COMMIT", value * 1e6, "µs/txn",
                "the same with EXECUTE of prepared statements", base * 1e6, f"{iterations} x {rounds} rounds, median",
            ))
    finally:
        conn.close()
    return results


def run(ctx: BenchContext) -> list[Result]:
    direct = ctx.pg_urls(2)
    with PgBouncer(direct) as bouncer:
        pooled = bouncer.pooled_urls
        store = _store(ctx.tmpdir / "pooler", pooled, direct)
        try:
            ids = [GDID(0, 0, i) for i in range(1, ROWS + 1)]
            with store.transaction("u1") as conn:
                conn.execute(insert(User), [{"user_id": g, "email": f"{g}@example.com", "name": f"user {g}", "created_at": NOW} for g in ids])
            return _routed_vs_plain(ctx, store, pooled[1], ids) + _function_vs_prepared(ctx, store, direct[1], ids)
        finally:
            store.close()
