"""``mdb balance``, ``mdb fsck``, ``mdb rebalance`` and ``mdb drain``: the fleet as a whole (docs/fleet.md).

Every command opens the Store with :func:`mdb.cli.app.open_store` and reads the live servers;
``fsck`` exits 1 when it finds problems (decisions.md). ``rebalance --apply`` and ``drain``
run their moves as a job in CENTRAL (:mod:`mdb.moves.movejob`): this process works on it, any
``mdb worker MAP`` too, and an interrupted one is finished by a worker or ``mdb moves resume``.
"""

from __future__ import annotations

from typing import Annotated, cast

import typer
from rich.markup import escape
from rich.table import Table

from mdb.cli.app import EXIT_NOT_FOUND, app, console, emit_json, fail, open_store, warn
from mdb.cli.options import JsonOpt, MapArg
from mdb.cli.metrics import MetricsPortOpt, serve_metrics
from mdb.fleet.balance import MEASURES, AreaBalance, Measure, balance
from mdb.fleet.drain import DrainCheck, DrainMove, check_drain, drain, drain_refusal
from mdb.fleet.fsck import FsckReport, fsck
from mdb.fleet.rebalance import MIN_IMPROVEMENT, RebalancePlan, apply_plan, plan_rebalance
from mdb.moves.jobs import DEFAULT_PER_SERVER
from mdb.moves.journal import Journal
from mdb.moves.move import DEFAULT_MAX_PAUSE
from mdb.moves.plan import PlannedMove as PlannedMove
from mdb.moves.reshard import DEFAULT_BATCH_PAUSE, ReshardCounts
from mdb.store import Store

__all__: list[str] = []

BatchPauseOpt = Annotated[float, typer.Option(
    "--batch-pause", metavar="SECONDS", min=0.0,
    help="Write pause a batch of briefcases aims at (batches grow or shrink to keep it); 0: one briefcase at a time.")]
PerServerOpt = Annotated[int, typer.Option("--per-server", min=1, max=64, help="Work items in flight at once on one server, over every worker of every host.")]
AreaOpt = Annotated[str | None, typer.Argument(metavar="[AREA]", help="one area (default: every partitioned area)", show_default=False)]
BAR_WIDTH = 30


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def _areas(store: Store, area: str | None) -> list[str]:
    if area is None:
        return store.router.area_names()
    list(store.router.partitions(area))  # an unknown area: RoutingError (exit 2)
    return [area]


def _print_balance(report: AreaBalance) -> None:
    skew = report.skew("bytes")
    table = Table(title=f"area {escape(report.area)}")
    for column in ("server", "briefcases", "rows", "bytes", "disk", "skew (bytes)", "stray", ""):
        table.add_column(column, justify="left" if column in ("server", "") else "right")
    peak = max((s.bytes for s in report.measured()), default=0)
    for s in report.servers:
        name = escape(s.server) + (" (spare)" if s.spare else "")
        if not s.measured:
            table.add_row(name, "not measured", "", "", "", "", "", "")
            continue
        bar = "█" * (round(BAR_WIDTH * s.bytes / peak) if peak else 0)
        stray = f"{s.stray_briefcases} ({_size(s.stray_bytes)})" if s.stray_briefcases else "-"
        table.add_row(name, str(s.briefcases), str(s.rows), _size(s.bytes), _size(s.disk_bytes),
                      "-" if s.spare else f"{skew[s.server]:+.1%}", stray, bar)
    console.print(table)
    strays = sum(s.stray_briefcases for s in report.servers)
    if strays:
        console.print(f"{strays} briefcase(s) have data on a server they are not routed to (stray: not counted above); "
                      "`mdb fsck MAP` says what they are")
    for m in MEASURES:
        values = report.skew(m).values()
        console.print(f"max skew by {m}: {max((abs(v) for v in values), default=0.0):.1%}")
    largest = report.largest()
    if largest:
        top = Table(title=f"{len(largest)} largest briefcases of {escape(report.area)}")
        for column in ("gdid", "server", "rows", "bytes"):
            top.add_column(column, justify="right" if column in ("rows", "bytes") else "left")
        for server, b in largest:
            top.add_row(str(b.gdid), escape(server), str(b.rows), _size(b.bytes))
        console.print(top)


@app.command("balance")
def balance_cmd(
    map_path: MapArg,
    area: AreaOpt = None,
    top: Annotated[int, typer.Option("--top", metavar="N", help="Show the N largest briefcases.", min=0)] = 5,
    as_json: JsonOpt = False,
) -> None:
    """Briefcases, rows and bytes per server of each area, their skew against the mean, the largest briefcases."""
    with open_store(map_path) as store:
        reports = [balance(store, name, top=top) for name in _areas(store, area)]
    if as_json:
        emit_json({"areas": [r.to_json() for r in reports]})
        return
    for report in reports:
        _print_balance(report)


def _print_fsck(report: FsckReport) -> None:
    checked = f"{len(report.servers) - len(report.not_checked)} server(s), {report.briefcases} briefcase(s)"
    if report.not_checked:
        console.print(f"area {escape(report.area)}: not checked: {escape(', '.join(report.not_checked))}")
    if not report.central_indexes:
        console.print(f"area {escape(report.area)}: no CENTRAL index declared, CENTRAL not checked (list the module "
                      "that declares them under models: in the map)")
    if report.clean:
        console.print(f"area {escape(report.area)}: clean ({checked})")
        return
    table = Table(title=f"area {escape(report.area)}: {len(report.findings)} finding(s) on {checked}")
    for column in ("kind", "server", "gdid", "detail", "action"):
        table.add_column(column)
    for f in report.findings:
        table.add_row(f.kind, escape(f.server), "" if f.gdid is None else str(f.gdid), escape(f.detail), escape(f.action))
    console.print(table)


@app.command("fsck")
def fsck_cmd(
    map_path: MapArg,
    area: AreaOpt = None,
    repair: Annotated[bool, typer.Option("--repair", help="Remove what is provably a leftover (a verified copy exists on the owner); nothing else.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Rows on servers that do not own them, leftovers of failed moves, stale fences and freeze markers, orphan CENTRAL entries."""
    with open_store(map_path) as store:
        reports = [fsck(store, name, repair=repair) for name in _areas(store, area)]
    if as_json:
        emit_json({"areas": [r.to_json() for r in reports]})
    else:
        for report in reports:
            _print_fsck(report)
    if any(r.problems_left for r in reports):
        raise typer.Exit(EXIT_NOT_FOUND)


def _print_plan(plan: RebalancePlan) -> None:
    table = Table(title=f"rebalance {escape(plan.area)} by {plan.by}: {len(plan.moves)} move(s)")
    for column in ("gdid", "from", "to", plan.by):
        table.add_column(column, justify="right" if column == plan.by else "left")
    for m in plan.moves:
        table.add_row(str(m.gdid), escape(m.source), escape(m.target), _size(m.size) if plan.by == "bytes" else str(m.size))
    console.print(table)
    if plan.dropped:
        console.print(escape(plan.dropped))
    crossing = plan.cross_partition
    if crossing:
        console.print(f"note: {len(crossing)} move(s) put a briefcase on a server outside its partition's shard list "
                      f"(e.g. {crossing[0].gdid} -> {escape(crossing[0].target)}); it lives there as a relocation")
    show = _size if plan.by == "bytes" else str
    for server in plan.before:
        console.print(f"{escape(server)}: {show(plan.before[server])} -> {show(plan.after[server])}")
    console.print(f"max skew by {plan.by}: {plan.max_skew(plan.before):.1%} -> {plan.max_skew(plan.after):.1%} (planned)")


class _MovesPrinter:
    """A rebalance's or drain's job shown as lines: one per batch or move that finished (``[done/total] moved ...``)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.done = 0

    def phase(self, name: str) -> None:
        pass

    def counts(self, counts: ReshardCounts, last: PlannedMove | None) -> None:
        if self.quiet or last is None or counts.briefcases_done == self.done:
            return
        self.done = counts.briefcases_done
        console.print(f"[{counts.briefcases_done}/{counts.briefcases_total}] moved {last.gdid} {last.source} -> {last.target} "
                      f"({counts.rows_done} rows so far)", markup=False)

    def waiting(self, reason: str, seconds: float) -> None:
        pass


def _say_job_interrupted(store: Store, kind: str, areas: list[str], map_path: str) -> None:
    """After Ctrl-C or SIGTERM: one stderr line per interrupted job of ``kind`` and how it goes on."""
    for entry in Journal(store).entries(unfinished=True):
        if entry.kind == kind and entry.area in areas:
            warn(f"{kind} {entry.move_id} of area {entry.area!r} interrupted (its work items given back): any `mdb worker {map_path}` "
                 f"finishes it, or run `mdb moves resume {map_path}` (`mdb moves cancel {map_path} {entry.move_id}` stops it)")


@app.command("rebalance")
def rebalance_cmd(
    map_path: MapArg,
    area: Annotated[str, typer.Argument(help="area to even out")],
    plan_only: Annotated[bool, typer.Option("--plan", help="Print the plan; move nothing.")] = False,
    apply: Annotated[bool, typer.Option("--apply", help="Plan, then run the moves as a job in CENTRAL (this process and any `mdb worker` move them).")] = False,
    by: Annotated[str, typer.Option("--by", metavar="bytes|rows|briefcases", help="The measure to even out.")] = "bytes",
    max_moves: Annotated[int, typer.Option("--max-moves", metavar="N", help="At most N moves.", min=1)] = 100,
    max_pause: Annotated[float, typer.Option("--max-pause", metavar="SECONDS", help="Each move's bound on its write pause.", min=0.0)] = DEFAULT_MAX_PAUSE,
    batch_pause: BatchPauseOpt = DEFAULT_BATCH_PAUSE,
    per_server: PerServerOpt = DEFAULT_PER_SERVER,
    min_improvement: Annotated[float, typer.Option(
        "--min-improvement", metavar="POINTS",
        help="Plan nothing unless the moves lower the largest skew by at least this many percentage points.", min=0.0,
    )] = MIN_IMPROVEMENT * 100,
    as_json: JsonOpt = False,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Plan single-briefcase moves that even AREA's bytes, rows or briefcases over its servers (--plan), or run them (--apply)."""
    if plan_only == apply:
        fail("rebalance needs exactly one of --plan or --apply")
    if by not in MEASURES:
        fail(f"--by {by!r}: expected one of {', '.join(MEASURES)}")
    measure = cast(Measure, by)  # checked against MEASURES above
    with serve_metrics(metrics_port), open_store(map_path) as store:
        list(store.router.partitions(area))  # an unknown area: RoutingError (exit 2)
        plan = plan_rebalance(store, area, by=measure, max_moves=max_moves, min_improvement=min_improvement / 100)
        if not as_json:
            _print_plan(plan)
        if not apply:
            if as_json:
                emit_json(plan.to_json())
            return

        try:
            outcome = apply_plan(store, plan, max_pause=max_pause, batch_pause=batch_pause, per_server=per_server,
                                 progress=_MovesPrinter(as_json))
        except KeyboardInterrupt:
            _say_job_interrupted(store, "rebalance", [area], map_path)
            raise
    if as_json:
        emit_json({**plan.to_json(), "applied": outcome.to_json()})
    else:
        job = "" if outcome.job_id is None else f" (job {outcome.job_id})"
        console.print(f"applied {outcome.moved} move(s){job}; `mdb balance MAP {escape(area)}` shows the result")


def _print_drain_check(check: DrainCheck) -> None:
    for held in check.areas:
        if not held.checked:
            console.print(f"area {escape(held.area)}: not checked (no briefcase type registered: list its module under models:)")
        elif held.holds_data:
            console.print(f"area {escape(held.area)}: holds data: {len(held.routed)} briefcase(s) routed here, "
                          f"{len(held.stray)} stray (routed elsewhere: `mdb fsck`), {held.rows} row(s)")
        else:
            console.print(f"area {escape(held.area)}: no data")
    if check.roles:
        console.print(f"still in the layout: {escape('; '.join(check.roles))}")
    verdict = "holds data" if check.holds_data else "holds no data of any checked area"
    console.print(f"server {escape(check.server)}: {verdict}")


@app.command("drain")
def drain_cmd(
    map_path: MapArg,
    server: Annotated[str, typer.Argument(help="the server to empty (in no partition's shard list)")],
    check: Annotated[bool, typer.Option("--check", help="Only say, per area, whether the server still holds data.")] = False,
    max_pause: Annotated[float, typer.Option("--max-pause", metavar="SECONDS", help="Each move's bound on its write pause.", min=0.0)] = DEFAULT_MAX_PAUSE,
    batch_pause: BatchPauseOpt = DEFAULT_BATCH_PAUSE,
    per_server: PerServerOpt = DEFAULT_PER_SERVER,
    as_json: JsonOpt = False,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Move every briefcase routed to SERVER home, as a job per area (--check: does it still hold data); exit 1 while data remains."""
    jobs_run: list[dict[str, object]] = []
    with serve_metrics(metrics_port), open_store(map_path) as store:
        if check:
            result = check_drain(store, server)
        else:
            if server not in store.map.servers:
                fail(f"unknown server {server!r} (the map names {', '.join(store.map.servers)})")
            refusal = drain_refusal(store, server)
            if refusal is not None:
                fail(f"drain refused: {refusal}")
            areas: list[str] = []

            def planned(moves: list[DrainMove]) -> None:
                areas.extend(dict.fromkeys(m.area for m in moves))
                if not as_json:
                    console.print(f"draining {escape(server)}: {len(moves)} briefcase(s) to move home")

            try:
                result, outcomes = drain(store, server, max_pause=max_pause, batch_pause=batch_pause, per_server=per_server,
                                         on_plan=planned, progress=lambda area: _MovesPrinter(as_json))
            except KeyboardInterrupt:
                _say_job_interrupted(store, "drain", areas, map_path)
                raise
            jobs_run = [o.to_json() for o in outcomes]
    if as_json:
        emit_json({**result.to_json(), "jobs": jobs_run})
    else:
        _print_drain_check(result)
    if result.holds_data:
        raise typer.Exit(EXIT_NOT_FOUND)
