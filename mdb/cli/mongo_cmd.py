"""``mdb demo-documents``: the document-area demo on MongoDB (a real server, or the in-process fake)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from mdb.cli.app import app, console
from mdb.urls import mask_url

__all__ = []


@app.command("demo-documents")
def demo_documents(
    folder: Annotated[Path, typer.Option("--dir", help="working folder for map.yaml and the SQLite CENTRAL file")] = Path("mdb-demo-docs"),
    mongo_uri: Annotated[
        str | None,
        typer.Option("--mongo-uri", help="MongoDB server for the three shard databases (default: $MDB_MONGO_URI, else the in-process fake)"),
    ] = None,
    customers: Annotated[int, typer.Option("--customers", min=1, max=10_000, help="how many customers to create")] = 30,
) -> None:
    """A document area end to end: schema, briefcases, hot counters, fan-out, a verified move."""
    from mdb.mongo.demo import run_document_demo

    uri = mongo_uri or os.environ.get("MDB_MONGO_URI") or None
    report = run_document_demo(folder, uri, customers)
    console.print(f"backend: {report.backend}", markup=False)
    if uri:
        console.print(f"server: {mask_url(uri)}", markup=False)
    console.print(f"map: {report.map_path}", markup=False)
    schema = Table("server", "roles", "schema apply", title="mdb schema apply")
    for row in report.schema:
        schema.add_row(*row)
    console.print(schema)
    shards = Table("shard", "customers", "orders", "events", title=f"{report.customers} customers, {report.orders} orders")
    for name, counts in report.per_shard.items():
        shards.add_row(name, str(counts["customers"]), str(counts["orders"]), str(counts["events"]))
    console.print(shards)
    console.print(
        f"payment events: {report.deliveries} deliveries, {report.applied} applied once each by the stats lock",
        markup=False,
    )
    top = Table("order", "customer", "total", title="fan-out: top 5 paid orders over all shards")
    for doc in report.top_orders:
        top.add_row(str(doc["_id"]), str(doc["customer_id"]), str(doc["total"]))
    console.print(top)
    moved = Table("collection", "documents", "sha256", title=f"moved {report.moved} {report.move_from} -> {report.move_to}, verified")
    for coll, (count, digest) in report.verified.items():
        moved.add_row(coll, str(count), digest[:16])
    console.print(moved)
    console.print(
        f"a Store with the old routing read it on {report.stale_read_server} (fence, refresh, retry); "
        f"its counter: {report.spent_after_move}",
        markup=False,
    )
