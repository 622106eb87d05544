"""An application process's routing cost by how many briefcases moved (issue 31): ``bench.py refresh_scale``.

What a reshard of partition 0:0:0 from [a, b] to [a, b, x] leaves while it runs, filled in bulk
(COPY, not moves) at 1k, 10k, 100k and 1M moved briefcases (``--quick``: 1k and 10k; ``--n``:
the largest size): per moved briefcase one relocation-directory entry on CENTRAL (c), one
``gone`` fence on its old shard (a or b, by ``v mod 2``), one ``resident`` row and its users
row on x; plus 1,000 briefcases that did not move (on a and b). The map stays [a, b]: the state
in the middle of the reshard, before its map apply, when moved briefcases are found by fences.

At each size a fresh application process (``Store.from_yaml`` on the map, ``route_cache_size=0``
so every read of a moved briefcase pays its fence hop, the worst case) measures: the median of
30 ``Store.refresh()`` calls; its RSS growth from before the Store was made to after every
measurement; the median latency of a routed readonly read of a moved briefcase (default shard,
its fence, then x) and of an unmoved one (200 each, random). Printed with the ratio to the 1k
case: issue 31's aim is the same refresh at 1M as at 1k (within 2x) and at most 20 MB growth.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from rich.console import Console
from sqlalchemy import select

from benchmarks import BenchContext, Result
from benchmarks.moves import _map
from benchmarks.reshard import AT, _dsn, _settle
from mdb.demo.models import User, UserBriefcase
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store

SECTION = "refresh_scale"
TOOLS = Path(__file__).resolve().parent.parent
SIZES = (1_000, 10_000, 100_000, 1_000_000)
UNMOVED = 1_000
REFRESHES = 30
READS = 200


def moved(k: int) -> GDID:
    """The k-th moved briefcase: v mod 3 == 2, so x is its shard under [a, b, x]."""
    return GDID(0, 0, 14 + 3 * k)


def unmoved(k: int) -> GDID:
    """The k-th briefcase that stays: v mod 3 == 0, on a or b under both lists."""
    return GDID(0, 0, 12 + 3 * k)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def probe(map_path: str, size: int) -> None:
    """One application process: refresh, memory and routed reads at ``size`` moved briefcases; JSON on stdout."""
    rng = random.Random(size)
    rss_before = _rss()
    with Store.from_yaml(map_path, types=[UserBriefcase], route_cache_size=0) as store:
        def read(g: GDID) -> float:
            start = time.perf_counter()
            with store.briefcase(UserBriefcase, g, readonly=True) as s:
                if s.scalar(select(User.name).where(User.user_id == g)) is None:
                    raise LookupError(f"briefcase {g} not found where it was routed ({s.placement.server})")
            return time.perf_counter() - start

        for _ in range(20):  # warm: connections, prepared checks, code paths
            read(moved(rng.randrange(size)))
            read(unmoved(rng.randrange(UNMOVED)))
        refreshes = []
        for _ in range(REFRESHES):
            start = time.perf_counter()
            store.refresh()
            refreshes.append(time.perf_counter() - start)
        moved_reads = [read(moved(rng.randrange(size))) for _ in range(READS)]
        unmoved_reads = [read(unmoved(rng.randrange(UNMOVED))) for _ in range(READS)]
        figures = {
            "refresh": statistics.median(refreshes), "moved_read": statistics.median(moved_reads),
            "unmoved_read": statistics.median(unmoved_reads), "growth": _rss() - rss_before,
            "directory_loaded": store.router.directory_loaded, "learned": len(store.routes),
        }
    print(json.dumps(figures))


def _fill(urls: dict[str, str], done: int, size: int) -> None:
    """Moved briefcases ``done`` .. ``size``: directory entries, fences, 'resident' rows and users rows, by COPY."""
    with psycopg.connect(_dsn(urls["c"])) as conn:
        with conn.cursor().copy("COPY mdb_relocations (area, gdid, server) FROM STDIN") as copy:
            for k in range(done, size):
                copy.write_row(("user", bytes(moved(k)), "x"))
    for i, server in enumerate(["a", "b"]):
        with psycopg.connect(_dsn(urls[server])) as conn:
            with conn.cursor().copy("COPY mdb_briefcase_state (area, gdid, state, peer, move_id) FROM STDIN") as copy:
                for k in range(done, size):
                    g = moved(k)
                    if g.sharding_value % 2 == i:
                        copy.write_row(("user", bytes(g), "gone", "x", "reshard-bench"))
    with psycopg.connect(_dsn(urls["x"])) as conn:
        with conn.cursor().copy("COPY mdb_briefcase_state (area, gdid, state, peer, move_id) FROM STDIN") as copy:
            for k in range(done, size):
                copy.write_row(("user", bytes(moved(k)), "resident", None, "reshard-bench"))
        with conn.cursor().copy("COPY users (user_id, email, name, created_at) FROM STDIN") as copy:
            for k in range(done, size):
                c = moved(k).counter
                copy.write_row((bytes(moved(k)), f"user{c}@example.com", f"user {c}", AT))
    for url in urls.values():
        _settle(url)


def _unmoved(urls: dict[str, str]) -> None:
    for i, server in enumerate(["a", "b"]):
        with psycopg.connect(_dsn(urls[server])) as conn:
            with conn.cursor().copy("COPY users (user_id, email, name, created_at) FROM STDIN") as copy:
                for k in range(UNMOVED):
                    g = unmoved(k)
                    if g.sharding_value % 2 == i:
                        copy.write_row((bytes(g), f"user{g.counter}@example.com", f"user {g.counter}", AT))


def run(ctx: BenchContext) -> list[Result]:
    sizes = [s for s in (SIZES[:2] if ctx.quick else SIZES) if ctx.n is None or s <= ctx.n]
    console = Console(stderr=True, width=200)
    urls = dict(zip(["c", "a", "b", "x"], ctx.pg_urls(4)))
    path = _map(ctx.tmpdir / "refresh-scale", urls, ["a", "b"])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))  # x gets its tables: a spare server of the map
    _unmoved(urls)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TOOLS), os.environ.get("PYTHONPATH", "")])}
    figures: dict[int, dict[str, float]] = {}
    done = 0
    for size in sizes:
        started = time.perf_counter()
        _fill(urls, done, size)
        done = size
        console.print(f"  {size:,} moved briefcases' directory entries, fences and 'resident' rows in place "
                      f"(+{time.perf_counter() - started:.1f}s); measuring in a fresh application process")
        out = subprocess.run(
            [sys.executable, "-c", "import sys; from benchmarks.refresh_scale import probe; probe(sys.argv[1], int(sys.argv[2]))",
             str(path), str(size)],
            env=env, capture_output=True, text=True, check=False,
        )
        if out.returncode:
            raise RuntimeError(f"refresh_scale probe at {size:,} exited with {out.returncode}: {out.stderr.strip()[-2000:]}")
        figures[size] = json.loads(out.stdout.strip().splitlines()[-1])
        f = figures[size]
        console.print(f"    refresh {f['refresh'] * 1000:.2f} ms, RSS growth {f['growth'] / 1e6:.1f} MB, read moved "
                      f"{f['moved_read'] * 1000:.2f} ms / unmoved {f['unmoved_read'] * 1000:.2f} ms, "
                      f"directory loaded: {f['directory_loaded']}, learned {f['learned']}")
    base = figures[sizes[0]]
    label = f"{sizes[0]:,} moved (same run)"
    results = []
    for size in sizes[1:]:
        f = figures[size]
        results += [
            Result(SECTION, f"refresh, median of {REFRESHES} ({size:,} moved)", f["refresh"] * 1000, "ms", label, base["refresh"] * 1000,
                   note="aim: within 2x of 1k"),
            Result(SECTION, f"application RSS growth ({size:,} moved)", f["growth"] / 1e6, "MB", label, base["growth"] / 1e6,
                   note="aim: at most 20 MB"),
            Result(SECTION, f"routed read of a moved briefcase, median ({size:,} moved)", f["moved_read"] * 1000, "ms", label,
                   base["moved_read"] * 1000, note="default shard, its fence, then x"),
            Result(SECTION, f"routed read of an unmoved briefcase, median ({size:,} moved)", f["unmoved_read"] * 1000, "ms", label,
                   base["unmoved_read"] * 1000),
        ]
    return results
