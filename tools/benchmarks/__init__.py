"""The benchmark framework's shared parts: what a section gets (BenchContext) and returns (Result).

A section is a module ``tools/benchmarks/<name>.py`` with ``def run(ctx: BenchContext) ->
list[Result]``. Speed is only meaningful next to a baseline measured in the same run on the
same machine, so every Result carries its baseline and the report prints the ratio.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from mdb.testing.postgres import PostgresServer

__all__ = ["BenchContext", "Result", "per_call", "compare"]

Better = Literal["higher", "lower"]
_RATE_SUFFIX = "/s"
FRACTION_ENV = "MDB_BENCH_FRACTION"


@dataclass(frozen=True)
class Result:
    """One measurement next to its baseline. ``better`` defaults from the unit (rates: higher)."""

    section: str
    name: str
    value: float
    unit: str
    baseline_name: str
    baseline_value: float
    note: str = ""
    better: Better | None = None

    def __post_init__(self) -> None:
        if self.better is None:
            object.__setattr__(self, "better", "higher" if self.unit.endswith(_RATE_SUFFIX) else "lower")

    @property
    def ratio(self) -> float:
        """value / baseline: for a time, 1.07 means 7% slower than the baseline."""
        return self.value / self.baseline_value if self.baseline_value else float("nan")


@dataclass
class BenchContext:
    """What the runner hands every section; PostgreSQL servers are shared by all sections."""

    tmpdir: Path
    quick: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    """Section options from the command line (``--workers``, ``--shards``, ``--per-server``: the reshard section)."""
    n: int | None = None
    """``--n``: the size a section that takes one uses instead of its default (briefcases, rows)."""
    procs: int | None = None
    """``--procs``: how many application processes a section that starts them uses."""
    _servers: list[PostgresServer] = field(default_factory=list)

    def pg_urls(self, n: int) -> list[str]:
        """URLs of ``n`` fresh, empty databases on ``n`` distinct real PostgreSQL servers.

        Servers start on first use (in parallel), are reused by later calls and sections, and
        are stopped and deleted when the run ends (:meth:`close`).
        """
        from mdb.testing.postgres import PostgresServer, postgres_unavailable_reason

        missing = n - len(self._servers)
        if missing > 0:
            reason = postgres_unavailable_reason()
            if reason:
                raise RuntimeError(f"PostgreSQL benchmarks need real servers: {reason}")
            new = [PostgresServer(name=f"bench{len(self._servers) + i}") for i in range(missing)]
            self._servers.extend(new)
            with ThreadPoolExecutor(max_workers=missing) as pool:
                for started in [pool.submit(server.start) for server in new]:
                    started.result()
        return [server.create_database() for server in self._servers[:n]]

    def pg_data_dirs(self) -> list[Path]:
        """The data folders of the servers :meth:`pg_urls` started, in its URLs' order (a server's
        processes are found from its ``postmaster.pid``: tools/profile_session.py's server CPU)."""
        return [server.data_dir for server in self._servers]

    def iterations(self, full: int, quick: int) -> int:
        """``quick`` with ``--quick``; else ``full``, scaled by ``MDB_BENCH_FRACTION`` (e.g. 0.25) where set.

        The fraction keeps rounds alternating as before but shortens each, for a machine too busy
        for the full run (the ratios stay same-run; only their spread grows).
        """
        if self.quick:
            return quick
        fraction = float(os.environ.get(FRACTION_ENV, "1"))
        return max(quick, round(full * fraction))

    def close(self) -> None:
        while self._servers:
            self._servers.pop().close()


def per_call(fn: Callable[[], object], iterations: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call of ``fn`` over ``iterations`` calls, by ``clock`` (wall time unless told)."""
    start = clock()
    for _ in range(iterations):
        fn()
    return (clock() - start) / iterations


def compare(
    subject: Callable[[], object], baseline: Callable[[], object], *, iterations: int, rounds: int, warmup: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Median seconds per call of (subject, baseline), measured in alternating rounds.

    Alternating rounds share whatever else the machine is doing between the two, so the ratio
    is steadier than two back-to-back runs; the order flips every round (subject first, then
    baseline first), so neither always runs right after the other's caches warmed. ``clock``:
    ``time.process_time`` measures this process's CPU instead of wall time (for work that is all
    in-process, such as SQLite, where the machine's other load shows in wall time only).
    """
    per_call(subject, warmup, clock)
    per_call(baseline, warmup, clock)
    subject_times, baseline_times = [], []
    for i in range(rounds):
        if i % 2:
            baseline_times.append(per_call(baseline, iterations, clock))
            subject_times.append(per_call(subject, iterations, clock))
        else:
            subject_times.append(per_call(subject, iterations, clock))
            baseline_times.append(per_call(baseline, iterations, clock))
    return statistics.median(subject_times), statistics.median(baseline_times)
