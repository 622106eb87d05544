"""``mdb status``, ``mdb serve-metrics`` and ``mdb moves history``: the fleet for an operator and for Prometheus.

``status`` exits 0 healthy, 5 attention, 6 broken (:data:`EXIT_ATTENTION`, :data:`EXIT_BROKEN`;
docs/cli.md), so a cron job or a readiness probe can act on it without parsing anything.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from mdb.cli.app import EXIT_ATTENTION, EXIT_BROKEN, EXIT_OK, app, console, emit_json, err_console, fail, open_store
from mdb.cli.fleet_cmd import _size
from mdb.cli.metrics import serve_metrics
from mdb.cli.moves_cmd import format_eta, moves_app
from mdb.cli.options import JsonOpt, MapArg
from mdb.errors import MdbError
from mdb.fleet.gauges import FleetGauges
from mdb.fleet.status import ATTENTION, BROKEN, DEFAULT_MAX_SKEW, FleetReport, fleet_report
from mdb.migrations.scripts import scripts_root
from mdb.moves.history import history
from mdb.moves.journal import Journal
from mdb.partition_map import load_map_cached
from mdb.store import Store

__all__: list[str] = []

MaxSkewOpt = Annotated[float, typer.Option("--max-skew", min=0.0, metavar="RATIO",
                                           help="Bytes skew of an area above which it needs attention (0.5 = 50% off the mean).")]
ScriptsOpt = Annotated[str | None, typer.Option("--scripts", metavar="DIR", help="Folder of the migration histories (default: migrations/ beside the map).")]


def _report(store: Store, map_path: str, max_skew: float, scripts: str | None) -> FleetReport:
    root = scripts_root(store.map_path, scripts) if store.map_path is not None or scripts is not None else None
    return fleet_report(store, map_path, load_map_cached(map_path).version, migrations_root=root, max_skew=max_skew)


def _print(report: FleetReport) -> None:
    console.print(f"fleet: {report.verdict.upper()}    map v{report.applied_version} applied, file v{report.file_version}", markup=False)
    areas = Table(title="areas")
    for column in ("area", "server", "briefcases", "rows", "bytes", "skew (bytes)", "relocations"):
        areas.add_column(column)
    for a in report.areas:
        skew = a.skew("bytes")
        for n, s in enumerate(a.servers):
            areas.add_row(escape(a.area) if n == 0 else "", escape(s.server), str(s.briefcases), str(s.rows), _size(s.bytes),
                          f"{skew.get(s.server, 0.0):+.0%}", str(report.relocations.get(a.area, 0)) if n == 0 else "")
    console.print(areas)
    for area, error in report.area_errors.items():
        console.print(f"area {area}: not measured: {error}", markup=False)
    for server, held in report.spares.items():
        console.print(f"spare {server}: " + (", ".join(f"{n} briefcase(s) of {a}" for a, n in held.items()) or "empty"), markup=False)
    if report.jobs:
        jobs = Table(title="jobs")
        for column in ("id", "kind", "area", "state", "phase", "briefcases", "rows", "rows/s", "ETA", "workers", "lease"):
            jobs.add_column(column)
        for j in report.jobs:
            e, h = j.status.entry, j.status.holder
            lease = "-" if h is None else f"pid {h.pid} on {h.host}, beat {h.beat_age:.0f}s ago"
            state = j.state if j.since is None or j.state == "running" else f"{j.state} since {j.since:%Y-%m-%d %H:%M:%S} UTC"
            rate = "-" if j.status.rate_rows is None else f"{j.status.rate_rows:.0f}"
            jobs.add_row(escape(e.move_id), e.kind, escape(e.area), state, escape(e.step), f"{e.briefcases_done}/{e.briefcases_total}",
                         f"{e.rows_done}/{e.rows_total}", rate, format_eta(j.status.eta_seconds), str(e.params.get("parallel", "-")), escape(lease))
        console.print(jobs)
    else:
        console.print("jobs: none running or interrupted", markup=False)
    for f in report.frozen:
        since = "" if f.since is None else f" since {f.since:%Y-%m-%d %H:%M:%S} UTC"
        console.print(f"frozen: area {f.area} partition {f.partition} on {f.server} by {f.reshard_id}{since}"
                      + ("" if f.driven else " (its reshard is not running)"), markup=False)
    if report.migrations:
        mig = Table(title="migrations" + (" (mixed revisions)" if any(report.migrations_mixed.values()) else ""))
        for column in ("area", "server", "revision", "head", "state"):
            mig.add_column(column)
        for m in report.migrations:
            mig.add_row(escape(m["area"]), escape(m["server"] + (" (replica)" if m["replica"] else "")), str(m["revision"] or "base"),
                        str(m["head"] or "base"), escape(m["error"] or m["state"]))
        console.print(mig)
    for failed in report.failures:
        console.print(f"failed: {failed.job_id} ({failed.kind}, {failed.area}) {failed.result} at "
                      f"{failed.finished_at:%Y-%m-%d %H:%M:%S} UTC: {failed.error}", markup=False)
    for p in report.problems:
        console.print(f"{p.level}: {p.what}; do: {p.fix}", markup=False)


def _exit(report: FleetReport) -> int:
    return {BROKEN: EXIT_BROKEN, ATTENTION: EXIT_ATTENTION}.get(report.verdict, EXIT_OK)


@app.command("status")
def status_cmd(
    map_path: MapArg,
    as_json: JsonOpt = False,
    max_skew: MaxSkewOpt = DEFAULT_MAX_SKEW,
    scripts: ScriptsOpt = None,
) -> None:
    """The fleet on one screen: map, areas (briefcases, bytes, skew), spares, jobs, frozen partitions, migrations, failures.

    Exit 0 healthy, 5 attention (an operator should act), 6 broken (the application is affected).
    """
    with open_store(map_path, tool=True) as store:
        report = _report(store, map_path, max_skew, scripts)
    if as_json:
        emit_json(report.to_json())
    else:
        _print(report)
    raise typer.Exit(_exit(report))


@app.command("serve-metrics")
def serve_metrics_cmd(
    map_path: MapArg,
    port: Annotated[int, typer.Option("--port", metavar="N", min=1, max=65535, help="Serve /metrics for Prometheus on port N.")] = 9464,
    interval: Annotated[float, typer.Option("--interval", metavar="SECONDS", min=0.2,
                                            help="Read the fleet's state every SECONDS (each read scans every server: see docs/operations.md).")] = 30.0,
    max_skew: MaxSkewOpt = DEFAULT_MAX_SKEW,
    scripts: ScriptsOpt = None,
) -> None:
    """Serve the fleet's state as Prometheus gauges (jobs, frozen partitions, skew, ...) until stopped."""
    with open_store(map_path, tool=True) as store, serve_metrics(port):
        gauges = FleetGauges(lambda: _report(store, map_path, max_skew, scripts))
        err_console.print(f"serving mdb fleet metrics on :{port}/metrics, read every {interval:g}s (Ctrl-C stops)", markup=False)
        while True:
            try:
                gauges.refresh()
            except MdbError as exc:  # counted (mdb_status_refresh_errors_total); the last good state stays served
                err_console.print(f"note: reading the fleet's state failed: {exc}", markup=False)
            time.sleep(interval)


def _since(text: str) -> datetime:
    """``--since``: an ISO time (UTC when no zone is given) or an age like 90m, 12h, 7d."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text and text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return datetime.now(timezone.utc) - timedelta(seconds=float(text[:-1]) * units[text[-1]])
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        fail(f"--since {text!r}: give an ISO time (2024-05-01T22:00) or an age (90m, 12h, 7d)")
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


@moves_app.command("history")
def history_cmd(
    map_path: MapArg,
    since: Annotated[str | None, typer.Option("--since", metavar="WHEN", help="Only jobs finished since WHEN: an ISO time or an age (12h, 7d).")] = None,
    area: Annotated[str | None, typer.Option("--area", metavar="AREA", help="Only jobs of this area.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many jobs, newest first.")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """Finished reshards and moves: start, end, time per phase, briefcases and rows moved, pause p99, result, error."""
    cutoff = None if since is None else _since(since)
    with open_store(map_path, tool=True) as store:
        if area is not None and area not in store.router.area_names():
            fail(f"--area {area!r}: the map has no such area (it has {', '.join(store.router.area_names())})")
        rows = history(store, Journal(store).server, since=cutoff, area=area, limit=limit)
    if as_json:
        emit_json({"jobs": [r.to_json() for r in rows]})
        return
    table = Table(title="job history")
    for column in ("id", "kind", "area", "started (UTC)", "took", "phases", "briefcases", "rows", "pause p99", "result"):
        table.add_column(column)
    for r in rows:
        phases = ", ".join(f"{p} {format_eta(s)}" for p, s in r.phases)
        p99 = "-" if r.pause_p99_seconds is None else f"{r.pause_p99_seconds * 1000:.0f} ms"
        table.add_row(escape(r.job_id), r.kind, escape(r.area), f"{r.started_at:%Y-%m-%d %H:%M:%S}", format_eta(r.duration_seconds),
                      escape(phases), f"{r.briefcases_moved}/{r.briefcases_total}", str(r.rows_moved), p99, escape(r.result))
    console.print(table)
    for r in rows:
        if r.error:
            console.print(f"  {r.job_id}: {r.error}", markup=False)
