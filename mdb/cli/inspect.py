"""Read-only commands: show a GDID, explain a route, check and show a map.

``route``, ``central-shard`` and ``map show`` need no database, but they answer for the map the
system runs (:func:`mdb.cli.app.open_map`): the newest applied map when CENTRAL answers, the
file with a note when it does not. ``map check`` (in :mod:`mdb.cli.map_edit_cmd`) checks the
file itself, and the servers it names against their identities.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from mdb.cli.app import DefaultCommandGroup, app, console, emit_json, map_app, open_map
from mdb.cli.options import JsonOpt
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap
from mdb.router import Router
from mdb.urls import mask_url

gdid_app = typer.Typer(
    cls=DefaultCommandGroup,
    help="Show the forms of a GDID (mdb gdid VALUE), or reserve new ones (mdb gdid next).",
    no_args_is_help=True,
)
app.add_typer(gdid_app, name="gdid")



@gdid_app.command("show")
def gdid_show(value: Annotated[str, typer.Argument(help="GDID as era:authority:counter or 24 hex digits")], as_json: JsonOpt = False) -> None:
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
    as_json: JsonOpt = False,
) -> None:
    """Explain where the map the system runs places a GDID of an area (range set, partition, shard, server)."""
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
        table.add_row(k, "-" if v is None else escape(str(v)))
    console.print(table)


@app.command("central-shard")
def central_shard(
    map_path: Annotated[str, typer.Argument(metavar="MAP")],
    key: Annotated[str, typer.Argument(help="the key exactly as stored (already normalized)")],
    as_json: JsonOpt = False,
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
        table.add_row(k, escape(str(v)))
    console.print(table)


def _partition_rows(pmap: PartitionMap) -> list[dict[str, Any]]:
    rows = []
    for area in Router(pmap).area_names():
        for rs in pmap.areas[area].effective_range_sets():
            for part, start_v in zip(rs.partitions, rs.absolute_starts(), strict=True):
                start = GDID.from_sharding_value(start_v)
                rows.append({"area": area, "range_set": str(rs.breakpoint), "start": str(start), "shards": list(part.shards)})
    return rows


@map_app.command("show")
def map_show(map_path: Annotated[str, typer.Argument(metavar="MAP")], as_json: JsonOpt = False) -> None:
    """Show the map the system runs: servers (masked URLs, pooler and direct URL where set) and every partition's shards."""
    pmap = open_map(map_path)
    router = Router(pmap)
    if as_json:
        emit_json({
            "version": pmap.version,
            "servers": {name: {"primary": spec.masked_primary, "replica": spec.masked_replica, "pooler": spec.pooler,
                               "direct": None if spec.direct is None else mask_url(spec.direct)}
                        for name, spec in pmap.servers.items()},
            "central": {"area": pmap.central_area, "shards": list(router.central_servers())},
            "partitions": _partition_rows(pmap),
        })
        return
    servers = Table(title=f"servers (map version {pmap.version})")
    servers.add_column("server")
    servers.add_column("primary")
    servers.add_column("replica")
    pooled = any(spec.pooler != "none" or spec.direct is not None for spec in pmap.servers.values())
    if pooled:  # a map without a pooler keeps its narrow table
        servers.add_column("pooler")
        servers.add_column("direct")
    for name, spec in pmap.servers.items():
        cells = [escape(name), escape(spec.masked_primary), escape(spec.masked_replica or "-")]
        if pooled:
            cells += [escape(spec.pooler), escape("-" if spec.direct is None else mask_url(spec.direct))]
        servers.add_row(*cells)
    console.print(servers)
    areas = Table(title="areas")
    for col in ("area", "range set", "partition start", "shards"):
        areas.add_column(col)
    areas.add_row(pmap.central_area, "-", "(central, FNV-1a-64)", ", ".join(router.central_servers()))
    for row in _partition_rows(pmap):
        areas.add_row(row["area"], row["range_set"], row["start"], ", ".join(row["shards"]))
    console.print(areas)
