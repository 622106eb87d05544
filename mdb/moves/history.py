"""Job history: one CENTRAL row per finished reshard or move, kept after the journal is cleaned.

The journal (:mod:`mdb.moves.journal`) says where a job *is*; this says what jobs *did*: start,
end, time spent in each phase, briefcases and rows moved, the p99 of the write pauses, the
result and the error. "What happened last night" must have an answer after the journal rows
are gone, so the row is written in the same CENTRAL transaction that marks the job finished
(:meth:`Journal.finish`), and lives in its own table, ``mdb_move_history``.

Phase timings come from ``mdb_move_phases``: the journal adds a row (server clock) each time
an entry starts or takes a step, and each time a committed move or batch reports its write
pause. On finish the rows become the history row's phase list and are deleted; a reshard's
batches keep their pause rows until the reshard finishes, which turns them into its pause p99.

Retention: rows older than ``MDB_HISTORY_RETENTION_DAYS`` (default 90; 0 keeps everything)
are deleted whenever a job finishes.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Final

from sqlalchemy import Column, Connection, DateTime, Float, Integer, String, Table, Text, delete, func, insert, select

from mdb.cluster import Cluster
from mdb.errors import MdbError
from mdb.system_tables import central_metadata

__all__ = [
    "DEFAULT_RETENTION_DAYS",
    "HistoryRow",
    "PAUSE",
    "RETENTION_ENV",
    "history",
    "history_table",
    "p99",
    "phase_durations",
    "phases_table",
    "retention_days",
]

RETENTION_ENV: Final = "MDB_HISTORY_RETENTION_DAYS"
DEFAULT_RETENTION_DAYS: Final = 90.0
PAUSE: Final = "pause"
"""The phase name of a write-pause sample (its ``seconds`` is the pause)."""

phases_table = Table(
    "mdb_move_phases",
    central_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("move_id", String(64), nullable=False, index=True),
    Column("phase", String(40), nullable=False),
    Column("at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
    Column("seconds", Float, nullable=True),  # pause samples only
)

history_table = Table(
    "mdb_move_history",
    central_metadata,
    Column("job_id", String(64), primary_key=True),
    Column("kind", String(16), nullable=False),
    Column("area", String(63), nullable=False, index=True),
    Column("source", String(63), nullable=True),
    Column("target", String(300), nullable=True),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True), nullable=False, index=True),
    Column("duration_seconds", Float, nullable=False),
    Column("phases", Text, nullable=False, default="[]"),  # [[phase, seconds], ...] in order
    Column("briefcases_total", Integer, nullable=False, default=0),
    Column("briefcases_moved", Integer, nullable=False, default=0),
    Column("rows_moved", Integer, nullable=False, default=0),
    Column("pauses", Integer, nullable=False, default=0),
    Column("pause_p99_seconds", Float, nullable=True),
    Column("result", String(16), nullable=False),
    Column("error", Text, nullable=True),
)


def retention_days() -> float:
    """``MDB_HISTORY_RETENTION_DAYS`` (0: keep forever); a bad value is one clear error, not a silent default."""
    raw = os.environ.get(RETENTION_ENV, "").strip()
    if not raw:
        return DEFAULT_RETENTION_DAYS
    try:
        value = float(raw)
    except ValueError:
        raise MdbError(f"{RETENTION_ENV}={raw!r} is not a number of days") from None
    if value < 0 or math.isnan(value):
        raise MdbError(f"{RETENTION_ENV}={raw!r} must be 0 (keep forever) or a positive number of days")
    return value


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def p99(samples: Sequence[float]) -> float | None:
    """The nearest-rank 99th percentile (None without samples)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def phase_durations(steps: Sequence[tuple[str, datetime]], end: datetime) -> list[tuple[str, float]]:
    """Seconds spent in each phase: from its step to the next step (the last one to ``end``); repeats merged in order."""
    out: list[tuple[str, float]] = []
    for n, (phase, at) in enumerate(steps):
        until = steps[n + 1][1] if n + 1 < len(steps) else end
        seconds = max((_utc(until) - _utc(at)).total_seconds(), 0.0)
        if out and out[-1][0] == phase:
            out[-1] = (phase, out[-1][1] + seconds)
        else:
            out.append((phase, seconds))
    return out


def ensure_tables(conn: Connection) -> None:
    """Create the two tables on a CENTRAL built before they existed (``schema apply`` creates them too)."""
    phases_table.create(conn, checkfirst=True)
    history_table.create(conn, checkfirst=True)


def add_phase(conn: Connection, move_id: str, phase: str, seconds: float | None = None) -> None:
    conn.execute(insert(phases_table).values(move_id=move_id, phase=phase, seconds=seconds))


def record_finish(conn: Connection, job: dict[str, Any], child_ids: Sequence[str]) -> None:
    """In the finishing transaction: turn ``job``'s phase rows (and its children's pauses) into its history row.

    ``job`` is the finished ``mdb_moves`` row. A move of a reshard gets no history row of its
    own (a reshard has thousands); its step rows go, its pause rows stay for the reshard.
    """
    move_id = job["move_id"]
    top = job["kind"] == "reshard" or job["reshard_id"] is None
    if not top:
        conn.execute(delete(phases_table).where(phases_table.c.move_id == move_id, phases_table.c.phase != PAUSE))
        return
    owners = [move_id, *child_ids]
    rows = conn.execute(select(phases_table.c.move_id, phases_table.c.phase, phases_table.c.at, phases_table.c.seconds)
                        .where(phases_table.c.move_id.in_(owners)).order_by(phases_table.c.id)).all()
    started, finished = _utc(job["started_at"]), _utc(job["updated_at"])
    steps = [(r.phase, r.at) for r in rows if r.move_id == move_id and r.phase != PAUSE]
    if not steps or _utc(steps[0][1]) > started:
        steps.insert(0, ("started", started))
    pauses = [float(r.seconds) for r in rows if r.phase == PAUSE and r.seconds is not None]
    phases = phase_durations(steps, finished)
    conn.execute(insert(history_table).values(
        job_id=move_id, kind=job["kind"], area=job["area"], source=job["source"], target=job["target"],
        started_at=started, finished_at=finished, duration_seconds=max((finished - started).total_seconds(), 0.0),
        phases=json.dumps([[p, round(s, 3)] for p, s in phases]), briefcases_total=job["briefcases_total"],
        briefcases_moved=job["briefcases_done"], rows_moved=job["rows_done"], pauses=len(pauses), pause_p99_seconds=p99(pauses),
        result=job["status"], error=job["detail"] if job["status"] != "done" else None,
    ))
    for chunk in range(0, len(owners), 500):
        conn.execute(delete(phases_table).where(phases_table.c.move_id.in_(owners[chunk:chunk + 500])))
    days = retention_days()
    if days:
        cutoff = datetime.now(timezone.utc) - timedelta(days=days)
        conn.execute(delete(history_table).where(history_table.c.finished_at < cutoff))


@dataclass
class HistoryRow:
    job_id: str
    kind: str
    area: str
    source: str | None
    target: str | None
    started_at: datetime
    finished_at: datetime
    duration_seconds: float
    phases: list[tuple[str, float]] = field(default_factory=list)
    briefcases_total: int = 0
    briefcases_moved: int = 0
    rows_moved: int = 0
    pauses: int = 0
    pause_p99_seconds: float | None = None
    result: str = ""
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id, "kind": self.kind, "area": self.area, "source": self.source, "target": self.target,
            "started_at": self.started_at.isoformat(), "finished_at": self.finished_at.isoformat(),
            "duration_seconds": round(self.duration_seconds, 3),
            "phases": [{"phase": p, "seconds": s} for p, s in self.phases],
            "briefcases_total": self.briefcases_total, "briefcases_moved": self.briefcases_moved, "rows_moved": self.rows_moved,
            "pauses": self.pauses, "pause_p99_seconds": self.pause_p99_seconds, "result": self.result, "error": self.error,
        }


def history(store: Cluster, server: str, *, since: datetime | None = None, area: str | None = None,
            limit: int | None = None) -> list[HistoryRow]:
    """Finished jobs kept on CENTRAL ``server`` (the journal's), newest first."""
    query = select(history_table).order_by(history_table.c.finished_at.desc(), history_table.c.job_id)
    if since is not None:
        query = query.where(history_table.c.finished_at >= since)
    if area is not None:
        query = query.where(history_table.c.area == area)
    if limit is not None:
        query = query.limit(limit)
    with store.transaction(server) as conn:
        ensure_tables(conn)
        rows = conn.execute(query).mappings().all()
    return [
        HistoryRow(r["job_id"], r["kind"], r["area"], r["source"], r["target"], _utc(r["started_at"]), _utc(r["finished_at"]),
                   r["duration_seconds"], [(p, float(s)) for p, s in json.loads(r["phases"] or "[]")], r["briefcases_total"],
                   r["briefcases_moved"], r["rows_moved"], r["pauses"], r["pause_p99_seconds"], r["result"], r["error"])
        for r in rows
    ]
