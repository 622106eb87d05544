"""``mdb schema apply MAP`` and ``mdb schema check MAP``: create, and compare, the tables of every shard.

The briefcase types come from the modules the map lists under ``models:`` (and ``--models``),
imported before the Store opens, so the command knows the application's tables without the
application running. Shards are independent: one that is down or refuses is reported, the
others are still done, and the exit code (1) tells scripts that the run is incomplete. Both
commands report every difference between a shard's tables and the models (schema drift), so
a model change that was never applied to the databases is seen before a write fails on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from mdb.backends import servers_where
from mdb.cli.app import app, console, emit_json, open_store
from mdb.cli.options import JsonOpt, MapArg, ModelsOpt, server_progress
from mdb.migrations.scripts import scripts_root, stamp_new_servers
from mdb.parallel import DEFAULT_PARALLEL, MAX_PARALLEL
from mdb.schema import ShardReport, apply_schema, check_schema
from mdb.urls import mask_secrets

__all__ = ["ParallelOpt"]

schema_app = typer.Typer(help="Create, and check for drift, mdb's and the briefcase types' tables on every shard.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")


ParallelOpt = Annotated[
    int,
    typer.Option("--parallel", min=1, max=MAX_PARALLEL, help="Servers worked on at once (1: one after the other)."),
]


def _status(report: ShardReport) -> str:
    if report.error is not None:
        return f"[red]failed[/red]: {escape(mask_secrets(report.error))}"
    parts = []
    if report.problems:
        parts.append(f"[yellow]problems[/yellow]: {escape(mask_secrets('; '.join(report.problems)))}")
    if report.differences:
        parts.append(f"[yellow]drift[/yellow]: {len(report.differences)} difference(s), listed below")
    return "; ".join(parts) or "[green]ok[/green]"


def _print_drift(reports: list[ShardReport]) -> None:
    """Every difference, one row each: the table a person fixes the models or the database from."""
    drifted = [r for r in reports if r.differences]
    if not drifted:
        return
    table = Table(title="schema drift: the tables on the server differ from the models")
    for column in ("server", "table", "difference", "detail"):
        table.add_column(column)
    for r in drifted:
        for d in r.differences:
            table.add_row(escape(r.server), escape(d.table), escape(d.kind), escape(d.detail))
    console.print(table)


def _summary(reports: list[ShardReport]) -> None:
    bad = [r.server for r in reports if not r.ok]
    if bad:
        console.print(f"{len(bad)} of {len(reports)} shards not done: {', '.join(bad)}", markup=False)
    else:
        console.print(f"all {len(reports)} shards ok", markup=False)


def _report_json(r: ShardReport) -> dict[str, object]:
    return {"server": r.server, "url": r.url, "roles": r.roles, "created": r.created, "stamped": r.stamped,
            "kept": r.kept, "identity": r.identity, "problems": [mask_secrets(p) for p in r.problems],
            "differences": [d.to_json() for d in r.differences],
            "error": None if r.error is None else mask_secrets(r.error), "notes": r.notes, "ok": r.ok}


def _print(reports: list[ShardReport], map_version: int) -> None:
    table = Table(title=f"schema apply (map version {map_version})")
    for column in ("server", "url", "roles", "tables created", "stamped areas", "status"):
        table.add_column(column)
    for r in reports:
        stamped = [*(f"{area} (new)" for area in r.stamped), *(f"{area} (kept)" for area in r.kept)]
        table.add_row(
            escape(r.server),
            escape(r.url),
            escape(", ".join(r.roles)),
            escape(", ".join(r.created) or "-"),
            escape(", ".join(stamped) or "-"),
            _status(r),
        )
    console.print(table)
    _print_drift(reports)
    _summary(reports)


def _check_json(report: ShardReport) -> dict[str, object]:
    """A shard's report as ``schema check`` prints it: ``apply``'s without what apply wrote."""
    return {k: v for k, v in _report_json(report).items() if k not in ("created", "stamped", "kept", "identity")}


def _finish(reports: list[ShardReport], map_version: int, as_json: bool,
            to_json: Callable[[ShardReport], dict[str, object]], show: Callable[[list[ShardReport], int], None]) -> None:
    """Print the reports (JSON or tables); exit 1 when a shard failed or differs from the models."""
    if as_json:
        emit_json({"map_version": map_version, "ok": all(r.ok for r in reports), "shards": [to_json(r) for r in reports]})
    else:
        show(reports, map_version)
    if not all(r.ok for r in reports):
        raise typer.Exit(1)


@schema_app.command("apply")
def schema_apply(
    map_path: MapArg,
    models: ModelsOpt = None,
    as_json: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
) -> None:
    """Create tables on every shard and stamp new shard layouts; idempotent. Exit 1 if a shard failed or drifted."""
    store = open_store(map_path, models, tool=True)
    pmap = store.map
    try:
        with server_progress("schema apply", len(pmap.servers)) as on_done:
            reports = apply_schema(store, parallel=parallel, on_done=on_done)
        # A server whose area tables were all created now is at the head of the area's history.
        stamped = stamp_new_servers(store, {r.server: r.created for r in reports if r.error is None}, scripts_root(Path(map_path)))
    finally:
        store.close()
    if not as_json:
        for server, area, revision in stamped:
            console.print(f"{server}: area {area} recorded at migration revision {revision} (created from the models)", markup=False)
    _finish(reports, pmap.version, as_json, _report_json, _print)


def _print_check(reports: list[ShardReport], map_version: int) -> None:
    table = Table(title=f"schema check (map version {map_version})")
    for column in ("server", "url", "roles", "status"):
        table.add_column(column)
    for r in reports:
        table.add_row(escape(r.server), escape(r.url), escape(", ".join(r.roles)), _status(r))
    console.print(table)
    _print_drift(reports)
    for r in reports:
        for note in r.notes:
            console.print(f"note: {r.server}: {note}", markup=False)
    bad = [r.server for r in reports if not r.ok]
    if bad:
        console.print(f"{len(bad)} of {len(reports)} shards differ from the models or failed: {', '.join(bad)}", markup=False)
    else:
        console.print(f"all {len(reports)} shards match the models", markup=False)


@schema_app.command("check")
def schema_check(
    map_path: MapArg,
    models: ModelsOpt = None,
    as_json: JsonOpt = False,
    parallel: ParallelOpt = DEFAULT_PARALLEL,
) -> None:
    """Compare every shard's tables with the models, changing nothing. Exit 1 on drift or a failed shard."""
    store = open_store(map_path, models)
    pmap = store.map
    try:
        sql_servers = servers_where(pmap, lambda b: b.checks_drift)  # check skips MongoDB
        with server_progress("schema check", len(sql_servers)) as on_done:
            reports = check_schema(store, parallel=parallel, on_done=on_done)
    finally:
        store.close()
    _finish(reports, pmap.version, as_json, _check_json, _print_check)
