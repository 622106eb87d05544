"""``mdb gdid next MAP SCOPE SEQUENCE``: reserve GDIDs from a CENTRAL sequence for operators and scripts.

The command reserves exactly ``--count`` counters in one block, so nothing is wasted beyond what
it prints (except at an era roll-over, where the block is cut short and a second one is taken),
and prints them one per line (or as JSON). Ids printed are consumed: never printed again.
"""

from __future__ import annotations

from typing import Annotated

import typer

from mdb.cli.app import emit_json, fail, open_store
from mdb.cli.inspect import gdid_app
from mdb.idgen import AUTHORITY_ENV, GdidGenerator, sequence_key
from mdb.router import Router

__all__ = []

MAX_COUNT = 1_000_000


@gdid_app.command("next")
def gdid_next(
    map_path: Annotated[str, typer.Argument(metavar="MAP")],
    scope: Annotated[str, typer.Argument(help="the sequence's scope, e.g. an area name")],
    sequence: Annotated[str, typer.Argument(help="the sequence name within the scope")],
    count: Annotated[int, typer.Option("--count", "-n", help=f"how many GDIDs to reserve (1..{MAX_COUNT})")] = 1,
    authority: Annotated[
        int | None, typer.Option("--authority", help=f"authority nibble 0..15 (default: ${AUTHORITY_ENV} or 0)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Reserve COUNT new GDIDs from a sequence and print them, one per line."""
    if not 1 <= count <= MAX_COUNT:
        fail(f"--count must be in 1..{MAX_COUNT}, got {count}")
    key = sequence_key(scope, sequence)
    store = open_store(map_path, types=[])
    server = Router(store.map).locate_central(key).server
    try:
        gen = GdidGenerator.for_store(
            store, scope, sequence, authority=authority, block_size=count, max_block_size=count, prefetch=False
        )
        ids = gen.take(count)
    finally:
        store.close()
    if as_json:
        emit_json(
            {
                "scope": scope,
                "sequence": sequence,
                "central_key": key,
                "server": server,
                "authority": gen.authority,
                "count": len(ids),
                "gdids": [str(g) for g in ids],
                "hex": [g.hex for g in ids],
            }
        )
        return
    typer.echo("\n".join(str(g) for g in ids))
