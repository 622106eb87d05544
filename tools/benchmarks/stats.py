"""Hot-data patterns on real PostgreSQL.

- increments per second of ONE hot counter with 8 concurrent writers (threads, one transaction
  per increment, as an application does), K = 16 slot rows next to K = 1 (a plain hot row);
- reading an event-log total as latest snapshot + a 100-event tail, next to a full replay of
  the whole log, for logs of 10k and 100k events (--quick: 2k and 10k);
- one snapshot pass folding the whole log, next to the same full replay (what the job costs).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from benchmarks import BenchContext, Result, compare
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.hot import Counters, EventLog, SumFold, central
from mdb.hot.central_tables import CENTRAL_COUNTERS, CENTRAL_EVENT_LOG
from mdb.store import Store

SECTION = "stats"
WRITERS = 8
TAIL = 100


def _store(directory: Path, url: str) -> Store:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "map.yaml"
    path.write_text(yaml.safe_dump({
        "version": 1,
        "servers": {"central": {"primary": url}},
        "areas": {"central": {"kind": "central", "shards": ["central"]}},
    }))
    store = Store.from_yaml(path, types=[])
    failed = [r for r in apply_schema(store) if not r.ok]
    if failed:
        raise RuntimeError(f"schema apply failed: {failed}")
    return store


def _increments_per_second(store: Store, counters: Counters, counter: str, slots: int, per_writer: int) -> float:
    with central(store, counter) as place:
        counters.configure(place, counter, slots)
    start = threading.Barrier(WRITERS + 1)

    def writer() -> None:
        start.wait()
        for _ in range(per_writer):
            with central(store, counter) as place:
                counters.add(place, counter, value=1)

    threads = [threading.Thread(target=writer) for _ in range(WRITERS)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    with central(store, counter) as place:
        total = counters.read(place, counter)["value"]
    if total != WRITERS * per_writer:
        raise RuntimeError(f"counter {counter}: expected {WRITERS * per_writer}, read {total}")
    return WRITERS * per_writer / elapsed


def _fill(store: Store, log: EventLog, stream: str, n: int, first_id: int) -> None:
    ev = log.tables.events
    batch = 5000
    with central(store, stream) as place:
        for lo in range(0, n, batch):
            rows = [
                {"event_id": GDID(0, 9, first_id + i), "stream": stream, "kind": "vote", "payload": {"amount": i % 7}}
                for i in range(lo, min(n, lo + batch))
            ]
            place.conn.execute(ev.insert(), rows)


def run(ctx: BenchContext) -> list[Result]:
    (url,) = ctx.pg_urls(1)
    store = _store(ctx.tmpdir / "stats-bench", url)
    results: list[Result] = []
    try:
        counters = Counters(CENTRAL_COUNTERS)
        per_writer = ctx.iterations(400, 60)
        _increments_per_second(store, counters, "warmup", 4, per_writer // 4 or 1)
        rounds = ctx.iterations(3, 1)
        k1, k16 = [], []
        for r in range(rounds):  # alternating, so background load hits both alike
            k1.append(_increments_per_second(store, counters, f"hot-k1-r{r}", 1, per_writer))
            k16.append(_increments_per_second(store, counters, f"hot-k16-r{r}", 16, per_writer))
        k1.sort()
        k16.sort()
        results.append(Result(
            SECTION, f"{WRITERS} writers on one counter, K=16", k16[len(k16) // 2], "increments/s",
            f"{WRITERS} writers, K=1", k1[len(k1) // 2],
            f"{WRITERS * per_writer} increments per run, one transaction each; median of {rounds} runs",
        ))

        log = EventLog(CENTRAL_EVENT_LOG, SumFold(("amount",)))
        sizes = (2_000, 10_000) if ctx.quick else (10_000, 100_000)
        for n, size in enumerate(sizes):
            stream = f"bench-{size}"
            _fill(store, log, stream, size - TAIL, n * 10_000_000)
            t0 = time.perf_counter()
            with central(store, stream) as place:
                folded = log.snapshot(place, stream).folded
            snap_s = time.perf_counter() - t0
            _fill(store, log, stream, TAIL, n * 10_000_000 + size)

            def read() -> None:
                with central(store, stream) as place:
                    log.read(place, stream)

            def replay() -> None:
                with central(store, stream) as place:
                    log.replay(place, stream)

            with central(store, stream) as place:
                if log.read(place, stream).state != log.replay(place, stream):
                    raise RuntimeError(f"stream {stream}: snapshot + tail differs from the full replay")
            iters = max(1, ctx.iterations(20, 5) * 10_000 // size)
            s, b = compare(read, replay, iterations=iters, rounds=ctx.iterations(3, 2), warmup=1)
            results.append(Result(
                SECTION, f"total of {size} events: snapshot + {TAIL} tail", s, "s", "full replay", b,
                f"{size} events on one CENTRAL stream",
            ))
            results.append(Result(
                SECTION, f"snapshot pass folding {folded} events", snap_s, "s", f"full replay of {size}", b,
                "the job's cost, paid once per pass instead of per read",
            ))
    finally:
        store.close()
    return results
