"""``mdb central lookup|check|repair``: CENTRAL index lookups and reconciliation for operators.

Index classes come from the modules the map lists under ``models:`` (and ``--models``).
``check`` exits 1 when it finds problems, ``repair`` exits 1 when some remain after it (a
conflict it cannot decide), so both fit in scripts and cron jobs.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from mdb.central.indexes import CentralIndex, index_by_name, registered_indexes
from mdb.central.reconcile import CheckReport, check, repair
from mdb.cli.app import app, console, emit_json, fail, open_store
from mdb.cli.options import JsonOpt, MapArg, ModelsOpt
from mdb.cli.schema_cmd import ParallelOpt
from mdb.parallel import DEFAULT_PARALLEL
from mdb.store import Store

__all__ = []

central_app = typer.Typer(help="CENTRAL indexes: look keys up, check and repair index entries.", no_args_is_help=True)
app.add_typer(central_app, name="central")

IndexOpt = Annotated[
    list[str] | None, typer.Option("--index", metavar="NAME", help="only this index (repeatable; default: all declared)")
]
GraceOpt = Annotated[
    float | None,
    typer.Option("--grace", metavar="SECONDS", help="age after which an unconfirmed pending entry is dangling (default 60)"),
]


def _open(map_path: str, models: list[str] | None) -> Store:
    return open_store(map_path, models)


def _indexes(store: Store, names: list[str] | None) -> list[type[CentralIndex]]:
    """The named indexes, or every declared index whose area this map has.

    A process may have imported index declarations for other maps (other applications' models,
    a Mongo area); by default those are not this map's business. Naming one explicitly whose
    area the map lacks is an error, not a silent skip.
    """
    areas = store.map.areas
    if names:
        indexes = [index_by_name(n, store.registry) for n in names]
        for idx in indexes:
            if idx.area not in areas:
                fail(f"CENTRAL index {idx.name!r} points at area {idx.area!r}, which map {store.map_path} does not have")
        return indexes
    indexes = [idx for idx in registered_indexes(store.registry) if idx.area in areas]
    if not indexes:
        fail("no CENTRAL index of this map's areas is declared: list the module that declares them under models: "
             "in the map, or pass --models")
    return indexes


@central_app.command("lookup")
def lookup(map_path: MapArg, index: Annotated[str, typer.Argument(metavar="INDEX")],
           key: Annotated[str, typer.Argument(metavar="KEY")], models: ModelsOpt = None, as_json: JsonOpt = False) -> None:
    """The GDID a key maps to (exit 1 when it maps to none)."""
    store = _open(map_path, models)
    try:
        idx = index_by_name(index, store.registry)
        normalized = idx.key_of(key)
        placement = store.router.locate_central(normalized)
        gdids = [g] if idx.unique and (g := store.central.lookup(idx, key)) else ([] if idx.unique else store.central.lookup_all(idx, key))
        target = None
        if gdids and len(gdids) == 1:
            p = store.router.locate(store.central.briefcase_type(idx).area, gdids[0])
            target = {"area": p.area, "partition_start": str(p.partition_start), "shard_index": p.shard_index,
                      "shard_count": p.shard_count, "server": p.server}
    finally:
        store.close()
    if as_json:
        emit_json({"index": idx.name, "key": key, "normalized": normalized, "central_server": placement.server,
                   "gdids": [str(g) for g in gdids], "gdid": str(gdids[0]) if len(gdids) == 1 else None,
                   "briefcase": target})
    elif gdids:
        where = f" (area {target['area']}, server {target['server']})" if target else ""
        console.print(f"{idx.name} {normalized!r} -> {', '.join(map(str, gdids))}{where}", markup=False)
    else:
        console.print(f"{idx.name} {normalized!r} -> none (CENTRAL shard {placement.server})", markup=False)
    if not gdids:
        raise typer.Exit(1)


def _print_check(report: CheckReport, title: str) -> None:
    table = Table(title=title)
    table.add_column("problem")
    table.add_column("count", justify="right")
    for kind, count in report.counts().items():
        table.add_row(kind, str(count))
    console.print(table)
    for p in report.problems[:50]:
        console.print(f"  {p.kind}: {escape(p.index)} {escape(repr(p.key))} -> {p.gdid} ({p.state or '-'}): {escape(p.detail)}")
    if len(report.problems) > 50:
        console.print(f"  ... {len(report.problems) - 50} more (use --json)", markup=False)
    console.print(
        f"{report.entries} entries, {report.briefcases} briefcases, {len(report.problems)} problem{'' if len(report.problems) == 1 else 's'}, "
        f"{len(report.in_progress)} creations in progress",
        markup=False,
    )


@central_app.command("check")
def check_cmd(map_path: MapArg, models: ModelsOpt = None, index: IndexOpt = None, grace: GraceOpt = None,
              as_json: JsonOpt = False, parallel: ParallelOpt = DEFAULT_PARALLEL) -> None:
    """Count (and with --json list) dangling, stale, unfinished, missing and conflicting keys. Exit 1 if any."""
    store = _open(map_path, models)
    try:
        report = check(store.central, _indexes(store, index), grace=grace, parallel=parallel)
    finally:
        store.close()
    if as_json:
        emit_json(report.as_json())
    else:
        _print_check(report, "central check")
    if not report.ok:
        raise typer.Exit(1)


@central_app.command("repair")
def repair_cmd(map_path: MapArg, models: ModelsOpt = None, index: IndexOpt = None, grace: GraceOpt = None,
               as_json: JsonOpt = False) -> None:
    """Fix what check finds: finish or delete pending entries, delete stale ones, re-add missing keys."""
    store = _open(map_path, models)
    try:
        result = repair(store.central, _indexes(store, index), grace=grace)
    finally:
        store.close()
    after = result.after
    assert after is not None
    if as_json:
        emit_json({"before": result.before.as_json(), "fixed": dict(result.fixed),
                   "unresolved": [p.as_json() for p in result.unresolved], "after": after.as_json()})
    else:
        fixed = ", ".join(f"{k} {v}" for k, v in sorted(result.fixed.items())) or "nothing to fix"
        console.print(f"repaired: {fixed}", markup=False)
        _print_check(after, "central check after repair")
    if not after.ok:
        raise typer.Exit(1)
