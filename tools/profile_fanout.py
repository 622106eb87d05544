"""Client CPU of a warm fan-out per shard: ``python tools/profile_fanout.py [--shards S] [--n N]``.

S shard databases on ONE PostgreSQL server (the number of databases and engines is what mdb's
per-shard Python cost depends on). Prints the mdb process's CPU (``time.process_time``: every
thread of this process, nothing of the servers) per shard of a warm fan-out count and ORM
top-10, next to a sequential loop of plain Sessions over the same shards, in alternating
rounds; CPU rather than wall time because it stays comparable on a loaded machine, and the
fan-out's wall time on many cores is bounded by this CPU (the GIL serializes it).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sqlalchemy import create_engine  # noqa: E402

from benchmarks import BenchContext  # noqa: E402
from benchmarks.scale import COUNT, TOP10, _fill, _loops, _write_map  # noqa: E402
from mdb import fanout  # noqa: E402
from mdb.demo.models import UserBriefcase  # noqa: E402
from mdb.schema import apply_schema  # noqa: E402
from mdb.store import Store  # noqa: E402
from mdb.urls import sqlalchemy_url  # noqa: E402


def _cpu_and_wall(fn: Callable[[], object], n: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        fn()
    return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n


def _calls(fn: Callable[[], object], n: int) -> float:
    """Python and C function calls per ``fn()``, on every thread (the fan-out's workers too): deterministic
    where CPU time is not (a thread's waits may add a few)."""
    counter = itertools.count()
    tick = counter.__next__

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            tick()

    with fanout._pools_lock:  # new worker threads, so that they start with the profile function
        for pool in fanout._pools.values():
            pool.shutdown()
        fanout._pools.clear()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        for _ in range(n):
            fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return (next(counter) - 1) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--n", type=int, default=20, help="fan-outs per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mdb-prof-") as tmp:
        ctx = BenchContext(tmpdir=Path(tmp))
        try:
            ctx.pg_urls(1)
            server = ctx._servers[0]
            urls = [server.create_database() for _ in range(args.shards + 1)]
            path = _write_map(Path(tmp) / "map.yaml", urls[0], urls[1:])
            store = Store.from_yaml(path, types=[UserBriefcase])
            assert all(r.ok for r in apply_schema(store, parallel=4))
            plain = {f"s{i}": create_engine(sqlalchemy_url(url)) for i, url in enumerate(urls[1:])}
            _fill(store, plain, args.shards)
            sequential, _ = _loops(list(plain.values()))
            for name, statement, aggregate in (("count", COUNT, True), ("ORM top-10", TOP10, False)):
                def fanned() -> object:
                    return store.fan_out("user", statement, aggregate=aggregate)

                def looped() -> object:
                    return sequential(statement)

                fanned(), looped()
                print(f"fan-out {name}, S={args.shards}: Python calls per shard {_calls(fanned, 5) / args.shards:.0f} "
                      f"vs sequential loop {_calls(looped, 5) / args.shards:.0f}")
                f_cpu, f_wall, l_cpu, l_wall = [], [], [], []
                for _ in range(args.rounds):
                    c, w = _cpu_and_wall(fanned, args.n)
                    f_cpu.append(c)
                    f_wall.append(w)
                    c, w = _cpu_and_wall(looped, args.n)
                    l_cpu.append(c)
                    l_wall.append(w)
                fc, lc = statistics.median(f_cpu), statistics.median(l_cpu)
                fw, lw = statistics.median(f_wall), statistics.median(l_wall)
                print(f"fan-out {name}, S={args.shards}: client CPU {fc / args.shards * 1e6:.0f} us/shard vs sequential loop "
                      f"{lc / args.shards * 1e6:.0f} us/shard (ratio {fc / lc:.2f}); wall {fw * 1e3:.1f} vs {lw * 1e3:.1f} ms "
                      f"(ratio {fw / lw:.2f}, load-dependent)")
            store.close()
            for engine in plain.values():
                engine.dispose()
        finally:
            ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
