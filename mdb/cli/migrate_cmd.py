"""``mdb migrate revision|status|up|down``: one Alembic history per area, rolled out to every shard.

The library (:mod:`mdb.migrations`) reports progress through a callback; the progress bar, the
tables and the exit codes live here. Exit codes (docs/cli.md): 0 done (``status``: every
server read and none differs from the models; servers behind head are a state, not a
problem); 1 a server failed or drifted (the others were still done); 2 refused before any
server was touched (unknown area, no history, bad ``--to``); 3 a server or CENTRAL was down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Protocol

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mdb.cli.app import EXIT_NOT_FOUND, app, console, emit_json, err_console, open_store
from mdb.migrations.fleet import DEFAULT_LOCK_TIMEOUT, FleetStatus, MigrationRun, ServerResult, ServerStatus, fleet_status, migrate, work_targets
from mdb.migrations.scripts import make_revision, scripts_root
from mdb.parallel import DEFAULT_PARALLEL, MAX_PARALLEL
from mdb.store import Store
from mdb.urls import mask_secrets

__all__ = ["migrate_app"]

migrate_app = typer.Typer(help="Schema migrations (Alembic) on every shard: write, check, roll out.", no_args_is_help=True)
app.add_typer(migrate_app, name="migrate")

MapArg = Annotated[str, typer.Argument(metavar="MAP", help="partition map YAML")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
ScriptsOpt = Annotated[
    str | None,
    typer.Option("--scripts", metavar="DIR", help="folder of the histories, one per area (default: migrations/ beside the map)"),
]
ServerOpt = Annotated[list[str] | None, typer.Option("--server", help="only this server (repeatable; default: every server of the areas)")]
AreaOpt = Annotated[list[str] | None, typer.Option("--area", help="only this area (repeatable; default: every area with a history)")]
ParallelOpt = Annotated[int, typer.Option("--parallel", min=1, max=MAX_PARALLEL, help="Servers migrated at once.")]
ModelsOpt = Annotated[
    list[str] | None,
    typer.Option("--models", metavar="MODULE", help="also import this module for briefcase types (repeatable)"),
]


class _HasServer(Protocol):
    @property
    def server(self) -> str: ...


@contextmanager
def _progress(what: str, total: int) -> Iterator[Callable[[_HasServer], None]]:
    """A progress bar on stderr, on a terminal only (stdout stays the report or the JSON)."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, transient=True, disable=not err_console.is_terminal)
    task = progress.add_task(what, total=total)

    def on_done(item: _HasServer) -> None:
        progress.update(task, advance=1, description=f"{what} (last: {item.server})")

    with progress:
        yield on_done


def _root(store: Store, scripts: str | None) -> Path:
    return scripts_root(store.map_path, scripts)


# -- revision ----------------------------------------------------------------------------------


@migrate_app.command("revision")
def migrate_revision(
    map_path: MapArg,
    area: Annotated[str, typer.Argument(metavar="AREA", help="the area whose history gets the revision")],
    message: Annotated[str, typer.Option("-m", "--message", help="what the revision does")],
    autogenerate: Annotated[bool, typer.Option("--autogenerate", help="compare the area's models with a reference shard")] = False,
    reference: Annotated[str | None, typer.Option("--reference", metavar="SERVER", help="the shard compared with (default: the area's first)")] = None,
    scripts: ScriptsOpt = None,
    models: ModelsOpt = None,
) -> None:
    """Write a new revision of an area's history (review it before rolling it out)."""
    store = open_store(map_path, models, tool=True)
    try:
        written = make_revision(store, _root(store, scripts), area, message, autogenerate=autogenerate, reference=reference)
    finally:
        store.close()
    for path in written:
        console.print(f"wrote {path}", markup=False)


# -- status ------------------------------------------------------------------------------------


def _status_json(s: ServerStatus) -> dict[str, object]:
    return {"area": s.area, "server": s.server, "replica": s.replica, "roles": list(s.roles), "current": s.current, "head": s.head,
            "pending": s.pending, "state": s.state, "drift_checked": s.drift_checked,
            "differences": [d.to_json() for d in s.differences],
            "error": None if s.error is None else mask_secrets(s.error), "ok": s.ok}


def _print_status(status: FleetStatus) -> None:
    table = Table(title="migration status" + (" (mixed revisions: a rollout is under way or stopped)" if status.mixed else ""))
    for column in ("area", "server", "roles", "revision", "pending", "state"):
        table.add_column(column)
    for s in status.servers:
        if s.error is not None:
            state = f"[red]failed[/red]: {escape(mask_secrets(s.error))}"
        elif s.pending:
            state = f"[yellow]behind[/yellow] (head {escape(s.head or 'base')})"
        elif s.differences:
            state = f"[yellow]drift[/yellow]: {escape('; '.join(str(d) for d in s.differences))}"
        else:
            state = "[green]at head[/green]"
        table.add_row(escape(s.area), escape(s.server + (" (replica)" if s.replica else "")), escape(", ".join(s.roles)),
                      escape(s.current or "base"),
                      escape(" ".join(s.pending) or "-"), state)
    console.print(table)
    unfinished = [r for r in status.last_run if r.outcome != "done" and r.outcome != "already"]
    if status.last_run:
        run = status.last_run[0]
        console.print(f"last run {run.run_id} ({run.direction}): {len(status.last_run) - len(unfinished)} of "
                      f"{len(status.last_run)} servers done" + (
                          "; not done: " + ", ".join(f"{r.area}/{r.server} {r.outcome}" for r in unfinished) if unfinished else ""),
                      markup=False)


@migrate_app.command("status")
def migrate_status(
    map_path: MapArg,
    area: AreaOpt = None,
    as_json: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    scripts: ScriptsOpt = None,
    models: ModelsOpt = None,
) -> None:
    """Every server's revision, pending revisions and drift. Exit 1 if a server drifted or could not be read."""
    store = open_store(map_path, models, tool=True)
    try:
        root = _root(store, scripts)
        total = sum(1 + store.engines.has_replica(t.server) for t in work_targets(store, root, area))
        with _progress("migrate status", total) as on_done:
            status = fleet_status(store, root, areas=area, parallel=parallel, on_done=on_done)
    finally:
        store.close()
    bad = [s for s in status.servers if s.error is not None or s.differences]
    if as_json:
        emit_json({"heads": status.heads, "mixed": status.mixed, "ok": not bad,
                   "servers": [_status_json(s) for s in status.servers],
                   "last_run": [{"run_id": r.run_id, "area": r.area, "server": r.server, "direction": r.direction,
                                 "target": r.target, "outcome": r.outcome, "detail": r.detail} for r in status.last_run]})
    else:
        _print_status(status)
    if bad:
        raise typer.Exit(EXIT_NOT_FOUND)


# -- up and down -------------------------------------------------------------------------------


def _result_json(r: ServerResult) -> dict[str, object]:
    return {"area": r.area, "server": r.server, "roles": list(r.roles), "target": r.target, "before": r.before,
            "after": r.after, "outcome": r.outcome, "steps": r.steps,
            "detail": None if r.detail is None else mask_secrets(r.detail), "seconds": round(r.seconds, 3)}


def _print_run(run: MigrationRun) -> None:
    verb = "dry run: " if run.dry_run else ""
    table = Table(title=f"{verb}migrate {run.direction} (run {run.run_id})")
    for column in ("area", "server", "before", "after", "outcome", "detail"):
        table.add_column(column)
    for r in run.results:
        colour = "green" if r.ok else ("red" if r.outcome == "failed" else "yellow")
        after = r.after if r.outcome != "planned" else " -> ".join(r.steps)
        table.add_row(escape(r.area), escape(r.server), escape(r.before or "base"), escape(after or "base"),
                      f"[{colour}]{escape(r.outcome)}[/{colour}]", escape(mask_secrets(r.detail or "")))
    console.print(table)
    if run.failed:
        first = run.failed[0]
        console.print(f"stopped: {first.area} on server {first.server} failed: {mask_secrets(first.detail or '')}; "
                      f"{sum(r.outcome == 'not started' for r in run.results)} server(s) not started. "
                      "Fix it and run the same command again: servers already at the target are left alone.", markup=False)
    else:
        console.print(f"all {len(run.results)} servers at the target", markup=False)


def _run(map_path: str, direction: str, to: str | None, area: list[str] | None, server: list[str] | None, parallel: int, canary: str | None,
         dry_run: bool, lock_timeout: float, as_json: bool, scripts: str | None, models: list[str] | None) -> None:
    store = open_store(map_path, models, tool=True)
    try:
        root = _root(store, scripts)
        total = len([t for t in work_targets(store, root, area) if server is None or t.server in server])
        with _progress(f"migrate {direction}", total) as on_done:
            run = migrate(store, root, direction=direction, to=to, areas=area, servers=server, parallel=parallel, canary=canary,
                          dry_run=dry_run, lock_timeout=lock_timeout, on_done=on_done)
    finally:
        store.close()
    if as_json:
        emit_json({"run_id": run.run_id, "direction": run.direction, "targets": run.targets, "dry_run": run.dry_run,
                   "ok": run.ok, "servers": [_result_json(r) for r in run.results]})
    else:
        _print_run(run)
    if not run.ok:
        raise typer.Exit(EXIT_NOT_FOUND)


CanaryOpt = Annotated[str | None, typer.Option("--canary", metavar="SERVER", help="migrate this server first, alone")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="show what each server would run; change nothing")]
LockTimeoutOpt = Annotated[
    float, typer.Option("--lock-timeout", metavar="SECONDS", help="give up a server whose DDL waits this long for a lock")
]


@migrate_app.command("up")
def migrate_up(
    map_path: MapArg,
    to: Annotated[str | None, typer.Option("--to", metavar="REV", help="target revision (default: head)")] = None,
    area: AreaOpt = None,
    server: ServerOpt = None,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    canary: CanaryOpt = None,
    dry_run: DryRunOpt = False,
    lock_timeout: LockTimeoutOpt = DEFAULT_LOCK_TIMEOUT,
    as_json: JsonOpt = False,
    scripts: ScriptsOpt = None,
    models: ModelsOpt = None,
) -> None:
    """Upgrade every server, canary first; the first failure stops new starts. Rerun after any crash."""
    _run(map_path, "up", to, area, server, parallel, canary, dry_run, lock_timeout, as_json, scripts, models)


@migrate_app.command("down")
def migrate_down(
    map_path: MapArg,
    to: Annotated[str, typer.Option("--to", metavar="REV", help="revision to go back to (or: base)")],
    area: AreaOpt = None,
    server: ServerOpt = None,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
    canary: CanaryOpt = None,
    dry_run: DryRunOpt = False,
    lock_timeout: LockTimeoutOpt = DEFAULT_LOCK_TIMEOUT,
    as_json: JsonOpt = False,
    scripts: ScriptsOpt = None,
    models: ModelsOpt = None,
) -> None:
    """Downgrade every server to --to, with the guarantees of up (for revisions that have a downgrade)."""
    _run(map_path, "down", to, area, server, parallel, canary, dry_run, lock_timeout, as_json, scripts, models)
