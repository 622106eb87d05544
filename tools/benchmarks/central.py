"""CENTRAL lookups: the in-process cache next to a dict, and a cache miss next to a held engine.

- cached lookup (``verify=False``): what a hit costs in this process, next to a plain dict
  ``get`` of the same normalized key (the floor any cache has);
- cached lookup verified on the root (the default): a hit plus the root-column confirmation,
  a readonly briefcase session on the user shard, next to a plain Session point read there;
- cache miss: ``lookup`` with a TTL of 0 (every call reads CENTRAL), next to the same SELECT on
  an engine the caller holds itself.
All on real PostgreSQL (one CENTRAL server, one user server).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import yaml
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from benchmarks import BenchContext, Result, compare
from mdb.central import Central, central_index, strip_casefold
from mdb.demo.models import User, UserBriefcase
from mdb.demo.repositories import EmailIndex, UserRepository
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store

USERS = 300


def _store(directory: Path, central: str, shard: str) -> Store:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "map.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1,
        "servers": {"central": {"primary": central}, "u1": {"primary": shard}},
        "areas": {"central": {"kind": "central", "shards": ["central"]},
                  "user": {"partitions": [{"start": "0:0:0", "shards": ["u1"]}]}},
    }))
    store = Store.from_yaml(path, types=[UserBriefcase])
    failed = [r for r in apply_schema(store) if not r.ok]
    if failed:
        raise RuntimeError(f"schema apply failed: {failed}")
    return store


def _cycle(items: list[str]) -> Callable[[], str]:
    order = list(items)
    random.Random(11).shuffle(order)
    state = {"i": 0}

    def next_item() -> str:
        state["i"] = (state["i"] + 1) % len(order)
        return order[state["i"]]

    return next_item


def run(ctx: BenchContext) -> list[Result]:
    central_url, shard_url = ctx.pg_urls(2)
    store = _store(ctx.tmpdir / "central-bench", central_url, shard_url)
    users = UserRepository(store)
    n = ctx.iterations(USERS, 60)
    emails = [f"Bench{i:05d}@Example.org" for i in range(n)]
    by_email: dict[str, GDID] = {strip_casefold(e): users.register(e, "bench") for e in emails}
    plain_central = create_engine(central_url)
    plain_shard = create_engine(shard_url)
    results: list[Result] = []
    try:
        for e in emails:  # warm the cache
            store.central.lookup(EmailIndex, e)
        pick = _cycle(emails)
        plain = dict(by_email)

        def cached() -> object:
            return store.central.lookup(EmailIndex, pick(), verify=False)

        def dict_get() -> object:
            return plain.get(strip_casefold(pick()))

        it, rounds = ctx.iterations(50_000, 5_000), ctx.iterations(5, 2)
        value, base = compare(cached, dict_get, iterations=it, rounds=rounds, warmup=1000)
        results.append(Result("central", "cached lookup (verify=False)", 1 / value, "lookups/s",
                              "dict.get of the normalized key", 1 / base, f"{n} keys, {it} x {rounds} rounds, median"))

        def verified() -> object:
            return store.central.lookup(EmailIndex, pick())

        def root_read() -> object:
            g = by_email[strip_casefold(pick())]
            with Session(plain_shard) as s:
                return s.scalars(select(User.email).where(User.user_id == g)).one()

        it = ctx.iterations(1000, 100)
        value, base = compare(verified, root_read, iterations=it, rounds=rounds, warmup=100)
        results.append(Result("central", "cached lookup verified on the root (default)", value * 1e6, "µs/lookup",
                              "plain Session point read of the root row", base * 1e6,
                              "the hit is confirmed in a readonly briefcase session on the user shard"))

        cold = Central(store, ttl=0.0)
        c = central_index.c
        stmt = select(c.gdid, c.state).where(c.index_name == EmailIndex.name, c.slot == GDID.ZERO)

        def miss() -> object:
            return cold.lookup(EmailIndex, pick())

        def held_engine() -> object:
            key = strip_casefold(pick())
            with plain_central.connect() as conn:
                row = conn.execute(stmt.where(c.key == key)).first()
                assert row is not None
                return row

        value, base = compare(miss, held_engine, iterations=it, rounds=rounds, warmup=100)
        assert cold.cache_stats.hits == 0
        results.append(Result("central", "cache miss (lookup reads CENTRAL)", value * 1e6, "µs/lookup",
                              "same SELECT on a held engine", base * 1e6, "TTL 0: every lookup goes to the server"))
    finally:
        plain_central.dispose()
        plain_shard.dispose()
        store.close()
    return results
