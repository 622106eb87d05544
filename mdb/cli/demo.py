"""``mdb demo``: the main job on the embedded default (SQLite files), or on any map with --map."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mdb.briefcase import registered_types
from mdb.cli.app import app, console, open_map
from mdb.cli.schema_cmd import import_models

__all__ = ["demo"]


@app.command("demo")
def demo(
    folder: Annotated[Path, typer.Option("--dir", help="working folder for the SQLite files and map.yaml")] = Path("mdb-demo"),
    users: Annotated[int, typer.Option("--users", min=0, help="how many new users to register")] = 300,
    map_file: Annotated[
        Path | None, typer.Option("--map", help="run against this map instead (PostgreSQL included); --dir is not used")
    ] = None,
) -> None:
    """Create (or continue) a demo: schema, users with orders and transactions, then what happened."""
    from mdb.demo.runner import print_report, run_demo, write_demo_map
    from mdb.store import Store

    if map_file is None:
        map_path, created = write_demo_map(folder)
        console.print(f"{'created' if created else 'continuing in'} {folder}/ ({map_path.name})", markup=False)
    else:
        map_path = map_file
    pmap = open_map(str(map_path))
    import_models([*pmap.models, "mdb.demo.models", "mdb.demo.repositories"])
    store = Store(pmap, types=registered_types(), map_path=map_path)
    try:
        report = run_demo(store, users, progress=console)
        print_report(console, report, store.map, map_path)
    finally:
        store.close()
