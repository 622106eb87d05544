"""Scale: routed reads, fan-out and schema apply at S = 4, 16, 64, 128 shards (issue 19).

S shard databases (plus one CENTRAL database) are created on 2 real PostgreSQL servers: the
number of servers does not matter to mdb's per-shard Python cost, the number of databases and
engines does. Per S, next to same-run baselines:

- routed read (``store.briefcase`` + ``get``) vs a plain Session ``get`` on the same shard;
- fan-out count and ORM top-10 vs a sequential loop and a thread-pool loop of plain Sessions
  running the same statement on every shard (the baselines skip mdb's 'incoming' filter);
- the cold first fan-out (a new Store: refresh, engines, connections) vs a warm one, and the
  first fan-out of a new Store after ``store.warm_up("user")`` vs the cold one; the CPU the
  PostgreSQL servers spent on the cold one (their new backends) vs the mdb process's CPU; the
  cold first fan-out of a new Store through PgBouncer (transaction pooling, its server
  connections already open: no backend to start) vs the direct one;
- schema apply wall time (first run, --parallel 8) vs a sequential re-run (nothing to create),
  and a parallel re-run vs the sequential one;
- connections the Store holds after the run vs S (one per shard).

``--quick`` runs S = 4 and 16 only; ``MDB_BENCH_SCALE_SIZES=128`` (comma-separated) runs the
sizes given, e.g. to re-measure the largest one without paying for the others.
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import ExitStack
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import Engine, create_engine, func, insert, select, text
from sqlalchemy.orm import Session

from benchmarks import BenchContext, Result, compare
from mdb.aio import AsyncStore
from mdb.demo.models import Order, User, UserBriefcase
from mdb.urls import sqlalchemy_url
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.testing.pgbouncer import PgBouncer, pgbouncer_unavailable_reason

SECTION = "scale"
SIZES = (4, 16, 64, 128)
QUICK_SIZES = (4, 16)
USERS_PER_SHARD = 4
ORDERS_PER_USER = 5
BASE = datetime(2026, 1, 1, tzinfo=timezone.utc)

COUNT = select(func.count()).select_from(Order)
TOP10 = select(Order).order_by(Order.placed_at.desc(), Order.order_id).limit(10)


def _databases(ctx: BenchContext, n: int) -> list[str]:
    """``n`` fresh databases, alternating over 2 servers."""
    urls: list[str] = []
    while len(urls) < n:
        urls.extend(ctx.pg_urls(2))
    return urls[:n]


def _write_map(path: Path, central: str, shards: list[str]) -> Path:
    servers = {"c": {"primary": central}, **{f"s{i}": {"primary": url} for i, url in enumerate(shards)}}
    data = {"version": 1, "servers": servers, "areas": {
        "central": {"kind": "central", "shards": ["c"]},
        "user": {"partitions": [{"start": "0:0:0", "shards": [f"s{i}" for i in range(len(shards))]}]},
    }}
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _fill(store: Store, engines: dict[str, Engine], shards: int) -> GDID:
    """USERS_PER_SHARD users per shard on average, each on the shard the router places it on."""
    by_server: dict[str, list[GDID]] = {}
    for counter in range(1, shards * USERS_PER_SHARD + 1):
        gid = GDID(0, 0, counter)
        by_server.setdefault(store.router.locate("user", gid).server, []).append(gid)
    for server, gids in by_server.items():
        with engines[server].begin() as conn:
            conn.execute(insert(User), [{"user_id": g, "email": f"u{g.counter}@example.org", "name": f"u{g.counter}",
                                         "created_at": BASE} for g in gids])
            conn.execute(insert(Order), [
                {"user_id": g, "order_id": GDID(0, 1, g.counter * 100 + k), "status": "placed",
                 "total_cents": k * 100, "placed_at": BASE.replace(hour=k, minute=g.counter % 60)}
                for g in gids for k in range(ORDERS_PER_USER)
            ])
    return next(iter(by_server.values()))[0]


def _pooled_map(path: Path, central: str, shards: list[str], pooled: list[str]) -> Path:
    """The map of :func:`_write_map` with the shards reached through a transaction pooler."""
    servers: dict[str, Any] = {"c": {"primary": central}}
    for i, (direct, through) in enumerate(zip(shards, pooled, strict=True)):
        servers[f"s{i}"] = {"primary": through, "pooler": "transaction", "direct": direct}
    data = {"version": 1, "servers": servers, "areas": {
        "central": {"kind": "central", "shards": ["c"]},
        "user": {"partitions": [{"start": "0:0:0", "shards": [f"s{i}" for i in range(len(shards))]}]},
    }}
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


class _ServersCpu:
    """CPU the local PostgreSQL servers spent in backends that have exited (ms), read from /proc.

    A backend is a child of its server's postmaster; the kernel adds an exited child's CPU to
    the parent's ``cutime``/``cstime``. So the CPU of the backends a cold fan-out starts shows
    there once its Store has closed them. Only where the servers run on this machine (they do
    in the benchmark); None elsewhere.
    """

    def __init__(self, urls: list[str]) -> None:
        self._postmasters: list[int] = []
        for url in urls:
            engine = create_engine(sqlalchemy_url(url))
            try:
                with engine.connect() as conn:
                    backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            finally:
                engine.dispose()
            try:
                self._postmasters.append(int(self._stat(backend)[1]))  # the backend's parent
            except OSError:
                self._postmasters = []
                return

    @staticmethod
    def _stat(pid: int) -> list[str]:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()

    def now(self) -> float | None:
        if not self._postmasters:
            return None
        try:
            ticks = sum(int(f[13]) + int(f[14]) for f in map(self._stat, self._postmasters))
        except OSError:
            return None
        return ticks * 1000 / os.sysconf("SC_CLK_TCK")


def _settled(measure: _ServersCpu) -> float | None:
    """The servers' CPU once the backends of just-closed connections have exited (they exit a
    moment after their clients leave)."""
    last = measure.now()
    for _ in range(20):
        time.sleep(0.1)
        now = measure.now()
        if now == last:
            return now
        last = now
    return last


def _loops(engines: list[Engine]) -> tuple[Callable[[Any], list[Any]], Callable[[Any], list[Any]]]:
    """(sequential loop, thread-pool loop) of plain Sessions running a statement on every engine."""

    def one(engine: Engine, statement: Any) -> list[Any]:
        with Session(engine) as session:
            return list(session.execute(statement).all())

    def sequential(statement: Any) -> list[Any]:
        return [one(e, statement) for e in engines]

    pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="bench-loop")

    def threaded(statement: Any) -> list[Any]:
        return list(pool.map(lambda e: one(e, statement), engines))

    return sequential, threaded


def _connections(admin: Engine, databases: list[str]) -> int:
    with admin.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(:names)"),
                                {"names": databases}).scalar_one())


def _one_size(ctx: BenchContext, shards: int, rounds: int, calls: int) -> list[Result]:
    urls = _databases(ctx, shards + 1)
    path = _write_map(ctx.tmpdir / f"scale-{shards}.yaml", urls[0], urls[1:])
    out: list[Result] = []
    store = Store.from_yaml(path, types=[UserBriefcase])
    start = time.perf_counter()
    first = apply_schema(store, parallel=8)
    first_apply = time.perf_counter() - start
    assert all(r.ok for r in first), [(r.server, r.error) for r in first if not r.ok]
    start = time.perf_counter()
    apply_schema(store, parallel=1)
    sequential_reapply = time.perf_counter() - start
    start = time.perf_counter()
    apply_schema(store, parallel=8)
    parallel_reapply = time.perf_counter() - start
    store.close()
    out.append(Result(SECTION, f"schema apply, first run, --parallel 8, S={shards}", first_apply, "s",
                      "sequential re-run (nothing to create)", sequential_reapply, "aim: < 3 s at S=128"))
    out.append(Result(SECTION, f"schema re-apply --parallel 8, S={shards}", parallel_reapply, "s",
                      "--parallel 1", sequential_reapply))

    plain = {f"s{i}": create_engine(sqlalchemy_url(url)) for i, url in enumerate(urls[1:])}
    store = Store.from_yaml(path, types=[UserBriefcase])
    try:
        user = _fill(store, plain, shards)
        store.close()
        servers_cpu = _ServersCpu(urls[:2])  # the databases alternate over the 2 servers
        before = _settled(servers_cpu)
        store = Store.from_yaml(path, types=[UserBriefcase])
        cpu = time.process_time()
        start = time.perf_counter()
        store.fan_out("user", COUNT, aggregate=True)
        cold = time.perf_counter() - start
        cpu = time.process_time() - cpu

        store.close()
        after = _settled(servers_cpu)
        if before is not None and after is not None:
            out.append(Result(SECTION, f"cold first fan-out count: CPU of the PostgreSQL servers, S={shards}",
                              after - before, "ms", "CPU of the mdb process", cpu * 1000,
                              f"{shards} new backends; both servers and mdb share this machine's {os.cpu_count()} cores"))
        out.extend(_through_pgbouncer(ctx, urls, shards, cold))
        store = Store.from_yaml(path, types=[UserBriefcase])
        start = time.perf_counter()
        assert store.warm_up("user") == []
        warming = time.perf_counter() - start
        start = time.perf_counter()
        store.fan_out("user", COUNT, aggregate=True)
        after_warm_up = time.perf_counter() - start
        out.append(Result(SECTION, f"first fan-out count after warm_up(), S={shards}", after_warm_up * 1000, "ms",
                          "cold first fan-out count", cold * 1000, f"warm_up() itself: {warming * 1000:.0f} ms"))

        expected = shards * USERS_PER_SHARD * ORDERS_PER_USER
        assert store.fan_out("user", COUNT, aggregate=True).rows[0][0] == expected
        warm_s, _ = compare(lambda: store.fan_out("user", COUNT, aggregate=True), lambda: None,
                            iterations=calls, rounds=rounds, warmup=1)
        out.append(Result(SECTION, f"cold first fan-out count, S={shards}", cold * 1000, "ms",
                          "warm fan-out count", warm_s * 1000, "new Store: refresh, engines, connections; aim < 300 ms at S=128"))

        sequential, threaded = _loops(list(plain.values()))
        for name, statement, aggregate, aim in (("count", COUNT, True, "0.5x"), ("ORM top-10", TOP10, False, "0.7x")):
            def fanned(statement: Any = statement, aggregate: bool = aggregate) -> None:
                store.fan_out("user", statement, aggregate=aggregate)

            def looped(statement: Any = statement) -> None:
                sequential(statement)

            def pooled_loop(statement: Any = statement) -> None:
                threaded(statement)

            subject, seq = compare(fanned, looped, iterations=calls, rounds=rounds, warmup=2)
            _, pooled = compare(fanned, pooled_loop, iterations=calls, rounds=rounds, warmup=2)
            per_shard = f"{subject / shards * 1000:.2f} ms/shard"
            out.append(Result(SECTION, f"fan-out {name}, S={shards}", subject * 1000, "ms",
                              "sequential loop of plain Sessions", seq * 1000, per_shard + f"; aim <= {aim} at S=128 (issue 34)"))
            out.append(Result(SECTION, f"fan-out {name} vs thread pool, S={shards}", subject * 1000, "ms",
                              "thread-pool loop of plain Sessions (16)", pooled * 1000, per_shard))
        out.extend(_async_fan_outs(store, sequential, shards, rounds, calls))

        server = store.router.locate("user", user).server
        engine = plain[server]

        def routed() -> None:
            with store.briefcase(UserBriefcase, user) as s:
                s.get(User, user)

        def direct() -> None:
            with Session(engine) as s, s.begin():
                s.get(User, user)

        r, d = compare(routed, direct, iterations=calls * 10, rounds=rounds, warmup=10)
        out.append(Result(SECTION, f"routed read, S={shards}", r * 1e6, "us", "plain Session get", d * 1e6))

        names = [sqlalchemy_url(u).database or "" for u in urls]
        for engine_ in plain.values():
            engine_.dispose()  # count the Store's connections only
        held = 0
        for url in urls[1:3]:  # the databases alternate over the 2 servers
            admin = create_engine(sqlalchemy_url(url).set(database="postgres"))
            held += _connections(admin, names)
            admin.dispose()
        out.append(Result(SECTION, f"connections held after the run, S={shards}", held, "connections",
                          "shards + CENTRAL", shards + 1, "both PostgreSQL servers"))
    finally:
        store.close()
        for engine_ in plain.values():
            engine_.dispose()
    return out


def _async_fan_outs(store: Store, sequential: Callable[[Any], list[Any]], shards: int, rounds: int, calls: int) -> list[Result]:
    """``AsyncStore.fan_out`` of the same statements on one event loop, against the same sequential
    loop and against the sync fan-out (both measured in the same rounds)."""
    out: list[Result] = []
    loop = asyncio.new_event_loop()
    aio = AsyncStore(store)
    try:
        for name, statement, aggregate in (("count", COUNT, True), ("ORM top-10", TOP10, False)):
            def fanned(statement: Any = statement, aggregate: bool = aggregate) -> None:
                loop.run_until_complete(aio.fan_out("user", statement, aggregate=aggregate))

            def looped(statement: Any = statement) -> None:
                sequential(statement)

            def synced(statement: Any = statement, aggregate: bool = aggregate) -> None:
                store.fan_out("user", statement, aggregate=aggregate)

            subject, seq = compare(fanned, looped, iterations=calls, rounds=rounds, warmup=2)
            _, sync = compare(fanned, synced, iterations=calls, rounds=rounds, warmup=2)
            per_shard = f"{subject / shards * 1000:.2f} ms/shard; one event loop"
            out.append(Result(SECTION, f"async fan-out {name}, S={shards}", subject * 1000, "ms",
                              "sequential loop of plain Sessions", seq * 1000, per_shard))
            out.append(Result(SECTION, f"async fan-out {name} vs the sync fan-out, S={shards}", subject * 1000, "ms",
                              "Store.fan_out", sync * 1000, per_shard))
    finally:
        loop.run_until_complete(aio.close())  # its async engines; the sync Store stays open
        loop.close()
    return out


def _through_pgbouncer(ctx: BenchContext, urls: list[str], shards: int, cold: float) -> list[Result]:
    """The cold first fan-out of a new Store through PgBouncer whose server connections are open."""
    if pgbouncer_unavailable_reason() is not None:
        return []
    with ExitStack() as stack:
        bouncer = stack.enter_context(PgBouncer(urls[1:], pool_size=2))
        path = _pooled_map(ctx.tmpdir / f"scale-{shards}-pooled.yaml", urls[0], urls[1:], bouncer.pooled_urls)
        with Store.from_yaml(path, types=[UserBriefcase]) as first:  # opens PgBouncer's server connections
            first.fan_out("user", COUNT, aggregate=True)
        store = stack.enter_context(Store.from_yaml(path, types=[UserBriefcase]))
        start = time.perf_counter()
        store.fan_out("user", COUNT, aggregate=True)
        through = time.perf_counter() - start
    return [Result(SECTION, f"cold first fan-out count through PgBouncer, S={shards}", through * 1000, "ms",
                   "cold first fan-out count (direct)", cold * 1000,
                   "new Store; PgBouncer's server connections already open (no backend to start)")]


def run(ctx: BenchContext) -> list[Result]:
    rounds = ctx.iterations(5, 2)
    calls = ctx.iterations(5, 2)
    results: list[Result] = []
    chosen = os.environ.get("MDB_BENCH_SCALE_SIZES")
    sizes = tuple(int(n) for n in chosen.split(",")) if chosen else QUICK_SIZES if ctx.quick else SIZES
    for shards in sizes:
        results.extend(_one_size(ctx, shards, rounds, calls))
    return results
