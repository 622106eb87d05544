"""``mdb migrate revision|status|up|down``: one Alembic history per area, rolled out to every shard.

Document areas (MongoDB) have no history: ``status`` and ``up`` also take every MongoDB server
of them to the indexes their types declare (:mod:`mdb.migrations.documents`), after the SQL
areas and with the same rollout; ``down`` and ``--to`` are SQL-only.

The library (:mod:`mdb.migrations`) reports progress through a callback; the progress bar, the
tables and the exit codes live here. Exit codes (docs/cli.md): 0 done (``status``: every
server read and none differs from the models; servers behind head are a state, not a
problem); 1 a server failed or drifted (the others were still done); 2 refused before any
server was touched (unknown area, no history, bad ``--to``); 3 a server or CENTRAL was down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from mdb.cli.app import EXIT_NOT_FOUND, app, console, emit_json, open_store
from mdb.cli.options import JsonOpt, MapArg, ModelsOpt, server_progress
from mdb.migrations.documents import DocumentStatus, document_status, document_targets
from mdb.migrations.fleet import DEFAULT_LOCK_TIMEOUT, FleetStatus, MigrationRun, ServerResult, ServerStatus, fleet_status, work_targets
from mdb.migrations.rollout import DeclaredIndexes, Request, ScriptedHistories, migrate_areas, split_areas
from mdb.migrations.scripts import make_revision, scripts_root
from mdb.parallel import DEFAULT_PARALLEL, MAX_PARALLEL
from mdb.store import Store
from mdb.urls import mask_secrets

__all__ = []

migrate_app = typer.Typer(help="Schema migrations (Alembic) on every shard: write, check, roll out.", no_args_is_help=True)
app.add_typer(migrate_app, name="migrate")

ScriptsOpt = Annotated[
    str | None,
    typer.Option("--scripts", metavar="DIR", help="folder of the histories, one per area (default: migrations/ beside the map)"),
]
ServerOpt = Annotated[list[str] | None, typer.Option("--server", help="only this server (repeatable; default: every server of the areas)")]
AreaOpt = Annotated[list[str] | None, typer.Option("--area", help="only this area (repeatable; default: every area with a history)")]
ParallelOpt = Annotated[int, typer.Option("--parallel", min=1, max=MAX_PARALLEL, help="Servers migrated at once.")]


def _root(store: Store, scripts: str | None) -> Path:
    return scripts_root(store.map_path, scripts)


def _split(store: Store, area: list[str] | None) -> tuple[list[str] | None, list[str] | None]:
    """``--area`` as (history areas, document areas); None: every area of that kind (no --area given)."""
    split = split_areas(store, area)
    return split[ScriptedHistories.name], split[DeclaredIndexes.name]


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


def _revision(value: str | None, known: bool) -> str:
    """A revision as printed: "base" only for a server read at base; "unknown" where it was not read."""
    if not known:
        return "unknown"
    return value or "base"


def _status_json(s: ServerStatus) -> dict[str, object]:
    return {"area": s.area, "server": s.server, "replica": s.replica, "roles": list(s.roles), "current": s.current, "head": s.head,
            "pending": s.pending, "state": s.state, "current_known": s.read, "drift_checked": s.drift_checked,
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
                      escape(_revision(s.current, s.read)),
                      escape(" ".join(s.pending) or "-"), state)
    console.print(table)
    unfinished = [r for r in status.last_run if r.outcome != "done" and r.outcome != "already"]
    if status.last_run:
        run = status.last_run[0]
        console.print(f"last run {run.run_id} ({run.direction}): {len(status.last_run) - len(unfinished)} of "
                      f"{len(status.last_run)} servers done" + (
                          "; not done: " + ", ".join(f"{r.area}/{r.server} {r.outcome}" for r in unfinished) if unfinished else ""),
                      markup=False)


def _document_json(d: DocumentStatus) -> dict[str, object]:
    return {"area": d.area, "server": d.server, "roles": list(d.roles), "current": d.current, "target": d.target, "state": d.state,
            "missing": [str(i) for i in d.missing], "extra": [str(i) for i in d.extra],
            "differing": [{"index": f"{want.collection}.{want.name}", "declared": want.shape(), "live": live.shape()} for want, live in d.differing],
            "other": [str(i) for i in d.other],
            "error": None if d.error is None else mask_secrets(d.error), "ok": d.ok}


def _print_documents(documents: list[DocumentStatus]) -> None:
    mixed = len({d.current for d in documents if d.error is None}) > 1
    table = Table(title="document indexes" + (" (mixed: a rollout is under way or stopped)" if mixed else ""))
    for column in ("area", "server", "roles", "indexes", "state"):
        table.add_column(column)
    for d in documents:
        if d.error is not None:
            state = f"[red]failed[/red]: {escape(mask_secrets(d.error))}"
        else:
            parts = [f"missing {i}" for i in d.missing] + [f"extra {i}" for i in d.extra]
            parts += [f"differs {w.collection}.{w.name}: {here.shape()} here, declared {w.shape()}" for w, here in d.differing]
            colour = {"at target": "green", "behind": "yellow"}.get(d.state, "red")
            state = f"[{colour}]{d.state}[/{colour}]" + (f": {escape('; '.join(parts))}" if parts else "")
            if d.other:
                state += escape(f" (left alone, not mdb's: {', '.join(f'{i.collection}.{i.name}' for i in d.other)})")
        table.add_row(escape(d.area), escape(d.server), escape(", ".join(d.roles)), escape(f"{d.current} (target {d.target})"), state)
    console.print(table)


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
        sql_areas, doc_areas = _split(store, area)
        total = sum(1 + store.engines.has_replica(t.server) for t in work_targets(store, root, sql_areas))
        with server_progress("migrate status", total) as on_done:
            status = fleet_status(store, root, areas=sql_areas, parallel=parallel, on_done=on_done)
        documents: list[DocumentStatus] = []
        if doc_areas is None or doc_areas:
            with server_progress("migrate status (document indexes)", len(document_targets(store, doc_areas))) as on_done:
                documents = document_status(store, areas=doc_areas, parallel=parallel, on_done=on_done)
    finally:
        store.close()
    bad = [s for s in status.servers if s.error is not None or s.differences]
    bad_documents = [d for d in documents if not d.ok]
    if as_json:
        emit_json({"heads": status.heads, "mixed": status.mixed, "ok": not bad and not bad_documents,
                   "servers": [_status_json(s) for s in status.servers],
                   "documents": [_document_json(d) for d in documents],
                   "last_run": [{"run_id": r.run_id, "area": r.area, "server": r.server, "direction": r.direction,
                                 "target": r.target, "outcome": r.outcome, "detail": r.detail} for r in status.last_run]})
    else:
        if status.servers or status.last_run or not documents:
            _print_status(status)
        if documents:
            _print_documents(documents)
    if bad or bad_documents:
        raise typer.Exit(EXIT_NOT_FOUND)


# -- up and down -------------------------------------------------------------------------------


def _result_json(r: ServerResult) -> dict[str, object]:
    return {"area": r.area, "server": r.server, "roles": list(r.roles), "target": r.target, "before": r.before,
            "before_known": r.before_read, "after": r.after, "after_known": r.after_known, "outcome": r.outcome, "steps": r.steps,
            "detail": None if r.detail is None else mask_secrets(r.detail), "seconds": round(r.seconds, 3)}


def _print_run(run: MigrationRun) -> None:
    verb = "dry run: " if run.dry_run else ""
    table = Table(title=f"{verb}migrate {run.direction} (run {run.run_id})")
    for column in ("area", "server", "before", "after", "outcome", "detail"):
        table.add_column(column)
    for r in run.results:
        colour = "green" if r.ok else ("red" if r.outcome == "failed" else "yellow")
        after = _revision(r.after, r.after_known) if r.outcome != "planned" else " -> ".join(r.steps)
        table.add_row(escape(r.area), escape(r.server), escape(_revision(r.before, r.before_read)), escape(after or "base"),
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
        ask = Request(_root(store, scripts), direction, to, area, server, parallel, dry_run, lock_timeout)
        rollout = migrate_areas(store, ask, canary=canary, progress=server_progress)
    finally:
        store.close()
    run, documents = rollout.runs.get(ScriptedHistories.name), rollout.runs.get(DeclaredIndexes.name)
    if as_json:
        main = run if run is not None else documents
        assert main is not None  # the first way always runs when the other does not
        emit_json({**_run_json(main), "ok": rollout.ok, "documents": None if documents is None else _run_json(documents)})
    else:
        for each in rollout.runs.values():
            _print_run(each)
    if not rollout.ok:
        raise typer.Exit(EXIT_NOT_FOUND)


def _run_json(run: MigrationRun) -> dict[str, object]:
    return {"run_id": run.run_id, "direction": run.direction, "targets": run.targets, "dry_run": run.dry_run,
            "ok": run.ok, "servers": [_result_json(r) for r in run.results]}


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
