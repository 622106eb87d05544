"""What the application sees while a partition reshards (issue 31): ``bench.py reshard_impact``.

N root-only briefcases (``users`` rows only, filled with COPY by default routing) on shards a and
b, each its own PostgreSQL server like the other sections; CENTRAL on c, the new shard x. R
application processes (``--procs``, default 4) read (4 of 5 operations: a readonly session that
loads the user) and write (1 of 5: a write session that updates its name) random briefcases
through the public Store API (``Store.from_yaml`` on the same map file the reshard rewrites, as a
deployed application would) for a while before, throughout and a while after
``reshard(..., ["a", "b", "x"], parallel=2)``: the library call ``mdb reshard --parallel 2``
makes, run by this process.

Printed: the reshard's rate, and per application process its reads and writes; errors raised to
it, by type (each would reach a user); the refusals its Store absorbed (fences followed, waits
for a briefcase between its commit point and finalize or for the freeze, map refreshes); its
refreshes (count and total seconds) and whether it ever loaded the relocation directory; latency
p50/p99/max of every operation, p99 before the reshard next to p99 during it (and during it,
split: operations whose Store absorbed no refusal, and those that followed a fence or waited,
with their count); its RSS when the
reshard started and its growth until the end. Latencies go into a fixed log-bucket histogram
(about 1% resolution, the max exact), so the figures cost the process no memory that grows.
Afterwards every briefcase is on exactly one server (N rows over a, b and x, no key twice).
Then a timeline: the reshard's steps, the mover's collections, each server's autovacuum runs
and checkpoints (polled once a second), and every operation of 100 ms or more (wall clock, which
processes, reads or writes, what their Stores absorbed meanwhile), so a stall can be set
against the step it happened in. ``--settled``: only briefcases that stay on their shard, so
the reshard moves nothing and is its freeze, final sweep and map apply alone (the end of a
reshard of N briefcases, in seconds).

``--mover-nice N``: the mover (the reshard's threads in this process) runs at CPU priority nice
N. In production the mover runs on a host of its own, not on the application's cores; on a
2-core machine holding the mover, five servers and the applications, the applications' p99
during a reshard measures mostly whose turn the CPU was (the "direct" column: operations that
absorbed nothing). A niced mover yields the CPU to the applications when they want it, which is
closer to that; the servers keep their priority. The run prints the value it used.

Sizes: ``--n`` (default 10,000; ``--quick``: 2,000) and ``--procs`` (0: the mover alone, for
its rate). Its own time is the fill, 3 + 2 s (``--quick``; else 10 + 3 s) around the reshard, and
the reshard: seconds where the mover batches, but on a 2-core machine shared with test suites
(load average 20-30) the batch sizer fell to batches of one and a ``--quick`` run took 12
minutes. The issue's "before" figures (16 cores, 300k briefcases, before routing by fences) are
in docs/dev/measured-moves.md, next to what this section measured. Runs unattended, with no network.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from rich.console import Console
from rich.table import Table
from sqlalchemy import select, update

from benchmarks import BenchContext, Result
from benchmarks.moves import _map
from benchmarks.reshard import AT, _dsn, _settle
from mdb.demo.models import User, UserBriefcase
from mdb.gdid import GDID
from mdb.moves.reshard import ReshardOutcome, reshard
from mdb.retry import RoutedOpen, Step
from mdb.schema import apply_schema
from mdb.store import Store

SECTION = "reshard_impact"
TOOLS = Path(__file__).resolve().parent.parent
FIRST = 10  # the first briefcase's counter (GDID 0:0:10)


def counter(k: int, settled: bool) -> int:
    """The counter of the k-th briefcase: FIRST + k; ``settled``: the k-th with v mod 6 in {0, 1}.

    Those already sit on their shard under both [a, b] and [a, b, x] (v mod 2 == v mod 3), so a
    settled reshard moves nothing and is its freeze, final sweep and map apply alone: the end of
    a reshard of N briefcases, isolated, in seconds on any machine.
    """
    return 12 + 6 * (k // 2) + k % 2 if settled else FIRST + k

READS_PER_WRITE = 4
SLOW = 0.1
"""An operation at least this slow is logged with its wall-clock time, kind and what its Store
absorbed meanwhile, so the timeline can set it against the reshard's phases."""
SLOW_KEPT = 400
RATE = 200
"""Operations a second each application process aims at (paced, not a closed loop): an application
serves requests, it does not take every core it can get; on 2 cores a closed loop of two processes
left the mover a fraction of one."""

# -- the latency histogram -------------------------------------------------------------------

_BUCKETS_PER_DOUBLING = 70  # 2 ** (1/70): about 1% wide
_LOWEST = 1e-6


def _bucket(seconds: float) -> int:
    return 0 if seconds <= _LOWEST else int(math.log2(seconds / _LOWEST) * _BUCKETS_PER_DOUBLING) + 1


def _bucket_value(index: int) -> float:
    return _LOWEST * 2 ** ((index - 0.5) / _BUCKETS_PER_DOUBLING) if index else _LOWEST


@dataclass
class Latencies:
    """Operation latencies of one phase: counts per log bucket, the max exact. Constant memory."""

    counts: Counter[int] = field(default_factory=Counter)
    n: int = 0
    max: float = 0.0

    def add(self, seconds: float) -> None:
        self.counts[_bucket(seconds)] += 1
        self.n += 1
        if seconds > self.max:
            self.max = seconds

    def merge(self, other: Latencies) -> Latencies:
        out = Latencies(self.counts + other.counts, self.n + other.n, max(self.max, other.max))
        return out

    def quantile(self, q: float) -> float:
        if not self.n:
            return float("nan")
        rank = max(1, math.ceil(q * self.n))
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return min(_bucket_value(index), self.max)
        return self.max

    def to_json(self) -> dict[str, Any]:
        return {"counts": {str(k): v for k, v in self.counts.items()}, "n": self.n, "max": self.max}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Latencies:
        return cls(Counter({int(k): v for k, v in data["counts"].items()}), data["n"], data["max"])


# -- one application process -----------------------------------------------------------------


def _rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from /proc."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def worker(config_path: str) -> None:
    """An application process: random reads and writes until the stop file appears; writes its figures as JSON.

    The phase (before / during / after the reshard) is read from the marker files the driver
    writes, checked every 50 ms. Errors are counted by type and the first message of each kept:
    the figures report them, the loop goes on as an application's next request would.
    """
    config = json.loads(Path(config_path).read_text())
    run = Path(config["run_dir"])
    rng = random.Random(config["seed"])
    absorbed: Counter[str] = Counter()
    refused = RoutedOpen.refused

    def counted(self: RoutedOpen, placement: Any, exc: Any) -> Step:
        step = refused(self, placement, exc)  # raises when the budget is spent: then it is an error, counted below
        absorbed["wait" if step.delay else "refresh" if step.refresh else "follow"] += 1
        return step

    RoutedOpen.refused = counted  # type: ignore[method-assign]
    directory_loads = 0
    load = Store._load_relocations

    def counted_load(self: Store, router: Any) -> Any:
        nonlocal directory_loads
        directory_loads += 1
        return load(self, router)

    Store._load_relocations = counted_load  # type: ignore[method-assign]

    own_gc = [0.0, 0.0, 0.0]  # [seconds in this process's own collections, the longest, when the current began]

    def collected(phase: str, info: dict[str, int]) -> None:  # a slow operation may be this process's own collector
        if phase == "start":
            own_gc[2] = time.perf_counter()
        else:
            took = time.perf_counter() - own_gc[2]
            own_gc[0] += took
            own_gc[1] = max(own_gc[1], took)

    gc.callbacks.append(collected)
    phases = {name: Latencies() for name in ("before", "during", "after", "during direct", "during refused")}
    errors: Counter[str] = Counter()
    messages: dict[str, str] = {}
    reads = writes = 0
    slow: list[tuple[float, float, str, str]] = []  # (wall start, seconds, read/write, absorbed meanwhile)
    n = config["n"]
    with Store.from_yaml(config["map"], types=[UserBriefcase]) as store:
        def op(i: int) -> bool:
            g = GDID(0, 0, counter(rng.randrange(n), config["settled"]))
            if i % (READS_PER_WRITE + 1):
                with store.briefcase(UserBriefcase, g, readonly=True) as s:
                    if s.scalar(select(User.name).where(User.user_id == g)) is None:
                        raise LookupError(f"briefcase {g} has no users row where it was routed")
                return True
            with store.briefcase(UserBriefcase, g) as s:
                s.execute(update(User).where(User.user_id == g).values(name=f"p{config['index']} {i}"))
            return False

        for i in range(50):  # warm: connections open, the map read, code paths taken
            op(i)
        rss_ready, _ = _rss_bytes()
        (run / f"ready-{config['index']}").touch()
        phase, checked, i = "before", 0.0, 50
        rss_start = rss_ready
        due = time.perf_counter()
        while True:
            due += 1 / RATE
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            else:
                due = now  # behind: go on from now, never a burst to catch up
            if now - checked > 0.05:
                checked = now
                if (run / "stop").exists():
                    break
                if phase == "before" and (run / "started").exists():
                    phase = "during"
                    rss_start, _ = _rss_bytes()
                elif phase == "during" and (run / "ended").exists():
                    phase = "after"
            i += 1
            start = time.perf_counter()
            wall, seen, gc_before = time.time(), absorbed.copy(), own_gc[0]
            try:
                was_read = op(i)
            except Exception as exc:  # counted and reported by type: what would reach a user
                name = type(exc).__name__
                errors[name] += 1
                messages.setdefault(name, str(exc).splitlines()[0][:200])
                continue
            took = time.perf_counter() - start
            phases[phase].add(took)
            if phase == "during":  # what a refusal costs, apart from what the reshard's load costs every operation
                phases["during refused" if absorbed != seen else "during direct"].add(took)
            if took >= SLOW and len(slow) < SLOW_KEPT:
                meanwhile = absorbed - seen
                notes = [f"{k}={v}" for k, v in sorted(meanwhile.items())]
                if own_gc[0] - gc_before >= 0.001:
                    notes.append(f"own-gc={(own_gc[0] - gc_before) * 1000:.0f}ms")
                slow.append((wall, took, "read" if was_read else "write", " ".join(notes)))
            if was_read:
                reads += 1
            else:
                writes += 1
        rss_end, rss_peak = _rss_bytes()
        figures = {
            "index": config["index"], "reads": reads, "writes": writes, "errors": dict(errors), "messages": messages,
            "absorbed": dict(absorbed), "refreshes": store.refreshes, "refresh_seconds": store.refresh_seconds,
            "directory_loads": directory_loads, "directory_loaded": store.router.directory_loaded,
            "learned": len(store.routes), "rss_ready": rss_ready, "rss_start": rss_start, "rss_end": rss_end,
            "rss_peak": rss_peak, "slow": slow, "gc_seconds": own_gc[0], "gc_longest": own_gc[1], "phases": {name: lat.to_json() for name, lat in phases.items()},
        }
    (run / f"figures-{config['index']}.json").write_text(json.dumps(figures))


# -- the driver ------------------------------------------------------------------------------


def _fill(urls: dict[str, str], n: int, settled: bool) -> None:
    """N users rows on a and b by default routing (v mod 2), with COPY; settled before anything runs."""
    for i, server in enumerate(["a", "b"]):
        with psycopg.connect(_dsn(urls[server])) as conn:
            with conn.cursor().copy("COPY users (user_id, email, name, created_at) FROM STDIN") as copy:
                for k in range(n):
                    c = counter(k, settled)
                    g = GDID(0, 0, c)
                    if g.sharding_value % 2 == i:
                        copy.write_row((bytes(g), f"user{c}@example.com", f"user {c}", AT))
            conn.commit()
        _settle(urls[server])


def _placement_check(urls: dict[str, str], n: int) -> str:
    """'' when the N briefcases are on exactly one server each, else what is wrong."""
    seen: Counter[bytes] = Counter()
    for server in ("a", "b", "x"):
        with psycopg.connect(_dsn(urls[server])) as conn:
            seen.update(bytes(k) for (k,) in conn.execute("SELECT user_id FROM users"))
    twice = sum(1 for v in seen.values() if v > 1)
    if len(seen) != n or twice:
        return f"{len(seen)} briefcases found of {n}, {twice} on two servers"
    return ""


def _wait_for(paths: list[Path], procs: list[subprocess.Popen[str]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"application process exited with {dead[0].returncode}: {dead[0].stderr.read() if dead[0].stderr else ''}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"application processes not ready after {timeout:.0f}s")
        time.sleep(0.05)


class _Steps:
    """The reshard's progress as a step log: (wall-clock time, phase), for the timeline."""

    PROGRESS_EVERY = 20.0
    """Seconds between progress lines on stderr: a run cut off by a time limit (the lent machine's)
    still says how far the mover got and at what rate."""

    def __init__(self) -> None:
        self.log: list[tuple[float, str]] = []
        self._collecting: float | None = None
        self._printed = time.time()

    def phase(self, name: str) -> None:
        self.log.append((time.time(), name))

    def collection(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` hook: the mover's collections of 50 ms or more go on the timeline (a
        full collection stops every thread of the mover, finalizes the application waits on included)."""
        if phase == "start":
            self._collecting = time.time()
        elif self._collecting is not None:
            took = time.time() - self._collecting
            if took >= 0.05:
                self.log.append((self._collecting, f"mover: generation-{info['generation']} collection, {took * 1000:.0f} ms"))
            self._collecting = None

    def counts(self, counts: Any, last: Any) -> None:
        now = time.time()
        if now - self._printed >= self.PROGRESS_EVERY:
            self._printed = now
            started = self.log[0][0] if self.log else now
            rate = counts.window.figures(counts.briefcases_done, counts.briefcases_total, counts.rows_done,
                                         counts.rows_total, now).briefcases_per_second
            print(f"  {now - started:5.0f} s  {self.log[-1][1] if self.log else ''}: {counts.briefcases_done:,} of "
                  f"{counts.briefcases_total:,} moved, {rate or 0:,.0f} /s lately", file=sys.stderr, flush=True)

    def waiting(self, reason: str, seconds: float) -> None:
        pass


class _ServerWatch(threading.Thread):
    """Each server's own work on the timeline: its autovacuum runs (seen once a second in
    ``pg_stat_activity``, with their duration) and its checkpoints (the checkpointer's counts
    going up), so a slow operation that absorbed nothing can be set against what the servers did."""

    def __init__(self, urls: dict[str, str], steps: _Steps) -> None:
        super().__init__(name="server-watch", daemon=True)
        self.urls = urls
        self.steps = steps
        self.stopped = threading.Event()

    def run(self) -> None:
        conns = {name: psycopg.connect(_dsn(url), autocommit=True) for name, url in self.urls.items()}
        running: dict[tuple[str, int, str], float] = {}
        checkpoints: dict[str, int] = {}
        # PostgreSQL 17 moved the checkpoint counts from pg_stat_bgwriter to pg_stat_checkpointer.
        counted = {name: "SELECT num_timed + num_requested FROM pg_stat_checkpointer" if conn.info.server_version >= 170000
                   else "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter" for name, conn in conns.items()}
        try:
            while not self.stopped.wait(1.0):
                now = time.time()
                for name, conn in conns.items():
                    seen = {(name, pid, query) for pid, query in conn.execute(
                        "SELECT pid, query FROM pg_stat_activity WHERE backend_type = 'autovacuum worker' AND query <> ''")}
                    for key in seen - running.keys():
                        running[key] = now
                    for key in [k for k in running if k[0] == name and k not in seen]:
                        started = running.pop(key)
                        self.steps.log.append((started, f"server {name}: {key[2]}, {now - started:.0f} s (+-1 s)"))
                    row = conn.execute(counted[name]).fetchone()
                    count = int(row[0]) if row else 0
                    if name in checkpoints and count > checkpoints[name]:
                        self.steps.log.append((now, f"server {name}: checkpoint counted"))
                    checkpoints[name] = count
        finally:
            for name, conn in conns.items():
                conn.close()
            for (name, _, query), started in running.items():
                self.steps.log.append((started, f"server {name}: {query}, still running at the end"))


def _timeline(console: Console, steps: list[tuple[float, str]], figures: list[dict[str, Any]]) -> None:
    """The reshard's steps and the application's slow operations on one clock (ms from the reshard's start).

    Slow operations (>= SLOW) that start within 50 ms of each other form one line: how many, in
    how many processes, reads/writes, the longest, and what their Stores absorbed meanwhile.
    """
    if not steps:
        return
    t0 = steps[0][0]
    events: list[tuple[float, str]] = [
        (t - t0, name if name.startswith(("mover:", "server ")) else f"reshard: {name}") for t, name in steps
    ]
    ops = sorted((w - t0, took, kind, f["index"], seen) for f in figures for w, took, kind, seen in f.get("slow", []))
    group: list[tuple[float, float, str, int, str]] = []

    def flush() -> None:
        if group:
            kinds = Counter(kind for _, _, kind, _, _ in group)
            seen = Counter(s for *_, s in group if s)
            events.append((group[0][0], f"  {len(group)} slow op(s) in {len({g[3] for g in group})} process(es) "
                           f"({' '.join(f'{k}={v}' for k, v in sorted(kinds.items()))}), longest "
                           f"{max(g[1] for g in group) * 1000:.0f} ms; absorbed: "
                           f"{'; '.join(f'{k} x{v}' for k, v in seen.most_common(3)) or 'nothing'}"))
            group.clear()

    for op in ops:
        if group and op[0] - group[-1][0] > 0.05:
            flush()
        group.append(op)
    flush()
    console.print(f"  timeline (ms from the reshard's start; operations >= {SLOW * 1000:.0f} ms):")
    for at, what in sorted(events, key=lambda e: e[0]):
        console.print(f"  {at * 1000:9.0f}  {what}")


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f}"


def _ms(s: float) -> str:
    return f"{s * 1000:.1f}"


def run(ctx: BenchContext) -> list[Result]:
    n = ctx.n or ctx.iterations(10_000, 2_000)
    procs = 4 if ctx.procs is None else ctx.procs
    before_s, after_s = (3.0, 2.0) if ctx.quick else (10.0, 3.0)
    console = Console(stderr=True, width=220)

    urls = dict(zip(["c", "a", "b", "x"], ctx.pg_urls(4)))
    path = _map(ctx.tmpdir / f"reshard-impact-{n}", urls, ["a", "b"])
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    started = time.perf_counter()
    settled = bool(ctx.options.get("settled"))
    _fill(urls, n, settled)
    console.print(f"  {n:,} briefcases on a and b in {time.perf_counter() - started:.1f}s; {procs} application processes")

    run_dir = ctx.tmpdir / f"reshard-impact-{n}-run"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TOOLS), os.environ.get("PYTHONPATH", "")])}
    workers = []
    for index in range(procs):
        config = run_dir / f"config-{index}.json"
        config.write_text(json.dumps({"index": index, "seed": 31 + index, "n": n, "settled": settled, "map": str(path),
                                      "run_dir": str(run_dir)}))
        workers.append(subprocess.Popen(
            [sys.executable, "-c", "import sys; from benchmarks.reshard_impact import worker; worker(sys.argv[1])", str(config)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    try:
        _wait_for([run_dir / f"ready-{i}" for i in range(procs)], workers, timeout=120)
        time.sleep(before_s)
        (run_dir / "started").touch()
        mover_nice = int(ctx.options.get("mover_nice", 0))
        start = time.perf_counter()
        steps = _Steps()
        steps.phase("start")
        gc.callbacks.append(steps.collection)
        watch = _ServerWatch(urls, steps)
        watch.start()
        try:
            with Store.from_yaml(path, types=[UserBriefcase]) as store, ThreadPoolExecutor(1, thread_name_prefix="mover") as mover:
                def move() -> ReshardOutcome:
                    # Linux keeps a nice value per thread, inherited by the threads a thread starts: the
                    # reshard's workers run niced, this process's other threads and later sections do not.
                    if mover_nice:
                        os.nice(mover_nice)
                    return reshard(store, "user", GDID(0, 0, 0), ["a", "b", "x"], parallel=2, map_path=path, progress=steps)

                outcome = mover.submit(move).result()
        finally:
            gc.callbacks.remove(steps.collection)
            watch.stopped.set()
            watch.join()
        steps.phase("returned")
        elapsed = time.perf_counter() - start
        (run_dir / "ended").touch()
        time.sleep(after_s)
    finally:
        (run_dir / "stop").touch()
        for proc in workers:
            try:
                _, stderr = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, stderr = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"application process exited with {proc.returncode}: {stderr.strip()[-2000:]}")
    figures = [json.loads((run_dir / f"figures-{i}.json").read_text()) for i in range(procs)]
    problem = _placement_check(urls, n)
    if problem:
        raise RuntimeError(f"after the reshard: {problem}")

    rate = outcome.moved / elapsed
    console.print(f"  reshard 2 -> 3 at --parallel 2: {outcome.moved:,} of {n:,} briefcases moved in {elapsed:.1f}s: "
                  f"[bold]{rate:,.0f} briefcases/s[/bold] (with {procs} application processes; mover at nice {mover_nice})")
    table = Table(title=f"reshard_impact: {n:,} briefcases, per application process (latency in ms, memory in MB)")
    for column in ("proc", "reads", "writes", "errors", "absorbed", "refreshes", "refresh s", "dir loads", "learned",
                   "p50", "p99", "max", "p99 before", "p99 during", "p99 during: direct / refused", "max during", "own GC s (longest ms)", "RSS", "RSS growth"):
        table.add_column(column, justify="left" if column in ("errors", "absorbed") else "right")
    worst_ratio = worst_max = worst_growth = 0.0
    total_errors = 0
    refresh_means = []
    for f in figures:
        phases = {name: Latencies.from_json(data) for name, data in f["phases"].items()}
        every = phases["before"].merge(phases["during"]).merge(phases["after"])  # (the "during" split is inside "during")
        before, during = phases["before"], phases["during"]
        growth = f["rss_end"] - f["rss_start"]
        total_errors += sum(f["errors"].values())
        ratio = during.quantile(0.99) / before.quantile(0.99)
        worst_ratio, worst_max, worst_growth = max(worst_ratio, ratio), max(worst_max, during.max), max(worst_growth, growth)
        if f["refreshes"]:
            refresh_means.append(f["refresh_seconds"] / f["refreshes"])
        table.add_row(
            str(f["index"]), f"{f['reads']:,}", f"{f['writes']:,}",
            " ".join(f"{k}={v}" for k, v in sorted(f["errors"].items())) or "0",
            " ".join(f"{k}={v}" for k, v in sorted(f["absorbed"].items())) or "-",
            str(f["refreshes"]), f"{f['refresh_seconds']:.3f}", str(f["directory_loads"]), f"{f['learned']:,}",
            _ms(every.quantile(0.5)), _ms(every.quantile(0.99)), _ms(every.max),
            _ms(before.quantile(0.99)), _ms(during.quantile(0.99)),
            f"{_ms(phases['during direct'].quantile(0.99))} / {_ms(phases['during refused'].quantile(0.99))} ({phases['during refused'].n:,})",
            _ms(during.max),
            f"{f.get('gc_seconds', 0.0):.1f} ({f.get('gc_longest', 0.0) * 1000:.0f})", _mb(f["rss_start"]), f"{(f['rss_end'] - f['rss_start']) / 1e6:+.1f} (peak {_mb(f['rss_peak'] - f['rss_start'])})",
        )
    if figures:
        console.print(table)
        _timeline(console, steps.log, figures)
    for f in figures:
        for name, message in f["messages"].items():
            console.print(f"  process {f['index']}: {name}: {message}")
    mean_refresh = sum(refresh_means) / len(refresh_means) if refresh_means else 0.0
    label = f"{n:,} briefcases, {procs} processes"
    rate_result = Result(SECTION, f"reshard 2 -> 3 --parallel 2 ({label})", rate, "briefcases/s",
                         "issue 31 before (16 cores, 300k, other machine)", 3300.0,
                         note=f"{outcome.moved:,} moved in {elapsed:.1f}s")
    if not figures:  # --procs 0: the mover's rate with no application, for comparison
        return [rate_result]
    return [
        rate_result,
        Result(SECTION, f"application read+write p99 during / before, worst process ({label})", worst_ratio, "x",
               "aim (issue 31)", 3.0),
        Result(SECTION, f"application max latency during the reshard, worst process ({label})", worst_max * 1000, "ms",
               "aim (issue 31)", 250.0),
        Result(SECTION, f"application RSS growth, worst process ({label})", worst_growth / 1e6, "MB",
               "aim (issue 31)", 20.0, note="from the reshard's start to the end of the run"),
        Result(SECTION, f"errors raised to the application, all processes ({label})", float(total_errors), "errors",
               "aim (issue 31)", 0.0),
        Result(SECTION, f"application refresh, mean seconds ({label})", mean_refresh * 1000, "ms",
               "issue 31 before at 300k (one process)", 1800.0,
               note=f"{sum(f['refreshes'] for f in figures)} refreshes, "
                    f"{sum(f['directory_loads'] for f in figures)} directory loads"),
    ]
