"""The MongoDB backend: servers whose URL scheme is ``mongodb`` or ``mongodb+srv``.

mdb's own records are collections with the same field names as the SQL tables, GDIDs stored
as their 12 bytes: the layout stamp (``mdb_shard_layout``, one document per area) and, on
CENTRAL servers, the relocation directory (``mdb_relocations``, ``_id`` = ``area:gdid-hex``).
Databases come from the cluster's document clients (:class:`~mdb.backends.base.DocumentServers`);
pymongo itself is never imported here, so the registry can load this module without it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from mdb.backends.base import Backend, SchemaOutcome, Servers, ServerSchema, documents_of
from mdb.errors import MdbError
from mdb.gdid import GDID
from mdb.router import ShardLayout
from mdb.urls import MONGO

__all__ = ["LAYOUT", "RELOCATIONS", "MongoBackend", "stamp_layout"]

LAYOUT: Final = "mdb_shard_layout"
RELOCATIONS: Final = "mdb_relocations"


def stamp_layout(db: Any, layout: ShardLayout, map_version: int, *, replace: bool) -> str | None:
    """Write the layout stamp of ``layout.area`` in ``db``; returns a problem text if refused (as the SQL one)."""
    wanted = {
        "partition_start": bytes(layout.partition_start),
        "partition_end": None if layout.partition_end is None else bytes(layout.partition_end),
        "shard_index": layout.shard_index,
        "shard_count": layout.shard_count,
    }
    row = db[LAYOUT].find_one({"_id": layout.area})
    if row is None:
        db[LAYOUT].insert_one({"_id": layout.area, **wanted, "map_version": map_version})
        return None
    if {k: row.get(k) for k in wanted} == wanted:
        return None
    if not replace:
        return (
            f"area {layout.area!r} is stamped differently (map version {row.get('map_version')}) than this map says "
            f"(shard {layout.shard_index} of {layout.shard_count}): a layout change is applied with `mdb map apply`"
        )
    db[LAYOUT].update_one({"_id": layout.area}, {"$set": {**wanted, "map_version": map_version}})
    return None


class MongoBackend(Backend):
    """Servers reached through pymongo; each call is one operation on the server's mdb database."""

    kind: ClassVar[str] = MONGO

    def stamp_layout(
        self, cluster: Servers, server: str, layout: ShardLayout, map_version: int, *, replace: bool
    ) -> str | None:
        return stamp_layout(documents_of(cluster).database(server), layout, map_version, replace=replace)

    def load_relocations(self, cluster: Servers, server: str) -> dict[tuple[str, GDID], str]:
        docs = documents_of(cluster).database(server)[RELOCATIONS].find({})
        return {(doc["area"], GDID.from_bytes(doc["gdid"])): doc["server"] for doc in docs}

    def set_relocation(self, cluster: Servers, server: str, area: str, gdid: GDID, target: str | None) -> None:
        directory = documents_of(cluster).database(server)[RELOCATIONS]
        key = {"_id": f"{area}:{gdid.hex}"}
        if target is None:
            directory.delete_one(key)
        else:
            directory.replace_one(key, {"area": area, "gdid": bytes(gdid), "server": target}, upsert=True)

    def apply_schema(self, cluster: Servers, server: str, schema: ServerSchema) -> SchemaOutcome:
        outcome = SchemaOutcome()
        db = documents_of(cluster).database(server)
        existing = set(db.list_collection_names())
        for spec in schema.collections:  # creating an index that exists is a no-op
            if spec.name not in existing:
                db.create_collection(spec.name)
                existing.add(spec.name)
                outcome.created.append(spec.name)
            for index in spec.indexes:
                db[spec.name].create_index(list(index.keys), name=index.name, unique=index.unique, **dict(index.options))
        already = {d["_id"] for d in db[LAYOUT].find({}, {"_id": 1})}
        for layout in schema.layouts:
            outcome.record_stamp(layout.area, stamp_layout(db, layout, schema.map_version, replace=False), already)
        return outcome

    def translate(self, cluster: Servers, server: str, exc: Exception) -> MdbError | None:
        return documents_of(cluster).translate(server, exc)
