"""The document-area demo: a ``docs`` area on MongoDB shards, end to end, in one process.

CENTRAL (GDID sequences, the move journal, the relocation directory) is a SQLite file in the
demo folder; the ``docs`` area has three MongoDB shards: databases on the server named by
``--mongo-uri`` / ``MDB_MONGO_URI``, or, when none is given, in-process fake servers
(mongomock-ng), which the output says. Steps: schema apply, users with orders and events,
counters and the stats lock fed by duplicated events, a fan-out query, a move with
verification, a read through a Store that still holds the old routing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from mdb.errors import MapError
from mdb.gdid import GDID
from mdb.testing.mongo import FakeMongo
from mdb.mongo.hot import MongoCounter, MongoStatsLock
from mdb.moves.document_move import checksums, move_documents
from mdb.mongo.store import MongoStore
from mdb.mongo.types import DocumentBriefcaseType, MongoIndex
from mdb.urls import mask_url

__all__ = ["CustomerDocs", "DocumentDemoReport", "run_document_demo"]

SHARDS = ("docs-1", "docs-2", "docs-3")


class CustomerDocs(DocumentBriefcaseType):
    """A customer with their orders and activity events, all carrying ``customer_id``."""

    area = "docs"
    key = "customer_id"
    root = "customers"
    children = ("orders", "events")
    indexes = (
        MongoIndex("customers", [("customer_id", 1), ("email", 1)], unique=True),
        MongoIndex("orders", [("customer_id", 1), ("number", 1)], unique=True),
        MongoIndex("orders", [("total", -1)]),
    )


SPENT = MongoCounter("spent", slots=4)
PAYMENTS = MongoStatsLock()


@dataclass
class DocumentDemoReport:
    backend: str
    map_path: Path
    schema: list[tuple[str, str, str]] = field(default_factory=list)
    customers: int = 0
    orders: int = 0
    deliveries: int = 0
    applied: int = 0
    per_shard: dict[str, dict[str, int]] = field(default_factory=dict)
    top_orders: list[dict[str, Any]] = field(default_factory=list)
    moved: GDID | None = None
    move_from: str = ""
    move_to: str = ""
    verified: dict[str, tuple[int, str]] = field(default_factory=dict)
    stale_read_server: str = ""
    spent_after_move: dict[str, int] = field(default_factory=dict)


def _shard_url(base: str, name: str) -> str:
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, f"/mdb_demo_{name.replace('-', '_')}", parts.query, ""))


def write_document_map(folder: Path, mongo_uri: str | None) -> Path:
    """The demo map: SQLite CENTRAL in ``folder`` plus three MongoDB shards (URLs may carry ``${NAME}``)."""
    folder.mkdir(parents=True, exist_ok=True)
    servers: dict[str, Any] = {"central": {"primary": f"sqlite:///{(folder / 'central.db').resolve()}"}}
    for name in SHARDS:
        servers[name] = {"primary": _shard_url(mongo_uri, name) if mongo_uri else f"mongodb://fake-{name}/{name.replace('-', '_')}"}
    data = {
        "version": 1,
        "models": ["mdb.mongo.demo"],
        "servers": servers,
        "areas": {"central": {"kind": "central", "shards": ["central"]}, "docs": {"partitions": [{"start": "0:0:0", "shards": list(SHARDS)}]}},
    }
    path = folder / "map.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def run_document_demo(folder: Path, mongo_uri: str | None, customers: int = 30, seed: int = 7) -> DocumentDemoReport:
    from mdb.schema import apply_schema
    from mdb.store import Store

    if mongo_uri:
        host = urlsplit(mongo_uri).hostname
        if host is None:  # e.g. "mongodb:///db": say so before writing a map nothing can reach
            raise MapError(f"MongoDB URI {mask_url(mongo_uri)} names no host")
        backend = "MongoDB at " + host
    else:
        backend = "in-process fake MongoDB (mongomock-ng): no MongoDB URI configured"
    rnd = random.Random(seed)
    map_path = write_document_map(folder, mongo_uri)
    fake = None if mongo_uri else FakeMongo()
    report = DocumentDemoReport(backend, map_path)

    def open_store() -> Store:
        store = Store.from_yaml(map_path, types=[])
        MongoStore.attach(store, client_factory=fake, types=[CustomerDocs])
        return store

    store = open_store()
    stale = open_store()
    try:
        for r in apply_schema(store):
            report.schema.append((r.server, ", ".join(r.roles), r.error or "; ".join(r.problems) or f"created {len(r.created)}"))
        stale.router  # noqa: B018  (loads its routing now: it goes stale when the move below happens)
        ids = store.gdids("docs", "customer")
        order_ids = store.gdids("docs", "order")
        made: list[GDID] = []
        paying: list[GDID] = []
        for n in range(customers):
            cid = ids.next()
            with store.documents(CustomerDocs, cid) as bc:
                bc.root.insert_one({"email": f"customer{n}@example.com", "name": f"Customer {n}"})
                orders: list[dict[str, Any]] = [
                    {"_id": order_ids.next(), "number": i, "total": rnd.randint(5, 500), "status": rnd.choice(["open", "paid"])}
                    for i in range(rnd.randint(1, 5))
                ]
                bc["orders"].insert_many(orders)
                bc["events"].insert_one({"_id": {"customer_id": cid, "seq": 1}, "kind": "signup"})
            made.append(cid)
            report.orders += len(orders)
            # payments arrive at least once: every paid order's event is delivered twice
            for order in orders:
                if order["status"] != "paid":
                    continue
                for _ in range(2):
                    report.deliveries += 1
                    with store.documents(CustomerDocs, cid) as bc:
                        if PAYMENTS.apply(bc, f"pay-{order['_id'].hex}", "settled", "spent",
                                          partial(SPENT.add, amount=order["total"], payments=1)):
                            report.applied += 1
                            if cid not in paying:
                                paying.append(cid)
        report.customers = len(made)
        for name in SHARDS:
            db = store.mongo.database(name)
            report.per_shard[name] = {c: db[c].count_documents({}) for c in CustomerDocs.collections}
        report.top_orders = store.mongo.fan_out("docs", "orders", {"status": "paid"}, sort=[("total", -1)], limit=5).documents
        victim = (paying or made)[0]
        report.moved = victim
        report.move_from = store.router.locate("docs", victim).server
        report.move_to = next(s for s in SHARDS if s != report.move_from)
        move_documents(store, CustomerDocs, victim, report.move_to)
        report.verified = checksums(store.mongo.database(report.move_to), CustomerDocs, victim)
        with stale.documents(CustomerDocs, victim, readonly=True) as bc:  # routed by the old directory: fenced, refreshed
            report.stale_read_server = bc.placement.server
            report.spent_after_move = SPENT.read(bc)
        return report
    finally:
        store.close()
        stale.close()
