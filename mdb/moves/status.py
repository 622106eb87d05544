"""What moves and reshards are in flight, read from the journal: phase, driver, progress, rate and ETA.

Where one briefcase is (``mdb where``) is :mod:`mdb.fleet.where`, which asks every server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Final

from mdb.cluster import Cluster
from mdb.moves.journal import JOB_KINDS, RUNNING, Journal, JournalEntry
from mdb.moves.lease import Holder, describe, liveness

__all__ = [
    "RATE_WINDOW",
    "MoveStatus",
    "RateEta",
    "RateWindow",
    "move_status",
    "rate_and_eta",
    "status_of",
]


RATE_WINDOW: Final = 30.0
"""Seconds the current rate of a running reshard is measured over."""

Sample = tuple[float, int, int]
"""(wall-clock seconds since the epoch, briefcases done, rows done)."""


@dataclass(frozen=True)
class RateEta:
    briefcases_per_second: float | None
    rows_per_second: float | None
    eta_seconds: float | None
    """None: unknown (no time measured yet, or nothing moved in the window: stalled or throttled)."""


def _value_at(samples: Sequence[Sample], at: float) -> tuple[float, float]:
    """(briefcases, rows) done at time ``at``, linear between the two samples around it."""
    if at <= samples[0][0]:
        return float(samples[0][1]), float(samples[0][2])
    for (t0, b0, r0), (t1, b1, r1) in zip(samples, samples[1:]):
        if t0 <= at <= t1:
            share = 0.0 if t1 == t0 else (at - t0) / (t1 - t0)
            return b0 + (b1 - b0) * share, r0 + (r1 - r0) * share
    return float(samples[-1][1]), float(samples[-1][2])


def rate_and_eta(
    briefcases_done: int, briefcases_total: int, rows_done: int, rows_total: int,
    samples: Sequence[Sample], now: float, window: float | None = RATE_WINDOW,
) -> RateEta:
    """The one computation of rate and ETA, for `mdb moves status`, its JSON and the CLI's bars.

    The rate is the progress of the last ``window`` seconds before ``now`` (``samples``: the
    done counts at moments, oldest first), not since the start: a resumed reshard would count
    the work of an earlier run, a throttled or paused one would show the speed it had before. As
    time passes without progress the rate falls towards 0 and the ETA becomes unknown, which is
    the truth about a stalled reshard. ``window=None`` measures over every sample (a single
    move's own run time). The ETA is the later of the two estimates (briefcases left at the
    briefcase rate, rows left at the row rate): batches of small briefcases are bound by the
    briefcase count, big ones by rows, and an ETA should not promise the earlier of the two. A
    count that did not move in the window is left out (a single move's one briefcase is done
    only at its end; a run of empty briefcases moves no rows); when neither moved, the ETA is
    unknown.
    """
    if not samples:
        return RateEta(None, None, None)
    start = samples[0][0] if window is None else max(samples[0][0], now - window)
    span = now - start
    if span <= 0:  # SQLite's CURRENT_TIMESTAMP has whole seconds: a quick move took "0 s"
        return RateEta(None, None, None)
    b0, r0 = _value_at(samples, start)
    b1, r1 = samples[-1][1], samples[-1][2]
    rate_bc = max(b1 - b0, 0.0) / span
    rate_rows = max(r1 - r0, 0.0) / span
    left = [(total - done, rate) for done, total, rate in ((briefcases_done, briefcases_total, rate_bc), (rows_done, rows_total, rate_rows))
            if total - done > 0]
    etas = [n / rate for n, rate in left if rate > 0]
    eta = 0.0 if not left else (max(etas) if etas else None)
    return RateEta(rate_bc, rate_rows, eta)


class RateWindow:
    """The recent done counts of a running reshard, for its rate over :data:`RATE_WINDOW`.

    The driver adds a sample with every counts update and journals :meth:`to_params` with the
    counts, so `mdb moves status` in another process computes the same rate from the journal
    alone; the CLI's bars keep one fed with the same counts. Samples closer than
    ``resolution`` seconds are merged, so the journaled form stays small (about window /
    resolution samples) however often the counts change. Wall-clock time, because another
    process on another host compares it with its own clock. Thread-safe.
    """

    def __init__(self, window: float = RATE_WINDOW, resolution: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        self.window = window
        self._resolution = resolution
        self._clock = clock
        self._samples: list[Sample] = []
        self._lock = threading.Lock()

    def add(self, briefcases_done: int, rows_done: int, at: float | None = None) -> None:
        now = self._clock() if at is None else at
        with self._lock:
            sample = (round(now, 3), briefcases_done, rows_done)
            if len(self._samples) >= 2 and self._samples[-1][0] - self._samples[-2][0] < self._resolution:
                self._samples[-1] = sample  # the newest moves on until it is `resolution` past the one before
            else:
                self._samples.append(sample)
            cutoff = now - self.window
            while len(self._samples) >= 2 and self._samples[1][0] <= cutoff:  # keep one at or before the cutoff
                self._samples.pop(0)

    @property
    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def figures(self, briefcases_done: int, briefcases_total: int, rows_done: int, rows_total: int, now: float | None = None) -> RateEta:
        return rate_and_eta(briefcases_done, briefcases_total, rows_done, rows_total, self.samples,
                            self._clock() if now is None else now, self.window)

    def to_params(self) -> dict[str, Any]:
        """``{"progress": {...}}``, merged into the reshard's journaled params with each counts update."""
        return {"progress": {"window": self.window, "samples": [list(s) for s in self.samples]}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RateWindow | None:
        """The window a running reshard journaled; None for entries without one (older mdb, single moves)."""
        recorded = params.get("progress")
        if not isinstance(recorded, Mapping) or not recorded.get("samples"):
            return None
        out = cls(float(recorded.get("window", RATE_WINDOW)))
        out._samples = [(float(t), int(b), int(r)) for t, b, r in recorded["samples"]]
        return out


@dataclass
class MoveStatus:
    entry: JournalEntry
    rate_rows: float | None
    rate_briefcases: float | None
    eta_seconds: float | None
    driver: str | None = None
    """Unfinished entries: "running (pid, host, last beat)" or "interrupted: run ..." (mdb.moves.lease)."""
    holder: Holder | None = None
    rate_window: float | None = None
    """Seconds the rate was measured over (a running reshard); None: over the whole run."""

    def to_json(self) -> dict[str, Any]:
        return {**self.entry.to_json(), "rows_per_second": self.rate_rows, "briefcases_per_second": self.rate_briefcases,
                "eta_seconds": self.eta_seconds, "rate_window_seconds": self.rate_window, "driver": self.driver,
                "holder": None if self.holder is None else self.holder.to_json()}


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def status_of(entry: JournalEntry, now: datetime) -> MoveStatus:
    """Rate and ETA of a journal entry (through :func:`rate_and_eta`, like the CLI's bars).

    A running reshard that journals its recent counts (:class:`RateWindow`) is measured over that
    window. Anything else over its own run time: until now while it runs, until its last journal
    update once it ended (a finished move's rate must not fall as time passes).
    """
    e = entry
    recent = RateWindow.from_params(e.params) if e.kind in JOB_KINDS and e.status == RUNNING else None
    if recent is not None:
        figures = recent.figures(e.briefcases_done, e.briefcases_total, e.rows_done, e.rows_total, now=now.timestamp())
        return MoveStatus(e, figures.rows_per_second, figures.briefcases_per_second, figures.eta_seconds, rate_window=recent.window)
    if e.started_at is None:
        return MoveStatus(e, None, None, None)
    end = now if e.status == RUNNING or e.updated_at is None else _utc(e.updated_at)
    begun = _utc(e.started_at).timestamp()
    figures = rate_and_eta(e.briefcases_done, e.briefcases_total, e.rows_done, e.rows_total,
                           [(begun, 0, 0), (end.timestamp(), e.briefcases_done, e.rows_done)], end.timestamp(), window=None)
    # over the whole run a zero rate only says nothing is done yet: no figure, as before
    return MoveStatus(e, figures.rows_per_second or None, figures.briefcases_per_second or None, figures.eta_seconds)


def move_status(store: Cluster, *, recent: int = 10) -> tuple[list[MoveStatus], list[MoveStatus]]:
    """(in flight, recently finished) journal entries with rate and ETA computed from exact counts."""
    journal = Journal(store)
    now = datetime.now(timezone.utc)
    running = [status_of(e, now) for e in journal.entries(unfinished=True)]
    for s in running:
        if s.entry.kind not in ("move", "batch-move", *JOB_KINDS):  # a single move, a batch (of one: `mdb move`), a job
            continue  # e.g. document moves (mdb.mongo) record no driver
        # ETA and rate mean nothing for an entry whose process is gone (a
        # reshard stopped by Ctrl-C still showed "ETA 120s"), so they go with its liveness.
        state, s.holder = liveness(journal, s.entry)
        s.driver = describe(state, s.holder)
        if state != "running":
            s.rate_rows = s.rate_briefcases = s.eta_seconds = None
    finished = [status_of(e, now) for e in journal.entries(finished=True, limit=recent)]
    return running, finished
