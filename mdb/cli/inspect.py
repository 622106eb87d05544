"""Read-only commands: show a GDID, explain a route, check and show a map."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from mdb.cli.app import app, console, emit_json, map_app, open_map, DefaultCommandGroup
from mdb.gdid import GDID
from mdb.router import Router

gdid_app = typer.Typer(
    cls=DefaultCommandGroup,
    help="Show the forms of a GDID (mdb gdid VALUE), or reserve new ones (mdb gdid next).",
    no_args_is_help=True,
)
app.add_typer(gdid_app, name="gdid")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


@gdid_app.command("show")
def gdid_show(value: Annotated[str, typer.Argument(help="GDID as era:authority:counter or 24 hex digits")], as_json: JsonFlag = False) -> None:
    """Show every form of a GDID."""
    g = GDID.parse(value)
    data = {"text": str(g), "hex": g.hex, "era": g.era, "authority": g.authority, "counter": g.counter,
            "raw_id": g.raw_id, "sharding_value": g.sharding_value}
    if as_json:
        emit_json(data)
        return
    table = Table(show_header=False, box=None)
    for k, v in data.items():
        table.add_row(k, str(v))
    console.print(table)


@app.command("route")
def route(
    map_path: Annotated[str, typer.Argument(metavar="MAP")],
    area: str,
    gdid: str,
    as_json: JsonFlag = False,
) -> None:
    """Explain where the map places a GDID of an area (range set, partition, shard, server)."""
    pmap = open_map(map_path)
    router = Router(pmap)
    p = router.locate(area, GDID.parse(gdid))
    spec = pmap.servers[p.server]
    data = {
        "area": p.area, "gdid": str(p.gdid), "sharding_value": p.gdid.sharding_value,
        "range_set": str(p.range_set), "partition_start": str(p.partition_start),
        "partition_end": None if p.partition_end is None else str(p.partition_end),
        "shard_index": p.shard_index, "shard_count": p.shard_count, "server": p.server,
        "url": spec.masked_primary, "replica_url": spec.masked_replica, "map_version": pmap.version,
    }
    if as_json:
        emit_json(data)
        return
    table = Table(show_header=False, box=None)
    for k, v in data.items():
        table.add_row(k, "-" if v is None else str(v))
    console.print(table)


@app.command("central-shard")
def central_shard(
    map_path: Annotated[str, typer.Argument(metavar="MAP")],
    key: Annotated[str, typer.Argument(help="the key exactly as stored (already normalized)")],
    as_json: JsonFlag = False,
) -> None:
    """Show which CENTRAL shard a key hashes to (FNV-1a-64 of its UTF-8 bytes)."""
    pmap = open_map(map_path)
    c = Router(pmap).locate_central(key)
    data = {"area": c.area, "key": key, "fnv1a_64": c.hash, "shard_index": c.shard_index,
            "shard_count": c.shard_count, "server": c.server, "url": pmap.servers[c.server].masked_primary}
    if as_json:
        emit_json(data)
        return
    table = Table(show_header=False, box=None)
    for k, v in data.items():
        table.add_row(k, str(v))
    console.print(table)


@map_app.command("check")
def map_check(map_path: Annotated[str, typer.Argument(metavar="MAP")]) -> None:
    """Validate a map; prints a one-line summary or the problem with file and line."""
    pmap = open_map(map_path)
    router = Router(pmap)
    partitions = sum(1 for a in router.area_names() for _ in router.partitions(a))
    console.print(f"{map_path}: ok: version {pmap.version}, {len(pmap.servers)} servers, "
                  f"{len(pmap.areas)} areas, {partitions} partitions")


@map_app.command("show")
def map_show(map_path: Annotated[str, typer.Argument(metavar="MAP")]) -> None:
    """Show a map as tables: servers (masked URLs) and every partition's shards."""
    pmap = open_map(map_path)
    router = Router(pmap)
    servers = Table(title=f"servers (map version {pmap.version})")
    servers.add_column("server")
    servers.add_column("primary")
    servers.add_column("replica")
    for name, spec in pmap.servers.items():
        servers.add_row(name, spec.masked_primary, spec.masked_replica or "-")
    console.print(servers)
    areas = Table(title="areas")
    for col in ("area", "range set", "partition start", "shards"):
        areas.add_column(col)
    areas.add_row(pmap.central_area, "-", "(central, FNV-1a-64)", ", ".join(router.central_servers()))
    for area in router.area_names():
        for rs in pmap.areas[area].effective_range_sets():
            base = rs.breakpoint.sharding_value
            for part in rs.partitions:
                start = GDID.from_sharding_value(base + part.start.sharding_value)
                areas.add_row(area, str(rs.breakpoint), str(start), ", ".join(part.shards))
    console.print(areas)
