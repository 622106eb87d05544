"""``mdb map check``, ``diff``, ``apply``, ``history`` and ``pull``: safe map edits (invariant 4).

``check MAP`` validates the file, refuses literal passwords by the rule ``apply`` records maps
by (:func:`mdb.maps.text.literal_secrets`), and, unless ``--offline``, asks the system whether
each server whose URL differs from the applied map's reaches the database CENTRAL recorded for
it (:mod:`mdb.maps.identity`); when CENTRAL does not answer it says the identities were not
checked, never "ok" for them.

``diff`` is offline by default: without a high-water mark nothing new can be shown to be safe,
so new partitions are refused until the mark comes from ``--high-water AREA=GDID`` or from the
live servers of OLD (``--live``). ``apply MAP NEW`` reaches the system through MAP (any map
version that names the CENTRAL servers; the old side of the diff is the newest map applied in
CENTRAL, or MAP itself when none was applied yet) and stamps NEW onto the shards. ``pull MAP``
writes the newest applied map's text, so the file can catch up with the system.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from sqlalchemy.exc import DBAPIError
from rich.table import Table

from mdb.cli.app import (
    CENTRAL_WAIT_SECONDS, EXIT_NOT_FOUND, EXIT_REFUSED, _within, console, emit_json, fail, map_app, open_map, open_store,
    read_map_file, warn,
)
from mdb.cli.options import JsonOpt, ModelsOpt
from mdb.backends import servers_where
from mdb.errors import GDIDError, MdbError
from mdb.gdid import GDID
from mdb.maps.apply import ApplyReport, apply_map, live_diff
from mdb.maps.diff import MapDiff, diff_maps
from mdb.maps.high_water import high_water_marks
from mdb.maps.history import applied_maps, newest_applied
from mdb.maps.identity import IdentityFinding, survey
from mdb.maps.text import literal_secrets, write_map_file
from mdb.migrations.scripts import scripts_root, stamp_new_servers
from mdb.partition_map import PartitionMap, read_map_text, safe_yaml_load
from mdb.router import Router
from mdb.store import Store

__all__ = ["map_apply"]

MarginOpt = Annotated[
    int, typer.Option("--margin", min=0, help="add this many counter values of headroom to each live high-water mark"),
]
ReshardOpt = Annotated[
    str | None,
    typer.Option("--allow-reshard", metavar="AREA=START", help="accept the shard-list change of exactly this partition (used by reshard)"),
]


def _area_gdid(text: str, option: str) -> tuple[str, GDID]:
    area, sep, value = text.partition("=")
    if not sep or not area.strip():
        fail(f"{option} expects AREA=GDID, got {text!r}")
    try:
        return area.strip(), GDID.parse(value)
    except GDIDError as exc:
        fail(f"{option} {text!r}: {exc}")


def _open_store(path: str, models: list[str] | None) -> Store:
    return open_store(path, models, tool=True)


def _high_water(texts: list[str] | None, old: PartitionMap) -> dict[str, GDID]:
    """``--high-water AREA=GDID`` options; an area OLD does not partition is a typo, refused."""
    marks = dict(_area_gdid(h, "--high-water") for h in texts or [])
    areas = [name for name, spec in old.areas.items() if spec.kind != "central"]
    for area in marks:
        if area not in areas:
            fail(f"--high-water {area}=...: map version {old.version} has no partitioned area {area!r} "
                 f"(it has: {', '.join(areas) or 'none'})")
    return marks


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _identities(pmap: PartitionMap, map_path: str) -> list[IdentityFinding]:
    """The identity findings of ``pmap``'s SQL servers whose URL differs from the applied map's
    (every SQL server when no map was applied yet); raises when CENTRAL does not answer."""
    reach = Store(pmap, types=[], map_path=map_path)
    old: Store | None = None
    try:
        applied = newest_applied(reach)
        names = servers_where(pmap, lambda b: b.has_identity)
        if applied is not None:
            old = Store(applied.parse(pmap), types=[])
            before = old.map.servers
            names = [n for n in names if n not in before or before[n].primary != pmap.servers[n].primary]
        return survey(reach, reach, names, old=old)
    finally:
        reach.close()
        if old is not None:
            old.close()


@map_app.command("check")
def map_check(
    map_path: Annotated[str, typer.Argument(metavar="MAP")],
    offline: Annotated[bool, typer.Option("--offline", help="check the file only; do not ask CENTRAL about server identities")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Validate a map file; refuse literal passwords and URLs that reach another database. Exit 2 if refused."""
    pmap = read_map_file(map_path)
    router = Router(pmap)
    partitions = sum(1 for a in router.area_names() for _ in router.partitions(a))
    problems = literal_secrets(safe_yaml_load(read_map_text(map_path), map_path))
    findings: list[IdentityFinding] = []
    not_checked: str | None = "--offline" if offline else None
    if not offline:
        try:
            findings = _within(CENTRAL_WAIT_SECONDS, lambda: _identities(pmap, map_path))
        except (MdbError, DBAPIError, TimeoutError) as exc:
            not_checked = f"CENTRAL did not answer: {exc}"
    problems += [f.problem for f in findings if f.verdict == "refused" and f.problem]
    unconfirmed = [f for f in findings if f.verdict in ("unreachable", "unconfirmed")]
    if as_json:
        emit_json({"map": map_path, "ok": not problems, "version": pmap.version, "servers": len(pmap.servers),
                   "areas": len(pmap.areas), "partitions": partitions, "problems": problems,
                   "identities": {"checked": not_checked is None, "not_checked": not_checked,
                                  "servers": [f.to_json() for f in findings]}})
    else:
        verdict = "ok" if not problems else "refused"
        console.print(f"{map_path}: {verdict}: version {pmap.version}, {_count(len(pmap.servers), 'server')}, "
                      f"{_count(len(pmap.areas), 'area')}, {_count(partitions, 'partition')}", markup=False)
        for line in problems:
            console.print(f"  refused: {line}", markup=False)
        if not_checked is not None:
            console.print(f"server identities not checked ({not_checked}): only the file was checked", markup=False)
        else:
            confirmed = sum(1 for f in findings if f.verdict == "ok")
            new = sum(1 for f in findings if f.verdict == "new")
            console.print(f"server identities: {confirmed} confirmed, {new} not recorded yet (recorded by the next apply), "
                          f"{len(unconfirmed)} not confirmed, of {_count(len(findings), 'server')} with a new or changed URL",
                          markup=False)
    for f in unconfirmed:
        warn(f.problem or f"server {f.server!r}: not confirmed")
    if problems:
        raise typer.Exit(EXIT_REFUSED)


def print_diff(diff: MapDiff) -> None:
    table = Table(title=f"map version {diff.old_version} -> {diff.new_version}")
    for column in ("verdict", "change", "subject", "old", "new", "reason"):
        table.add_column(column, overflow="fold")
    for c in diff.changes:
        verdict = "[green]accepted[/green]" if c.accepted else "[red]refused[/red]"
        table.add_row(verdict, escape(c.kind), escape(c.subject), escape(c.old or "-"), escape(c.new or "-"), escape(c.reason))
    console.print(table)
    marks = ", ".join(f"{a}={'unknown' if g is None else g}" for a, g in diff.high_water.items()) or "-"
    console.print(f"high-water marks: {marks}", markup=False)
    if diff.ok:
        console.print(f"all {len(diff.changes)} changes are safe", markup=False)
    else:
        console.print(f"{len(diff.refused)} of {len(diff.changes)} changes refused", markup=False)


@map_app.command("diff")
def map_diff(
    old_path: Annotated[str, typer.Argument(metavar="OLD", help="the map in use")],
    new_path: Annotated[str, typer.Argument(metavar="NEW", help="the proposed map")],
    high_water: Annotated[
        list[str] | None,
        typer.Option("--high-water", metavar="AREA=GDID", help="the area's high-water mark (repeatable; overrides --live)"),
    ] = None,
    live: Annotated[bool, typer.Option("--live", help="read the high-water marks from the servers of OLD")] = False,
    margin: MarginOpt = 0,
    allow_reshard: ReshardOpt = None,
    models: ModelsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List every change from OLD to NEW, accepted or refused with the reason; exit 2 if any is refused."""
    new = read_map_file(new_path)
    marks: dict[str, GDID] = {}
    relocated_to: set[str] = set()
    if live:
        store = _open_store(old_path, models)
        try:
            old = store.map
            marks.update(high_water_marks(store, margin=margin))
            relocated_to = {server for _, server in store.router.relocation_reach}
        finally:
            store.close()
    else:
        old = open_map(old_path)
    marks.update(_high_water(high_water, old))
    reshard = None if allow_reshard is None else _area_gdid(allow_reshard, "--allow-reshard")
    diff = diff_maps(old, new, marks, allow_reshard_of=reshard, relocated_to=relocated_to)
    if as_json:
        emit_json(diff.to_json())
    else:
        print_diff(diff)
    if not diff.ok:
        raise typer.Exit(EXIT_REFUSED)


def _print_apply(report: ApplyReport) -> None:
    table = Table(title=f"layout stamps (map version {report.new_version})")
    for column in ("server", "area", "action", "old", "new"):
        table.add_column(column)
    for s in report.stamps:
        table.add_row(escape(s.server), escape(s.area), escape(s.action), escape(s.old or "-"), escape(s.new or "-"))
    console.print(table)
    for server, created in report.prepared.items():
        console.print(f"prepared server {server}: {', '.join(created) or 'tables already there'}", markup=False)
    console.print(f"map version {report.new_version} applied and recorded on CENTRAL server {report.recorded_on}", markup=False)


@map_app.command("apply")
def map_apply(
    map_path: Annotated[str, typer.Argument(metavar="MAP", help="a map that reaches the system (its CENTRAL servers)")],
    new_path: Annotated[str, typer.Argument(metavar="NEW", help="the new map version to apply")],
    allow_reshard: ReshardOpt = None,
    margin: MarginOpt = 0,
    lock_timeout: Annotated[float, typer.Option("--lock-timeout", min=0.1, help="seconds to wait for a shard's in-flight sessions")] = 10.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="check against the live system, change nothing")] = False,
    models: ModelsOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Check NEW against the live system and stamp it onto every shard; the only way a map change is applied."""
    new = read_map_file(new_path)
    text = read_map_text(new_path)
    reshard = None if allow_reshard is None else _area_gdid(allow_reshard, "--allow-reshard")
    store = _open_store(map_path, models)
    try:
        check = live_diff(store, new, allow_reshard_of=reshard, margin=margin)
        if not check.ok:
            if as_json:
                emit_json(check.to_json())
            else:
                print_diff(check)
            raise typer.Exit(EXIT_REFUSED)
        if dry_run:
            dry = apply_map(store, new, yaml_text=text, allow_reshard_of=reshard, margin=margin, dry_run=True)
            if as_json:
                emit_json(dry.to_json())
            else:
                print_diff(dry.diff)
                console.print("dry run: nothing was changed", markup=False)
            return
        report = apply_map(store, new, yaml_text=text, allow_reshard_of=reshard, margin=margin, lock_timeout=lock_timeout)
        stamped: list[tuple[str, str, str]] = []
        if any(report.prepared.values()):  # servers new to the map, their tables built from the models
            store.refresh()  # route with the map just applied: it names the new servers
            stamped = stamp_new_servers(store, report.prepared, scripts_root(Path(map_path)))
    finally:
        store.close()
    if as_json:
        emit_json(report.to_json())
    else:
        print_diff(report.diff)
        _print_apply(report)
        for server, area, revision in stamped:
            console.print(f"{server}: area {area} recorded at migration revision {revision} (created from the models)", markup=False)


@map_app.command("history")
def map_history(map_path: Annotated[str, typer.Argument(metavar="MAP")], as_json: JsonOpt = False) -> None:
    """List the map versions applied in CENTRAL."""
    store = open_store(map_path, types=[])
    try:
        rows = applied_maps(store)
    finally:
        store.close()
    if as_json:
        emit_json([{"version": v, "applied_at": None if t is None else t.isoformat()} for v, t in rows])
        return
    if not rows:
        console.print("no map has been applied with `mdb map apply` yet", markup=False)
        return
    table = Table(title="applied maps")
    table.add_column("version")
    table.add_column("applied at")
    for v, t in rows:
        table.add_row(str(v), "-" if t is None else t.isoformat())
    console.print(table)


@map_app.command("pull")
def map_pull(
    map_path: Annotated[str, typer.Argument(metavar="MAP", help="a map that reaches the system (its CENTRAL servers)")],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", metavar="FILE", help="write the map here (MAP itself to update it); default: stdout")
    ] = None,
) -> None:
    """Print (or write to FILE) the newest applied map, as written (${NAME} not expanded). Exit 1 if none was applied."""
    store = open_store(map_path, types=[])
    try:
        applied = newest_applied(store)
    finally:
        store.close()
    if applied is None:
        console.print(f"no map has been applied with `mdb map apply` yet: {map_path} is the system's map", markup=False)
        raise typer.Exit(EXIT_NOT_FOUND)
    if output is None:
        sys.stdout.write(applied.yaml if applied.yaml.endswith("\n") else applied.yaml + "\n")
        return
    write_map_file(output, applied.yaml)
    console.print(f"wrote map version {applied.version} (applied {applied.applied_at or '-'}) to {output}", markup=False)
