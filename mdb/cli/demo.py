"""``mdb demo``: the main job on the embedded default (SQLite files), or on any map with --map."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from mdb.cli.app import app, console, open_store
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap
from mdb.router import Router

if TYPE_CHECKING:  # mdb.demo is imported when the command runs: its models register briefcase types
    from mdb.demo.runner import DemoReport

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
    # late: importing mdb.demo registers its briefcase types, which no other command may see
    from mdb.demo.runner import run_demo, write_demo_map

    if map_file is None:
        map_path, created = write_demo_map(folder)
        console.print(f"{'created' if created else 'continuing in'} {folder}/ ({map_path.name})", markup=False)
    else:
        map_path = map_file
    store = open_store(str(map_path), ["mdb.demo.models", "mdb.demo.repositories"])
    try:
        report = run_demo(store, users, progress=lambda n: console.print(f"  registered {n} users ...", markup=False))
        print_report(console, report, store.map, map_path)
    finally:
        store.close()


def print_report(console: Console, report: DemoReport, pmap: PartitionMap, map_path: Path | None) -> None:
    """What the demo did, as tables: here in the CLI, so the demo library never prints."""
    from mdb.demo.repositories import EmailIndex  # late, as in demo()

    if map_path is not None:
        console.print(f"map: {map_path} (version {report.map_version})", markup=False)
    console.print(
        f"registered {len(report.registered)} new users (numbers from {report.first_number}), "
        f"skipped {len(report.skipped)} already-taken emails",
        markup=False,
    )
    table = Table(title="user area: briefcases and rows per shard")
    for col in ("partition start", "shard", "server", "briefcases", "rows"):
        table.add_column(col, justify="right" if col in ("briefcases", "rows") else "left")
    for s in report.shards:
        table.add_row(str(s.partition_start), f"{s.shard_index} of {s.shard_count}", s.server,
                      str(s.briefcases), str(s.rows))
    table.add_row("", "", "total", str(sum(s.briefcases for s in report.shards)), str(sum(s.rows for s in report.shards)))
    console.print(table)
    holding = sorted({str(s.partition_start) for s in report.shards if s.briefcases})
    console.print(f"partitions holding users: {', '.join(holding) or 'none'}", markup=False)

    reads = Table(title="routed reads explained (GDID -> partition -> shard -> server)")
    for col in ("user GDID", "v", "partition (start <= v)", "shard (v mod n)", "server", "orders", "balance"):
        reads.add_column(col)
    for r in report.reads:
        gdid = r["gdid"]
        assert isinstance(gdid, GDID)
        reads.add_row(str(gdid), str(gdid.sharding_value), str(r["partition_start"]), str(r["shard"]),
                      str(r["server"]), str(r["orders"]), f"{int(str(r['balance_cents'])) / 100:.2f}")
    console.print(reads)

    lookups = Table(title=f"CENTRAL lookups by email (index {EmailIndex.name}, normalize=strip_casefold)")
    for col in ("email asked", "normalized key", "CENTRAL shard", "user GDID", "ms"):
        lookups.add_column(col, no_wrap=True, overflow="ellipsis")
    router = Router(pmap)
    for email, gdid, seconds in report.lookups:
        key = EmailIndex.key_of(email)
        lookups.add_row(f'"{email}"', key, router.locate_central(key).server, str(gdid) if gdid else "(none)",
                        f"{seconds * 1000:.2f}")
    console.print(lookups)
    c = report.cache
    if c is not None:
        console.print(
            f"cache: {c.hits} hits ({c.negative_hits} negative), {c.misses} misses, {c.stale} stale, "
            f"{c.size} entries (max {c.max_entries}, ttl {c.ttl:g}s)",
            markup=False,
        )
    console.print(f"ledger snapshot pass: {report.ledger_events_folded} events folded (balances = snapshot + tail)", markup=False)
    rate = len(report.registered) / report.seconds_register if report.seconds_register else 0.0
    console.print(
        f"time: {report.seconds_total:.2f}s total (schema {report.seconds_schema:.2f}s, "
        f"registration with data {report.seconds_register:.2f}s = {rate:.0f} users/s)",
        markup=False,
    )

