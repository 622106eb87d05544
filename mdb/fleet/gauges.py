"""Gauges of the fleet's state for ``mdb serve-metrics``: what a scrape sees between commands.

mdb's counters and histograms (:mod:`mdb.telemetry`) exist only in a process that does the
work, and a reshard's endpoint ends with it. Whether a reshard is *interrupted*, a partition
*frozen*, a rollout *mixed* is state, not an event: it is read from the journal and the servers
(:func:`mdb.fleet.status.fleet_report`) every ``interval`` seconds by :class:`FleetGauges` and
served as observable gauges under the meter ``mdb``, next to the existing instruments.

Names follow Prometheus conventions once exported (units in the name, ``_total`` only on the
counter); labels are bounded: area, server, kind, state, measure (names from the map or
small fixed sets), never a job id. The table is in docs/observability.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Final

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from mdb.fleet.balance import MEASURES
from mdb.fleet.status import ATTENTION, BROKEN, FleetReport

__all__ = ["FleetGauges"]

JOB_STATES: Final = ("running", "interrupted", "unknown")
JOB_KINDS: Final = ("reshard", "move")
_VERDICT = {"healthy": 0, ATTENTION: 1, BROKEN: 2}


class FleetGauges:
    """Holds the latest :class:`FleetReport` and serves it as gauges; :meth:`refresh` reads a new one."""

    def __init__(self, read: Callable[[], FleetReport]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._report: FleetReport | None = None
        self._refreshed_at = 0.0
        meter = metrics.get_meter("mdb")
        self._errors = meter.create_counter(
            "mdb.status.refresh.errors", unit="{error}", description="Reads of the fleet's state that failed (the gauges keep the last good one).")
        self._errors.add(0)  # the series exists (at 0) before the first error: rate() and alerts see it
        self._duration = meter.create_histogram(
            "mdb.status.refresh.duration", unit="s", description="Time to read the fleet's state (journal, servers, balance scan).")
        gauge = meter.create_observable_gauge
        gauge("mdb.fleet.status", [self._verdict], unit="1",
              description="Verdict of the last read: 0 healthy, 1 attention, 2 broken (as `mdb status` exits).")
        gauge("mdb.status.last_refresh.timestamp", [self._last_refresh], unit="s",
              description="Unix time of the last successful read of the fleet's state.")
        gauge("mdb.jobs", [self._jobs], unit="{job}", description="Unfinished jobs in the journal, by kind (reshard | move) and state (running | interrupted | unknown).")
        gauge("mdb.jobs.interrupted.oldest_age", [self._oldest_interrupted], unit="s",
              description="Seconds since the oldest interrupted job's driver was last seen (0: none).")
        gauge("mdb.partitions.frozen", [self._frozen], unit="{partition}", description="Partitions frozen for a reshard's final phase, by area.")
        gauge("mdb.partitions.frozen.oldest_age", [self._frozen_age], unit="s",
              description="Seconds the longest-frozen partition of the area has been frozen (0: none).")
        gauge("mdb.relocations", [self._relocations], unit="{briefcase}", description="Entries of the relocation directory, by area.")
        gauge("mdb.area.skew.ratio", [self._skew], unit="1",
              description="Largest |server - mean| / mean of the area, by measure (bytes | rows | briefcases).")
        gauge("mdb.migrations.mixed", [self._mixed], unit="1", description="1 while an area's servers are at different migration revisions.")
        gauge("mdb.spare.briefcases", [self._spare], unit="{briefcase}", description="Briefcases held by a server in no area's layout, by server.")
        gauge("mdb.replica.lag", [self._replica_lag], unit="s",
              description="Seconds each server's map-named replica is behind its primary (what reshard --max-lag waits on), by server.")

    def refresh(self) -> FleetReport | None:
        """Read the fleet's state once; on an error the previous report stays served, the error counted and re-raised."""
        started = time.monotonic()
        try:
            report = self._read()
        except Exception:
            self._errors.add(1)
            raise
        finally:
            self._duration.record(time.monotonic() - started)
        with self._lock:
            self._report = report
            self._refreshed_at = time.time()
        return report

    def _current(self) -> FleetReport | None:
        with self._lock:
            return self._report

    # -- callbacks (run at each scrape) ------------------------------------------------------------

    def _verdict(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        return [] if r is None else [Observation(_VERDICT[r.verdict])]

    def _last_refresh(self, _: CallbackOptions) -> Iterable[Observation]:
        return [] if self._current() is None else [Observation(self._refreshed_at)]

    def _jobs(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        if r is None:
            return []
        counts = {(k, s): 0 for k in JOB_KINDS for s in JOB_STATES}
        for job in r.jobs:
            key = ("reshard" if job.status.entry.kind == "reshard" else "move", job.state)
            counts[key] = counts.get(key, 0) + 1
        return [Observation(n, {"kind": k, "state": s}) for (k, s), n in counts.items()]

    def _oldest_interrupted(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        if r is None:
            return []
        ages = [(r.at - j.since).total_seconds() for j in r.jobs if j.state != "running" and j.since is not None]
        return [Observation(max(ages) + time.time() - r.at.timestamp() if ages else 0.0)]  # aged to this scrape

    def _frozen(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        if r is None:
            return []
        parts: dict[str, set[str]] = {a: set() for a in _areas(r)}
        for f in r.frozen:
            parts.setdefault(f.area, set()).add(f.partition)
        return [Observation(len(p), {"area": a}) for a, p in parts.items()]

    def _frozen_age(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        if r is None:
            return []
        since_read = time.time() - r.at.timestamp()
        ages: dict[str, float] = {a: 0.0 for a in _areas(r)}
        for f in r.frozen:
            if f.since is not None:
                ages[f.area] = max(ages.get(f.area, 0.0), (r.at - f.since).total_seconds() + since_read)
        return [Observation(v, {"area": a}) for a, v in ages.items()]

    def _relocations(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        return [] if r is None else [Observation(r.relocations.get(a, 0), {"area": a}) for a in _areas(r)]

    def _skew(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        if r is None:
            return []
        return [Observation(max((abs(v) for v in a.skew(m).values()), default=0.0), {"area": a.area, "measure": m})
                for a in r.areas for m in MEASURES]

    def _mixed(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        return [] if r is None else [Observation(int(mixed), {"area": a}) for a, mixed in r.migrations_mixed.items()]

    def _replica_lag(self, _: CallbackOptions) -> Iterable[Observation]:
        report = self._current()
        if report is None:
            return []
        return [Observation(lag, {"server": server}) for server, lag in report.replica_lag.items()]

    def _spare(self, _: CallbackOptions) -> Iterable[Observation]:
        r = self._current()
        return [] if r is None else [Observation(sum(held.values()), {"server": s}) for s, held in r.spares.items()]


def _areas(r: FleetReport) -> list[str]:
    return list(dict.fromkeys([*(a.area for a in r.areas), *r.area_errors]))
