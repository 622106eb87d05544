"""GDID generation: in-process rate next to a plain counter, and block reservation on PostgreSQL.

- ``take(n)`` and ``next()`` of a generator whose blocks come from a real PostgreSQL CENTRAL
  server (reservations, waits, prefetch and block growth included: amortized), next to
  ``itertools.count`` handing out the same number of plain ints; ``next()`` once more with
  fixed-size blocks (growth off), to show what growing blocks buys;
- the cost of building GDIDs: the validating ``GDID(era, authority, counter)`` and the trusted
  run the generator uses, next to the same plain ints;
- one block reservation (the upsert with RETURNING, in its own transaction) next to
  ``SELECT 1`` in a transaction on the same pooled engine: the round-trip floor.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import yaml

from benchmarks import BenchContext, Result, compare
from mdb.gdid import GDID, _trusted_run
from mdb.idgen import DEFAULT_BLOCK_SIZE, GdidGenerator, reserve_block, sequence_key
from mdb.schema import apply_schema
from mdb.store import Store

SECTION = "idgen"


def _store(directory: Path, central: str) -> Store:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "map.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1,
        "servers": {"central": {"primary": central}},
        "areas": {"central": {"kind": "central", "shards": ["central"]}},
    }))
    store = Store.from_yaml(path, types=[])
    failed = [r for r in apply_schema(store) if not r.ok]
    if failed:
        raise RuntimeError(f"schema apply failed: {failed}")
    return store


def _rate(section_name: str, n: int, subject_s: float, baseline_name: str, baseline_s: float, note: str) -> Result:
    return Result(SECTION, section_name, n / subject_s, "GDIDs/s", baseline_name, n / baseline_s, note)


def run(ctx: BenchContext) -> list[Result]:
    (central_url,) = ctx.pg_urls(1)
    store = _store(ctx.tmpdir / "idgen-bench", central_url)
    rounds = ctx.iterations(5, 2)
    results: list[Result] = []
    try:
        counter = itertools.count(1)
        for n in (100, 1000, 100_000):
            gen = GdidGenerator.for_store(store, "bench", f"take-{n}")
            calls = ctx.iterations(max(1_000_000 // n // rounds, 3), 3)
            s, b = compare(lambda: gen.take(n), lambda: list(itertools.islice(counter, n)),
                           iterations=calls, rounds=rounds, warmup=max(calls // 10, 1))
            gen.wait_idle()
            results.append(_rate(f"take({n})", n, s, "list(islice(count(), n))", b,
                                 f"{gen.blocks_reserved} blocks, last {gen.current_block_size}"))

        for label, max_block in (("next()", None), ("next(), fixed blocks", DEFAULT_BLOCK_SIZE)):
            gen = GdidGenerator.for_store(store, "bench", f"next-{max_block}", max_block_size=max_block)
            calls = ctx.iterations(100_000, 20_000)
            s, b = compare(gen.next, lambda: next(counter), iterations=calls, rounds=rounds, warmup=calls // 10)
            gen.wait_idle()
            results.append(_rate(f"{label}, block {DEFAULT_BLOCK_SIZE}", 1, s, "next(count())", b,
                                 f"{gen.blocks_reserved} blocks, last {gen.current_block_size}"))

        n = 1000
        calls = ctx.iterations(1000, 50)
        s, b = compare(lambda: [GDID(0, 3, c) for c in range(1, n + 1)], lambda: list(range(1, n + 1)),
                       iterations=calls, rounds=rounds, warmup=calls // 10)
        results.append(_rate("GDID(era, authority, counter) x1000", n, s, "list(range(n))", b, "validating constructor"))
        s, b = compare(lambda: _trusted_run(0, 3 << 60 | 1, n), lambda: list(range(1, n + 1)),
                       iterations=calls, rounds=rounds, warmup=calls // 10)
        results.append(_rate("trusted run x1000", n, s, "list(range(n))", b, "what take() builds ids with"))

        server = store.router.locate_central(sequence_key("bench", "latency")).server

        def reserve() -> None:
            with store.transaction(server) as conn:
                reserve_block(conn, "bench", "latency", DEFAULT_BLOCK_SIZE)

        def select_one() -> None:
            with store.transaction(server) as conn:
                conn.exec_driver_sql("SELECT 1").one()

        calls = ctx.iterations(300, 30)
        s, b = compare(reserve, select_one, iterations=calls, rounds=rounds, warmup=calls // 10)
        results.append(Result(SECTION, "reserve one block (PostgreSQL)", s * 1000, "ms",
                              "SELECT 1 in a transaction", b * 1000, "BEGIN + upsert RETURNING + COMMIT"))
    finally:
        store.close()
    return results
