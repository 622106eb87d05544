"""``mdb snapshot MAP AREA|central``: one snapshot pass of the declared event logs.

Event logs (and their folds) are application code: the command imports the map's ``models:``
modules (and ``--models``), where they are declared, then folds every stream that has events
no snapshot has folded yet. It is safe on a schedule, next to the writers, and next to another
run of itself (see docs/hot-data.md): jobs on one stream take turns on its head row, and an
event whose transaction commits late is folded by a later pass, never skipped. A stream with an
event its fold cannot take is reported by stream and briefcase while all the others are folded;
the run then exits 1 (problems found).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from mdb.cli.app import app, console, emit_json, fail, open_store
from mdb.hot.event_log import EventLog, SnapshotResult, registered_logs, run_snapshots
from mdb.store import Store

__all__ = ["snapshot"]


def _logs_for(store: Store, where: str, name: str | None) -> list[EventLog]:
    logs = registered_logs(store.registry)
    if name is not None:
        chosen = [log for log in logs if log.name == name]
        if not chosen:
            fail(f"no event log named {name!r} is declared (declared: {', '.join(sorted(log.name for log in logs)) or 'none'})")
        return chosen
    if where == "central":
        found = [log for log in logs if log.tables.key_column is None]
    else:
        tables = {t for btype in store.types_of(where) for t in btype.tables}
        found = [log for log in logs if log.tables.events in tables]
    if not found:
        fail(f"no event log is declared for {where!r} (declare EventLog(...) in a module the map lists under models:)")
    return found


@app.command("snapshot")
def snapshot(
    map_path: Annotated[str, typer.Argument(metavar="MAP", help="partition map YAML")],
    where: Annotated[str, typer.Argument(metavar="AREA|central", help="an area name, or central")],
    stream: Annotated[str | None, typer.Option("--stream", help="only this stream")] = None,
    log_name: Annotated[str | None, typer.Option("--log", help="only the event log with this table name")] = None,
    models: Annotated[
        list[str] | None,
        typer.Option("--models", metavar="MODULE", help="also import this module (briefcase types, event logs)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Fold new events into incremental snapshots, for every stream of AREA (or of CENTRAL)."""
    store = open_store(map_path, models)
    pmap = store.map
    if where != "central" and where not in {name for name, area in pmap.areas.items() if area.kind != "central"}:
        store.close()
        fail(f"{where!r} is not an area of {map_path} (areas: {', '.join(sorted(pmap.areas))})")
    results: list[tuple[EventLog, SnapshotResult]] = []
    try:
        for log in _logs_for(store, where, log_name):
            results += [(log, r) for r in run_snapshots(store, log, where, stream=stream)]
    finally:
        store.close()
    done = [(log, r) for log, r in results if r.error is None]
    failed = [(log, r) for log, r in results if r.error is not None]
    if as_json:
        emit_json({
            "target": where,
            "snapshots": [_as_json(log, r) for log, r in done],
            "events_folded": sum(r.folded for _, r in done),
            "failed": [{**_as_json(log, r), "error": r.error} for log, r in failed],
        })
    else:
        _print_results(where, done, failed)
    if failed:
        raise typer.Exit(1)  # the other streams were folded; these need their events fixed


def _as_json(log: EventLog, r: SnapshotResult) -> dict[str, object]:
    return {"log": log.name, "stream": r.stream, "key": None if r.key is None else str(r.key), "server": r.server,
            "seq": r.seq, "folded": r.folded}


def _print_results(where: str, done: list[tuple[EventLog, SnapshotResult]], failed: list[tuple[EventLog, SnapshotResult]]) -> None:
    table = Table(title=f"snapshot pass over {where}")
    for column in ("log", "stream", "briefcase", "server", "snapshot", "events folded"):
        table.add_column(column, justify="right" if column in ("snapshot", "events folded") else "left")
    for log, r in done:
        table.add_row(escape(log.name), escape(r.stream), "-" if r.key is None else str(r.key), escape(r.server), str(r.seq), str(r.folded))
    console.print(table)
    written = sum(1 for _, r in done if r.folded)
    console.print(f"{written} snapshots written, {sum(r.folded for _, r in done)} events folded", markup=False)
    for _log, r in failed:  # the error names the log, stream, briefcase (or CENTRAL) and event
        console.print(f"error: server {r.server!r}: {r.error}", markup=False, soft_wrap=True)
    if failed:
        console.print(f"{len(failed)} streams could not be folded (left as they were; the others were folded)", markup=False)
