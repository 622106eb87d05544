"""Routed point read: a briefcase session fetching one row by GDID vs a plain SQLAlchemy Session.

Both sides read the same row of the same table on the same database. The baseline is what an
application without mdb would write: an engine it holds itself and ``Session(engine)``. The
routed side adds routing, the ownership check (carried by BEGIN: no extra round trip on
PostgreSQL), the loader criteria that confine the session, and the shared advisory lock for
write sessions.

Telemetry: "telemetry hooks" compares the same routed read with and without mdb.telemetry's
session wrapper (``Store.briefcase`` vs ``Store.briefcase.__wrapped__``, the method as it was
before the hook), in the same run. By default no OpenTelemetry SDK is installed, so this is the
cost mdb adds to every application that never asks for telemetry (docs/observability.md keeps
it under 2%). With ``MDB_BENCH_OTEL_SDK=1`` the section installs the SDK first (a meter
provider with an in-memory reader, a tracer provider that records every span), so the same row
shows what metrics and a span per session cost when they are on.
"""

from __future__ import annotations

import os
import random
import time
from datetime import datetime, timezone
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import bindparam, create_engine, insert, select
from sqlalchemy.ext.horizontal_shard import ShardedSession
from sqlalchemy.orm import Session

from benchmarks import BenchContext, Result, compare
from mdb import telemetry
from mdb.demo.models import User, UserBriefcase
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store

ROWS = 1000
SDK_ENV = "MDB_BENCH_OTEL_SDK"


def _install_sdk_if_asked() -> str:
    """Install the OTel SDK when ``MDB_BENCH_OTEL_SDK=1``; returns what is installed, for the notes."""
    if os.environ.get(SDK_ENV) != "1":
        return "no OTel SDK"
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
    trace.set_tracer_provider(TracerProvider())
    return "OTel SDK installed (metrics + a recorded span per session)"
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _store(directory: Path, central: str, shard: str) -> Store:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "map.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "servers": {"central": {"primary": central}, "u1": {"primary": shard}},
                "areas": {"central": {"kind": "central", "shards": ["central"]}, "user": {"partitions": [{"start": "0:0:0", "shards": ["u1"]}]}},
            }
        )
    )
    store = Store.from_yaml(path, types=[UserBriefcase])
    failed = [r for r in apply_schema(store) if not r.ok]
    if failed:
        raise RuntimeError(f"schema apply failed: {failed}")
    return store


def _hook_cost(ctx: BenchContext) -> float:
    """Seconds the telemetry hook adds per session, isolated from the database's noise.

    The same decorator ``Store.briefcase`` carries, around a context manager that does nothing,
    vs that context manager bare: tight loops of pure Python, so far steadier on a busy machine
    than the end-to-end row, whose difference drowns in the round trips' jitter.
    """
    fake = SimpleNamespace(placement=SimpleNamespace(server="u1"))

    @contextmanager
    def bare(store: object, btype: object, gdid: object, readonly: bool = False, exclusive: bool = False) -> Iterator[Any]:
        yield fake

    hooked = telemetry.observed_session(bare)

    def with_hook() -> None:
        with hooked(None, UserBriefcase, 1, readonly=True):
            pass

    def without() -> None:
        with bare(None, UserBriefcase, 1, readonly=True):
            pass

    n = ctx.iterations(200_000, 20_000)
    value, base = compare(with_hook, without, iterations=n, rounds=5, warmup=n // 10)
    return value - base


def _measure(ctx: BenchContext, backend: str, central: str, shard: str, otel_note: str) -> list[Result]:
    store = _store(ctx.tmpdir / backend, central, shard)
    ids = [GDID(0, 0, i) for i in range(1, ROWS + 1)]
    # Briefcases no session of this process has opened yet, one per call of the "first session" row.
    first_iterations, first_rounds = ctx.iterations(25, 10), ctx.iterations(16, 2)
    unopened = [GDID(0, 0, ROWS + i) for i in range(1, first_iterations * first_rounds + 2)]
    with store.transaction("u1") as conn:
        conn.execute(insert(User), [{"user_id": g, "email": f"{g}@example.com", "name": f"user {g}", "created_at": NOW}
                                    for g in ids + unopened])
    plain = create_engine(shard)
    order = ids * 20
    random.Random(7).shuffle(order)
    cursor = iter(order * 1000)

    def read(g: GDID, readonly: bool) -> object:
        with store.briefcase(UserBriefcase, g, readonly=readonly) as session:
            return session.scalars(select(User).where(User.user_id == g)).one()

    def routed(readonly: bool) -> Callable[[], object]:
        return lambda: read(next(cursor), readonly)

    fresh = iter(unopened)

    def first_session() -> object:
        return read(next(fresh), True)

    unobserved = Store.briefcase.__wrapped__  # type: ignore[attr-defined]

    def routed_without_hooks() -> object:
        g = next(cursor)
        with unobserved(store, UserBriefcase, g, readonly=True) as session:
            return session.scalars(select(User).where(User.user_id == g)).one()

    def direct() -> object:
        g = next(cursor)
        with Session(plain) as session:
            return session.scalars(select(User).where(User.user_id == g)).one()

    # The statement built once, its GDID a parameter (what an application that keeps its
    # statements does, and what SQLAlchemy's lambda statements amount to): the plain Session
    # computes its cache key once; a routed session executes a confined copy of it, kept with it.
    by_id = select(User).where(User.user_id == bindparam("uid"))

    def routed_built_once() -> object:
        g = next(cursor)
        with store.briefcase(UserBriefcase, g, readonly=True) as session:
            return session.scalars(by_id, {"uid": g}).one()

    def direct_built_once() -> object:
        g = next(cursor)
        with Session(plain) as session:
            return session.scalars(by_id, {"uid": g}).one()

    # The peer: SQLAlchemy's own sharding extension over the same one shard, its choosers
    # trivial (no ownership check, no confinement): what "just use SQLAlchemy" costs there.
    def sharded() -> object:
        g = next(cursor)
        with ShardedSession(shards={"u1": plain}, shard_chooser=lambda *a, **k: "u1",
                            identity_chooser=lambda *a, **k: ["u1"], execute_chooser=lambda *a, **k: ["u1"]) as session:
            return session.scalars(select(User).where(User.user_id == g)).one()

    # Many short rounds (20 x 500 reads), the order flipping each round: a burst of the machine's
    # other work spoils a round or two, and the median passes over them (5 x 2,000 before).
    iterations = ctx.iterations(500, 100)
    rounds = ctx.iterations(20, 4)
    results = []
    session_time = 0.0
    try:
        # The steady state of this workload first: two sessions of each of its briefcases in each
        # mode (a route is kept from a briefcase's second session: the doorkeeper of
        # docs/dev/0019), so that every measured round reads briefcases whose route and check
        # rows the Store keeps. A 300-read warm-up left ~700 of the 1,000 unopened, and their
        # first sessions, ~25-60 µs dearer each, fell into the first 6 of 20 rounds and lifted
        # the median (docs/dev/measured-sessions.md, "Eleventh pass"). What a first session
        # costs, the price of every session when the working set outgrows what the Store
        # keeps, is its own row below.
        for readonly in (True, False):
            for g in ids * 2:
                read(g, readonly)
        for readonly in (True, False):
            value, base = compare(routed(readonly), direct, iterations=iterations, rounds=rounds, warmup=ctx.iterations(300, 50))
            kind = "readonly" if readonly else "write"
            session_time = value if readonly else session_time
            results.append(
                Result(
                    "briefcase", f"{backend}: routed point read ({kind} session)", value * 1e6, "µs/read",
                    "plain Session on the engine", base * 1e6,
                    f"{iterations} reads x {rounds} rounds, median" + ("; + shared advisory lock" if not readonly and backend == "postgresql" else ""),
                )
            )
            if backend == "sqlite":  # all of it runs in this process: its CPU is the whole cost
                value, base = compare(routed(readonly), direct, iterations=iterations, rounds=rounds,
                                      warmup=ctx.iterations(300, 50), clock=time.process_time)
                results.append(
                    Result(
                        "briefcase", f"{backend}: routed point read ({kind} session), CPU", value * 1e6, "µs/read",
                        "plain Session on the engine, CPU", base * 1e6,
                        f"{iterations} reads x {rounds} rounds, median of this process's CPU time",
                    )
                )
        value, base = compare(first_session, direct, iterations=first_iterations, rounds=first_rounds, warmup=1)
        results.append(
            Result(
                "briefcase", f"{backend}: routed point read, first session of its briefcase (readonly)", value * 1e6, "µs/read",
                "plain Session on the engine", base * 1e6,
                f"{first_iterations} reads x {first_rounds} rounds, median; each of a briefcase no session of this process "
                "opened before (its route and check rows not kept yet)",
            )
        )
        value, base = compare(routed_built_once, direct_built_once, iterations=iterations, rounds=rounds, warmup=ctx.iterations(300, 50))
        results.append(
            Result(
                "briefcase", f"{backend}: routed point read, statement built once (readonly session)", value * 1e6, "µs/read",
                "plain Session, the same statement", base * 1e6, f"{iterations} reads x {rounds} rounds, median; the GDID a bound parameter",
            )
        )
        value, base = compare(sharded, direct, iterations=iterations, rounds=rounds, warmup=ctx.iterations(300, 50))
        results.append(
            Result(
                "briefcase", f"{backend}: SQLAlchemy horizontal_shard point read (peer)", value * 1e6, "µs/read",
                "plain Session on the engine", base * 1e6, f"{iterations} reads x {rounds} rounds, median; one shard, trivial choosers",
            )
        )
        results.append(
            Result(
                "briefcase", f"{backend}: telemetry hook alone, per session", _hook_cost(ctx) * 1e6, "µs/read",
                "a routed readonly session", session_time * 1e6,
                f"ratio = the hook's share of a session; decorated vs bare no-op context manager; {otel_note}",
            )
        )
        value, base = compare(routed(True), routed_without_hooks, iterations=iterations, rounds=rounds * 2, warmup=ctx.iterations(300, 50))
        results.append(
            Result(
                "briefcase", f"{backend}: telemetry hooks on a readonly session", value * 1e6, "µs/read",
                "the same session without the hooks", base * 1e6, f"{iterations} reads x {rounds * 2} rounds, median; {otel_note}",
            )
        )
    finally:
        plain.dispose()
        store.close()
    return results


def run(ctx: BenchContext) -> list[Result]:
    otel_note = _install_sdk_if_asked()
    central, shard = ctx.pg_urls(2)
    results = _measure(ctx, "postgresql", central, shard, otel_note)
    sqlite_dir = ctx.tmpdir / "sqlite-files"
    sqlite_dir.mkdir(parents=True, exist_ok=True)
    results += _measure(ctx, "sqlite", f"sqlite:///{sqlite_dir / 'central.db'}", f"sqlite:///{sqlite_dir / 'u1.db'}", otel_note)
    return results
