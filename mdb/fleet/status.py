"""``mdb status``: the whole fleet on one screen, and a verdict a cron job or a probe can act on.

Before, "how is the fleet" took ``balance``, ``moves status``, ``fsck`` and ``map show``. This
reads the same sources through the same code (:func:`mdb.fleet.balance.balance`,
:func:`mdb.moves.status.move_status` with the lease's liveness, the servers' freeze markers,
:func:`mdb.migrations.fleet.fleet_status`, the job history) and sorts what it finds into
problems of two levels:

* **broken**: something the application feels now: a partition frozen with no live reshard
  behind it (its writes wait, then fail), a server that could not be read.
* **attention**: an operator should act, the application is served: an interrupted job, a
  spare server holding data, a fleet at mixed migration revisions, skew above the limit, a map
  file older than the map the system runs, a failed job in the last day.

The verdict is the worst level found (``healthy`` when none). ``mdb serve-metrics`` exports
the same snapshot as gauges (:mod:`mdb.fleet.gauges`).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Final, Literal

from sqlalchemy.exc import DBAPIError

from mdb.cluster import Cluster
from mdb.dberrors import describe
from mdb.errors import MdbError
from mdb.fleet.balance import AreaBalance, balance, measure_server
from mdb.fleet.scan import area_data, scan_of
from mdb.migrations.fleet import fleet_status
from mdb.migrations.scripts import area_dir
from mdb.moves.throttle import replica_lag, replicas_of
from mdb.moves.history import HistoryRow, history
from mdb.moves.journal import Journal
from mdb.moves.status import MoveStatus, move_status
from mdb.ownership import APPLYING_PREFIX, freeze_holder
from mdb.system_tables import STATE_FROZEN

__all__ = ["BROKEN", "ATTENTION", "HEALTHY", "FleetReport", "Problem", "fleet_report"]

Level = Literal["healthy", "attention", "broken"]
HEALTHY: Final = "healthy"
ATTENTION: Final = "attention"
BROKEN: Final = "broken"
_RANK = {HEALTHY: 0, ATTENTION: 1, BROKEN: 2}

DEFAULT_MAX_SKEW: Final = 0.5
"""Bytes skew (|value - mean| / mean of a server) above which an area needs attention."""
FAILURE_WINDOW: Final = timedelta(days=1)
"""A job that failed this recently makes the fleet need attention (older ones are only listed)."""


@dataclass
class Problem:
    level: Level
    what: str
    fix: str

    def to_json(self) -> dict[str, str]:
        return {"level": self.level, "what": self.what, "fix": self.fix}


@dataclass
class Job:
    """A top-level job in the journal (a reshard, a move of its own) that has not finished."""

    status: MoveStatus
    state: str
    """running | interrupted | unknown (a kind whose driver is not recorded)"""
    since: datetime | None
    """interrupted: the driver's last beat (or the journal's last write)."""

    def to_json(self, map_path: str) -> dict[str, Any]:
        e = self.status.entry
        holder = self.status.holder
        out: dict[str, Any] = {
            "id": e.move_id, "kind": e.kind, "area": e.area, "state": self.state, "phase": e.step,
            "source": e.source, "target": e.target,
            "briefcases_done": e.briefcases_done, "briefcases_total": e.briefcases_total,
            "rows_done": e.rows_done, "rows_total": e.rows_total,
            "rows_per_second": self.status.rate_rows, "briefcases_per_second": self.status.rate_briefcases,
            "eta_seconds": self.status.eta_seconds, "workers": e.params.get("parallel"),
            "started_at": None if e.started_at is None else _utc(e.started_at).isoformat(),
            "lease": None if holder is None else {"pid": holder.pid, "host": holder.host, "since": _utc(holder.since).isoformat(),
                                                  "age_seconds": round((datetime.now(timezone.utc) - _utc(holder.since)).total_seconds(), 1),
                                                  "last_beat_seconds_ago": round(holder.beat_age, 1)},
        }
        if self.state != "running":
            out["interrupted_since"] = None if self.since is None else self.since.isoformat()
            out["run"] = [f"mdb moves resume {map_path}", f"mdb moves cancel {map_path} {e.move_id}"]
        return out


@dataclass
class Frozen:
    area: str
    partition: str
    server: str
    reshard_id: str | None
    since: datetime | None
    driven: bool
    """True when its reshard is running (a normal final phase); False: writes wait for nobody."""

    def to_json(self) -> dict[str, Any]:
        return {"area": self.area, "partition": self.partition, "server": self.server, "reshard_id": self.reshard_id,
                "since": None if self.since is None else self.since.isoformat(), "reshard_running": self.driven}


@dataclass
class FleetReport:
    map_path: str
    file_version: int
    applied_version: int
    areas: list[AreaBalance] = field(default_factory=list)
    area_errors: dict[str, str] = field(default_factory=dict)
    spares: dict[str, dict[str, int]] = field(default_factory=dict)
    """spare server -> area -> briefcases it holds."""
    relocations: dict[str, int] = field(default_factory=dict)
    jobs: list[Job] = field(default_factory=list)
    frozen: list[Frozen] = field(default_factory=list)
    migrations: list[dict[str, Any]] = field(default_factory=list)
    migrations_mixed: dict[str, bool] = field(default_factory=dict)
    failures: list[HistoryRow] = field(default_factory=list)
    replica_lag: dict[str, float] = field(default_factory=dict)
    """server -> seconds its map-named replica is behind (what ``--max-lag`` throttles on; inf: never replayed)."""
    problems: list[Problem] = field(default_factory=list)
    max_skew: float = DEFAULT_MAX_SKEW
    at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def verdict(self) -> Level:
        worst: Level = HEALTHY
        for p in self.problems:
            if _RANK[p.level] > _RANK[worst]:
                worst = p.level
        return worst

    def skew(self, area: AreaBalance) -> float:
        return max((abs(v) for v in area.skew("bytes").values()), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict, "at": self.at.isoformat(),
            "map": {"file_version": self.file_version, "applied_version": self.applied_version,
                    "file_behind": self.file_version < self.applied_version},
            "areas": [{**a.to_json(), "relocations": self.relocations.get(a.area, 0)} for a in self.areas],
            "area_errors": self.area_errors,
            "spares": [{"server": s, "briefcases": held} for s, held in self.spares.items()],
            "jobs": [j.to_json(self.map_path) for j in self.jobs],
            "frozen": [f.to_json() for f in self.frozen],
            "migrations": {"mixed": self.migrations_mixed, "servers": self.migrations},
            "failures": [f.to_json() for f in self.failures],
            "replica_lag_seconds": {s: (None if math.isinf(v) else round(v, 3)) for s, v in self.replica_lag.items()},
            "problems": [p.to_json() for p in self.problems],
        }


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def _reason(exc: Exception) -> str:
    return describe(exc) if isinstance(exc, DBAPIError) else str(exc)


def spare_servers(store: Cluster) -> list[str]:
    """Servers in no area's layout and not CENTRAL (as ``migrate`` counts them): they should hold nothing."""
    router = store.router
    used = set(router.central_servers())
    for area in router.area_names():
        used.update(router.area_servers(area))
    return [s for s in store.map.servers if s not in used]


def _jobs(store: Cluster, report: FleetReport) -> None:
    running, finished = move_status(store, recent=0)
    for s in running:
        e = s.entry
        if e.kind != "reshard" and e.reshard_id is not None:
            continue  # a batch or move of a reshard: the reshard is the job
        state = "unknown" if s.driver is None else ("running" if s.driver.startswith("running") else "interrupted")
        since = None
        if state != "running":
            last = [_utc(t) for t in (e.updated_at, None if s.holder is None else s.holder.beat_at) if t is not None]
            since = max(last) if last else None
        report.jobs.append(Job(s, state, since))


def _frozen(store: Cluster, report: FleetReport, running_reshards: set[str]) -> None:
    for area in store.router.area_names():
        try:
            data = area_data(store, area)
        except MdbError:
            continue  # no type registered: the area error of its balance says so
        for server in store.router.area_servers(area):
            try:
                states = [s for s in scan_of(store, server, data).states() if s.state == STATE_FROZEN]
            except (MdbError, DBAPIError) as exc:
                report.problems.append(Problem(BROKEN, f"server {server!r}: cannot read its freeze markers of area {area!r}: {_reason(exc)}",
                                               "check the server"))
                continue
            for s in states:
                holder = None if s.move_id is None else freeze_holder(s.move_id)
                report.frozen.append(Frozen(area, str(s.peer), server, holder,
                                            None if s.changed_at is None else _utc(s.changed_at), holder in running_reshards))


def _migrations(store: Cluster, report: FleetReport, root: Path | None) -> None:
    if root is None:
        return
    areas = [a for a in store.router.area_names() if (area_dir(root, a) / "versions").is_dir()]
    if not areas:
        return
    status = fleet_status(store, root, areas=areas)
    for s in status.servers:
        report.migrations.append({"area": s.area, "server": s.server, "replica": s.replica, "revision": s.current,
                                  "head": s.head, "state": s.state, "error": s.error})
    for area in areas:
        revisions = {s.current for s in status.servers if s.area == area and s.error is None}
        report.migrations_mixed[area] = len(revisions) > 1


def fleet_report(store: Cluster, map_path: str, file_version: int, *, migrations_root: Path | None = None,
                 max_skew: float = DEFAULT_MAX_SKEW, failures: int = 5) -> FleetReport:
    """Read everything ``mdb status`` shows and judge it (see the module docstring)."""
    store.refresh()
    report = FleetReport(map_path, file_version, store.map.version, max_skew=max_skew)
    problems = report.problems
    if file_version < store.map.version:
        problems.append(Problem(ATTENTION, f"map file {map_path} is v{file_version}; the system runs v{store.map.version}",
                                f"mdb map pull {map_path} -o {map_path}"))
    for (area, _server), reach in store.router.relocation_reach.items():
        report.relocations[area] = report.relocations.get(area, 0) + reach.count
    for area in store.router.area_names():
        try:
            measured = balance(store, area, top=0)
        except (MdbError, DBAPIError) as exc:
            report.area_errors[area] = _reason(exc)
            problems.append(Problem(BROKEN, f"area {area!r}: cannot measure it: {_reason(exc)}", "check the servers it names"))
            continue
        report.areas.append(measured)
        skew = report.skew(measured)
        if skew > max_skew:
            problems.append(Problem(ATTENTION, f"area {area!r}: bytes skew {skew:.0%} is above {max_skew:.0%}",
                                    f"mdb rebalance {map_path} {area} --plan"))
    spares = spare_servers(store)
    for measured_area in report.areas:
        seen = {s.server: s for s in measured_area.servers}
        data = area_data(store, measured_area.area)
        for spare in spares:
            try:  # a relocation target was measured with the area; any other spare is scanned here
                held = seen[spare] if spare in seen else measure_server(store, measured_area.area, spare, data, 0, spare=True)
            except (MdbError, DBAPIError) as exc:
                problems.append(Problem(BROKEN, f"spare server {spare!r}: cannot read it: {_reason(exc)}", "check the server"))
                continue
            if held.briefcases:
                report.spares.setdefault(spare, {})[measured_area.area] = held.briefcases
    _jobs(store, report)
    for server in replicas_of(store, list(store.map.servers)):  # the same measurement the reshard's throttle makes
        try:
            report.replica_lag[server] = replica_lag(store, server)
        except (MdbError, DBAPIError) as exc:
            problems.append(Problem(ATTENTION, f"the replica of {server!r} cannot be read: {_reason(exc)}",
                                    "check the replica (reads and `--max-lag` reshards depend on it)"))
    receiving = {t for j in report.jobs for t in [*j.status.entry.params.get("new_shards", []), j.status.entry.target] if t}
    for server in spares:
        holding = report.spares.setdefault(server, {})
        if holding and server not in receiving:  # a spare an unfinished job moves to is filling up on purpose
            problems.append(Problem(ATTENTION, f"spare server {server!r} holds " + ", ".join(f"{n} briefcase(s) of {a!r}" for a, n in holding.items()),
                                    f"mdb fsck {map_path} (leftovers), or move them off before removing the server"))
    running_reshards = {j.status.entry.move_id for j in report.jobs if j.state == "running" and j.status.entry.kind == "reshard"}
    for job in report.jobs:
        if job.state != "running":
            e = job.status.entry
            problems.append(Problem(ATTENTION, f"{e.kind} {e.move_id} of area {e.area!r} is {job.state} at phase {e.step!r}",
                                    f"mdb moves resume {map_path} (or mdb moves cancel {map_path} {e.move_id})"))
    _frozen(store, report, running_reshards)
    for f in report.frozen:
        if f.reshard_id is not None and f.reshard_id.startswith(APPLYING_PREFIX):
            problems.append(Problem(ATTENTION, f"partition {f.partition} of area {f.area!r} on {f.server!r} holds the marker of "
                                    f"{f.reshard_id}, a map apply that stopped before it published its map (it turns no session "
                                    "away)", f"mdb fsck {map_path} --repair"))
        elif not f.driven:
            problems.append(Problem(BROKEN, f"partition {f.partition} of area {f.area!r} is frozen on {f.server!r} by {f.reshard_id}, "
                                    "which is not running: its writes wait and fail", f"mdb moves resume {map_path}"))
    try:
        _migrations(store, report, migrations_root)
    except (MdbError, DBAPIError) as exc:
        problems.append(Problem(ATTENTION, f"migration status could not be read: {_reason(exc)}", f"mdb migrate status {map_path}"))
    for area, mixed in report.migrations_mixed.items():
        if mixed:
            problems.append(Problem(ATTENTION, f"area {area!r}: servers at mixed migration revisions (a rollout is under way or stopped)",
                                    f"mdb migrate status {map_path}, then mdb migrate up {map_path}"))
    report.failures = [h for h in history(store, Journal(store).server, limit=50) if h.result not in ("done", "cancelled")][:failures]
    recent = [h for h in report.failures if report.at - h.finished_at < FAILURE_WINDOW]
    if recent:
        problems.append(Problem(ATTENTION, f"{len(recent)} job(s) failed in the last day, the latest {recent[0].job_id} "
                                f"({recent[0].result}: {recent[0].error})", f"mdb moves history {map_path}"))
    return report
