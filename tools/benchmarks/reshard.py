"""Reshard throughput: briefcases per second of ``mdb reshard`` 2 -> 3 shards, next to raw COPY.

N briefcases of 100 rows each over the demo user's 8 tables (users 1, pay accounts 2,
authorizations 6, addresses 2, orders 5, order line items 60, transactions 22, balances 2; the
ledger tables empty), on shards a and b, re-sharded onto a, b, x. Filled with raw COPY and
settled with VACUUM ANALYZE and a CHECKPOINT before anything is timed (the plan's million rows
are dropped once measured: the servers are shared by every measurement). Measured in the same run:

- **per-briefcase COPY**: what a hand-written mover does, one briefcase at a time: for each of
  a sample of the briefcases, one ``COPY (SELECT ... WHERE user_id = g) TO STDOUT`` per table
  piped into ``COPY ... FROM STDIN`` of an empty database with the same tables (keys, foreign
  keys), one commit per briefcase. No lock, no verification, no fence, no delete on the source;
- **raw COPY pipe**: one COPY per table for all of the sample's rows at once, one commit: what
  the servers and the pipe can do at all (rows/s);
- **the plan of many briefcases**: ``mdb reshard --dry-run`` over 1,000,000 root-only briefcases,
  wall time and peak Python memory, next to reading every key into a list;
- with ``--workers 1,2,...`` (issue 32) instead: ``mdb reshard --parallel 0`` driving the job and
  W ``mdb worker`` processes moving it, ``--shards 4:8`` (default) on fresh data for each W, next
  to the aggregate raw COPY of the same run: one raw COPY stream per source server at once, each
  in a process of its own (:func:`run_workers`); ``--quick`` is the small-N mode;
- **mdb reshard** with batched cutovers at ``--parallel`` 1, 2 and 4 (2 -> 3, 3 -> 2, 2 -> 3 again,
  each moving about two thirds of the briefcases), and one at a time (``--batch-pause 0``, the
  cutover of earlier versions) on a smaller set. The write pause of a briefcase is the time its
  batch held the write lock; median and p99 over every moved briefcase.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import select
from sqlalchemy.engine import make_url

from benchmarks import BenchContext, Result
from benchmarks.moves import _map
from mdb.demo.models import UserBriefcase
from mdb.gdid import GDID
from mdb.moves import batch as batch_module
from mdb.moves.history import history_table
from mdb.moves.jobs import DEFAULT_PER_SERVER
from mdb.moves.journal import Journal
from mdb.moves.reshard import reshard
from mdb.schema import apply_schema
from mdb.store import Store

SECTION = "reshard"
AT = datetime(2026, 1, 1, tzinfo=UTC)

COLUMNS: dict[str, tuple[str, ...]] = {
    "users": ("user_id", "email", "name", "created_at"),
    "pay_accounts": ("user_id", "account_id", "kind", "masked_number"),
    "account_authorization_history": ("user_id", "authorization_id", "account_id", "amount", "approved", "at"),
    "addresses": ("user_id", "address_id", "line1", "city", "country"),
    "orders": ("user_id", "order_id", "status", "total_cents", "placed_at"),
    "order_line_items": ("user_id", "line_id", "order_id", "sku", "quantity", "price_cents"),
    "transactions": ("user_id", "transaction_id", "amount_cents", "memo", "at"),
    "balances": ("user_id", "balance_id", "currency", "amount_cents"),
}


def _rows(table: str, g: GDID) -> Iterator[tuple[Any, ...]]:
    """The briefcase's rows of ``table``: 100 over the 8 tables."""
    u, c = bytes(g), g.counter

    def k(kind: int, i: int) -> bytes:
        return bytes(GDID(0, kind, c * 100 + i))

    if table == "users":
        yield (u, f"user{c}@example.com", f"user {c}", AT)
    elif table == "pay_accounts":
        for i in range(2):
            yield (u, k(5, i), "card", f"**** {i:04}")
    elif table == "account_authorization_history":
        for i in range(6):
            yield (u, k(6, i), k(5, i % 2), 100 + i, i % 3 != 0, AT)
    elif table == "addresses":
        for i in range(2):
            yield (u, k(1, i), f"{i} Main St", "Springfield", "US")
    elif table == "orders":
        for i in range(5):
            yield (u, k(2, i), "placed", 1000 + i, AT)
    elif table == "order_line_items":
        for i in range(60):
            yield (u, k(3, i), k(2, i % 5), f"sku-{i}", 1 + i % 3, 99 + i)
    elif table == "transactions":
        for i in range(22):
            yield (u, k(4, i), 10 * i - 50, f"t{i}", AT)
    elif table == "balances":
        for i, cur in enumerate(("USD", "EUR")):
            yield (u, k(7, i), cur, 1000 * i)


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _fill(url: str, users: list[GDID]) -> None:
    with psycopg.connect(_dsn(url)) as conn:
        for table, cols in COLUMNS.items():  # parents first
            with conn.cursor().copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as copy:
                for g in users:
                    for row in _rows(table, g):
                        copy.write_row(row)
        conn.commit()
    _settle(url)


def _settle(url: str) -> None:
    """Statistics fresh and the fill's dirty pages written, so no timed run pays for the set-up's writes."""
    with psycopg.connect(_dsn(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")


def _cluster(ctx: BenchContext, name: str, n: int) -> tuple[Path, dict[str, str], list[GDID]]:
    """Four fresh databases (CENTRAL, a, b, x) with the schema; n briefcases on a and b by default routing."""
    urls = dict(zip(["c", "a", "b", "x"], ctx.pg_urls(4)))
    path = _map(ctx.tmpdir / name, urls, ["a", "b"])
    users = [GDID(0, 0, i) for i in range(10, 10 + n)]
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    for server in ("a", "b"):
        _fill(urls[server], [g for g in users if ["a", "b"][g.sharding_value % 2] == server])
    return path, urls, users


def _pipe(src: psycopg.Connection[Any], dst: psycopg.Connection[Any], table: str, where: str) -> int:
    cols = ", ".join(COLUMNS[table])
    with src.cursor().copy(f"COPY (SELECT {cols} FROM {table} WHERE {where}) TO STDOUT (FORMAT BINARY)") as out, \
            dst.cursor().copy(f"COPY {table} ({cols}) FROM STDIN (FORMAT BINARY)") as into:
        block = bytearray()
        for chunk in out:
            block += chunk
            if len(block) >= 64 * 1024:
                into.write(block)
                block = bytearray()
        if block:
            into.write(block)
    return 1


def _empty_copy_target(ctx: BenchContext, name: str) -> str:
    """A fresh database with the demo's tables (keys and foreign keys), as a COPY target."""
    url = ctx.pg_urls(4)[3]
    path = _map(ctx.tmpdir / name, {"c": url, "a": url}, ["a"])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    return url


def _per_briefcase_copy(src_url: str, dst_url: str, sample: list[GDID]) -> float:
    """Seconds to copy each briefcase of ``sample`` on its own: one COPY per table, a commit each."""
    with psycopg.connect(_dsn(src_url)) as src, psycopg.connect(_dsn(dst_url)) as dst:
        start = time.perf_counter()
        for g in sample:
            where = f"user_id = '\\x{g.hex}'::bytea"
            for table in COLUMNS:
                _pipe(src, dst, table, where)
            dst.commit()
            src.commit()
        return time.perf_counter() - start


def _raw_pipe(src_url: str, dst_url: str, sample: list[GDID]) -> float:
    """Seconds to copy all of ``sample``'s rows with one COPY per table and one commit."""
    keys = ", ".join(f"'\\x{g.hex}'::bytea" for g in sample)
    with psycopg.connect(_dsn(src_url)) as src, psycopg.connect(_dsn(dst_url)) as dst:
        start = time.perf_counter()
        for table in COLUMNS:
            _pipe(src, dst, table, f"user_id = ANY(ARRAY[{keys}])")
        dst.commit()
        return time.perf_counter() - start


class _Pauses:
    """Every moved briefcase's write pause (its batch's lock time), recorded around BatchMove.run."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.batches: list[int] = []
        self._run = batch_module.BatchMove.run

    def __enter__(self) -> _Pauses:
        original = self._run

        def run(move: batch_module.BatchMove) -> batch_module.BatchResult:
            result = original(move)
            self.pauses.extend([result.pause_seconds] * len(result.gdids))
            self.batches.append(len(result.gdids))
            return result

        batch_module.BatchMove.run = run  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        batch_module.BatchMove.run = self._run  # type: ignore[method-assign]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _plan_of_many(ctx: BenchContext) -> list[Result]:
    """``mdb reshard --dry-run`` over N root-only briefcases: wall time and peak Python memory.

    Baseline: reading the partition's keys into a list with one SELECT per shard (what holding
    one object per briefcase costs at the least).
    """
    n = ctx.iterations(1_000_000, 100_000)
    urls = dict(zip(["c", "a", "b", "x"], ctx.pg_urls(4)))
    path = _map(ctx.tmpdir / "reshard-plan", urls, ["a", "b"])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    users = [GDID(0, 0, i) for i in range(1, n + 1)]
    for i, server in enumerate(["a", "b"]):
        with psycopg.connect(_dsn(urls[server])) as conn:
            with conn.cursor().copy("COPY users (user_id, email, name, created_at) FROM STDIN") as copy:
                for g in users:
                    if g.sharding_value % 2 == i:
                        copy.write_row((bytes(g), "e", "n", AT))
        _settle(urls[server])
    del users
    def naive() -> list[GDID]:
        keys: list[GDID] = []
        for server in ("a", "b"):
            with psycopg.connect(_dsn(urls[server])) as conn:
                keys.extend(GDID.from_bytes(k) for (k,) in conn.execute("SELECT user_id FROM users"))
        return keys

    def dry_run() -> Any:
        with Store.from_yaml(path, types=[UserBriefcase]) as store:
            return reshard(store, "user", GDID(0, 0, 0), ["a", "b", "x"], dry_run=True, map_path=path)

    start = time.perf_counter()
    naive()
    naive_seconds = time.perf_counter() - start
    start = time.perf_counter()
    outcome = dry_run()
    seconds = time.perf_counter() - start
    # Memory in second runs: tracemalloc slows every allocation, so it stays out of the timed ones.
    peaks = []
    for job in (naive, dry_run):
        tracemalloc.start()
        job()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    naive_peak, peak = peaks
    for server in ("a", "b"):  # the million rows leave the servers the next measurements use
        with psycopg.connect(_dsn(urls[server]), autocommit=True) as conn:
            conn.execute("DROP TABLE users CASCADE")
            conn.execute("CHECKPOINT")
    note = f"{outcome.plan.briefcases_to_move} of {outcome.plan.briefcases_in_partition} would move"
    return [
        Result(SECTION, f"mdb reshard --dry-run, {n} briefcases: wall time", seconds, "s", "SELECT every key into a list", naive_seconds, note=note),
        Result(SECTION, f"mdb reshard --dry-run, {n} briefcases: peak Python memory", peak / 1e6, "MB",
               "SELECT every key into a list", naive_peak / 1e6, note="tracemalloc peak"),
    ]


def _raw_stream(args: tuple[str, str, list[bytes]]) -> int:
    """One raw COPY stream (every table, one commit) in a process of its own: rows copied."""
    src_url, dst_url, keys = args
    sample = [GDID.from_bytes(k) for k in keys]
    _raw_pipe(src_url, dst_url, sample)
    return len(sample) * 100


def _touch(url: str) -> None:
    with psycopg.connect(_dsn(url)) as conn:
        conn.execute("SELECT 1")


def _aggregate_raw_copy(pairs: list[tuple[str, str, list[GDID]]]) -> float:
    """Rows/s of one raw COPY stream per source server, all at once, each in its own process: what the servers can stream."""
    with ProcessPoolExecutor(max_workers=len(pairs)) as pool:
        list(pool.map(_touch, [s for s, _, _ in pairs]))  # the processes started and connected once before the clock
        start = time.perf_counter()
        rows = sum(pool.map(_raw_stream, [(s, d, [bytes(g) for g in sample]) for s, d, sample in pairs]))
        return rows / (time.perf_counter() - start)


def _workers_cluster(ctx: BenchContext, name: str, n: int, old: int, new: int) -> tuple[Path, dict[str, str], list[GDID], list[str], list[str]]:
    """CENTRAL plus ``new`` servers; n briefcases filled on the first ``old`` by default routing."""
    olds = [f"s{i}" for i in range(old)]
    news = olds + [f"t{i}" for i in range(new - old)]
    urls = dict(zip(["c", *news], ctx.pg_urls(1 + len(news))))
    path = _map(ctx.tmpdir / name, urls, olds)
    users = [GDID(0, 0, i) for i in range(10, 10 + n)]
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    with ThreadPoolExecutor(max_workers=old) as pool:
        list(pool.map(lambda i: _fill(urls[olds[i]], [g for g in users if g.sharding_value % old == i]), range(old)))
    return path, urls, users, olds, news


def _pause_p99(store: Store, reshard_id: str) -> tuple[float, int]:
    """(p99 write pause in seconds, batches) of a finished reshard, from its history row (every batch's lock time,
    journaled by whichever worker moved it; the samples themselves go when the job finishes)."""
    journal = Journal(store)
    with store.transaction(journal.server) as conn:
        p99, n = conn.execute(select(history_table.c.pause_p99_seconds, history_table.c.pauses)
                              .where(history_table.c.job_id == reshard_id)).one()
    return float(p99 or 0.0), int(n)


def run_workers(ctx: BenchContext, workers: list[int], old: int = 4, new: int = 8, per_server: int = DEFAULT_PER_SERVER) -> list[Result]:
    """``mdb reshard --parallel 0`` (the job's phases only) with W ``mdb worker`` processes, for each W, ``old`` -> ``new`` shards;
    W = 0 is today's default instead, ``mdb reshard`` alone at ``--parallel 1`` (the same-run comparison the 2-core figure needs).

    Fresh databases for every W (same servers), filled with n briefcases of 100 rows. Baseline of
    the same run: one raw COPY stream per source server at once, each in its own process
    (aggregate rows/s of the sources), measured before each W on its own fresh data.
    """
    n = ctx.n or ctx.iterations(10_000, 1_200)  # --n: a small N for a loaded 2-core machine
    results: list[Result] = []
    for w in workers:
        path, urls, users, olds, news = _workers_cluster(ctx, f"reshard-workers-{w}", n, old, new)
        sample = ctx.iterations(1_000, 200)
        # Empty databases with the schema on the new servers (the reshard's targets), one per stream.
        fresh = ctx.pg_urls(1 + len(news))
        targets = [fresh[1 + old + i % max(1, new - old)] for i in range(old)]
        for i, url in enumerate(dict.fromkeys(targets)):
            scratch = _map(ctx.tmpdir / f"raw-{w}-{i}", {"c": url, "a": url}, ["a"])
            with Store.from_yaml(scratch, types=[UserBriefcase]) as store:
                assert all(r.ok for r in apply_schema(store))
        pairs = [(urls[olds[i]], targets[i], [g for g in users if g.sharding_value % old == i][:sample]) for i in range(old)]
        raw_rows = _aggregate_raw_copy(pairs)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        # W = 0: today's default, `mdb reshard` alone (--parallel 1, its items worked in its own thread), no worker.
        procs = [subprocess.Popen([sys.executable, "-c", "from mdb.cli import main; main()", "worker", str(path)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(w)]
        try:
            with Store.from_yaml(path, types=[UserBriefcase]) as store:
                start = time.perf_counter()
                outcome = reshard(store, "user", GDID(0, 0, 0), news, parallel=1 if w == 0 else 0, map_path=path, per_server=per_server)
                elapsed = time.perf_counter() - start
                p99, batches = _pause_p99(store, outcome.reshard_id or "")
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.communicate(timeout=300)
        name = (f"mdb reshard (default: --parallel 1, no worker) ({old} -> {new} shards)" if w == 0
                else f"mdb reshard --workers {w} ({old} -> {new} shards, --per-server {per_server})")
        note = (f"{outcome.moved} of {n} briefcases ({outcome.rows_moved} rows) in {elapsed:.1f}s, {batches} batches; "
                f"pause p99 {p99 * 1000:.1f} ms (per batch)")
        results.append(Result(SECTION, name, outcome.rows_moved / elapsed, "rows/s",
                              f"raw COPY, one stream per source ({old}) at once", raw_rows, note=note))
        results.append(Result(SECTION, name, outcome.moved / elapsed, "briefcases/s",
                              "aim: 0.5x the raw COPY streams (issue 32)", raw_rows / 100 / 2))
        results.append(Result(SECTION, f"{name}: write pause p99", p99 * 1000, "ms", "aim (issue 15)", 50.0,
                              note="per batch: its lock time"))
    return results


def run(ctx: BenchContext) -> list[Result]:
    if ctx.options.get("workers"):
        old, new = ctx.options.get("shards", (4, 8))
        return run_workers(ctx, list(ctx.options["workers"]), int(old), int(new),
                           per_server=int(ctx.options.get("per_server") or DEFAULT_PER_SERVER))
    results: list[Result] = _plan_of_many(ctx)
    n = ctx.iterations(10_000, 1_000)
    path, urls, users = _cluster(ctx, "reshard-batched", n)
    sample = users[: ctx.iterations(500, 100)]
    on_a = [g for g in sample if g.sharding_value % 2 == 0]
    per_briefcase = len(on_a) / _per_briefcase_copy(urls["a"], _empty_copy_target(ctx, "reshard-copy-one"), on_a)
    raw_rows = len(on_a) * 100 / _raw_pipe(urls["a"], _empty_copy_target(ctx, "reshard-copy-all"), on_a)

    steps = [(1, ["a", "b", "x"]), (2, ["a", "b"]), (4, ["a", "b", "x"])]
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        for parallel, shards in steps:
            with _Pauses() as pauses:
                start = time.perf_counter()
                outcome = reshard(store, "user", GDID(0, 0, 0), shards, parallel=parallel, map_path=path)
                elapsed = time.perf_counter() - start
            moved = outcome.moved
            note = (f"{moved} of {n} briefcases ({outcome.rows_moved} rows) in {elapsed:.1f}s, {len(pauses.batches)} batches "
                    f"(median {statistics.median(pauses.batches):.0f}); pause median {statistics.median(pauses.pauses) * 1000:.1f} ms, "
                    f"p99 {_p99(pauses.pauses) * 1000:.1f} ms")
            name = f"mdb reshard --parallel {parallel} ({len(outcome.plan.old_shards)} -> {len(shards)} shards)"
            results.append(Result(SECTION, name, moved / elapsed, "briefcases/s", "per-briefcase COPY, a commit each", per_briefcase, note=note))
            results.append(Result(SECTION, name, outcome.rows_moved / elapsed, "rows/s", "raw COPY pipe, one per table", raw_rows))
            results.append(Result(SECTION, f"{name}: write pause p99", _p99(pauses.pauses) * 1000, "ms",
                                  "aim (issue 15)", 50.0, note="per briefcase: its batch's lock time"))

    small = ctx.iterations(600, 150)
    path, urls, users = _cluster(ctx, "reshard-single", small)
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        start = time.perf_counter()
        outcome = reshard(store, "user", GDID(0, 0, 0), ["a", "b", "x"], parallel=2, map_path=path, batch_pause=0)
        elapsed = time.perf_counter() - start
    results.append(Result(SECTION, "mdb reshard --parallel 2 --batch-pause 0 (one briefcase per cutover)", outcome.moved / elapsed,
                          "briefcases/s", "per-briefcase COPY, a commit each", per_briefcase,
                          note=f"{outcome.moved} of {small} briefcases in {elapsed:.1f}s: the cutover before batching"))
    return results
