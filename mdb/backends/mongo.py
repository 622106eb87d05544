"""The MongoDB backend: servers whose URL scheme is ``mongodb`` or ``mongodb+srv``.

mdb's own records are collections with the same field names as the SQL tables, GDIDs stored
as their 12 bytes: the layout stamp (``mdb_shard_layout``, one document per area) and, on
CENTRAL servers, the relocation directory (``mdb_relocations``, ``_id`` = ``area:gdid-hex``).
Databases come from the cluster's document clients (:class:`~mdb.backends.base.DocumentServers`);
pymongo itself is never imported here, so the registry can load this module without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Final

from mdb.backends.base import Backend, SchemaOutcome, Servers, ServerSchema, documents_of
from mdb.errors import MapEditError, MdbError
from mdb.gdid import GDID
from mdb.router import ShardLayout
from mdb.system_tables import STATE_FROZEN, STATE_RESIDENT
from mdb.urls import MONGO

__all__ = ["LAYOUT", "RELOCATIONS", "STATE", "MongoBackend", "freeze_id", "stamp_layout"]

LAYOUT: Final = "mdb_shard_layout"
RELOCATIONS: Final = "mdb_relocations"
STATE: Final = "mdb_briefcase_state"
"""Briefcase states (fences, incoming copies, residents) and partition freeze markers (:func:`freeze_id`)."""


def freeze_id(area: str, start: GDID) -> str:
    """``_id`` of the freeze marker of partition ``start`` of ``area`` in :data:`STATE`.

    Its own key, never a briefcase's (``area:gdid-hex``): write contexts of the partition read
    it in their ownership check (:func:`mdb.mongo.shard_state.ownership_rows`).
    """
    return f"{area}:frozen:{start.hex}"


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

    # -- resharding

    def freeze_partition(
        self, cluster: Servers, server: str, area: str, start: GDID, reshard_id: str, *, lock_wait: float
    ) -> None:
        # MongoDB has no lock that a write context holds and the freeze could wait on: the
        # marker is one document write. A transactional write context reads it in its own
        # transaction (on the fake a transaction holds the server, so the write waits for it);
        # see docs/mongodb.md for the window a real replica set leaves.
        documents_of(cluster).database(server)[STATE].replace_one(
            {"_id": freeze_id(area, start)},
            {"area": area, "state": STATE_FROZEN, "peer": str(start), "move_id": reshard_id},
            upsert=True,
        )

    def unfreeze_partition(self, cluster: Servers, server: str, area: str, start: GDID) -> int:
        found = documents_of(cluster).database(server)[STATE].delete_one({"_id": freeze_id(area, start), "state": STATE_FROZEN})
        return int(found.deleted_count)

    def frozen_by(self, cluster: Servers, server: str, area: str, start: GDID) -> str | None:
        marker = documents_of(cluster).database(server)[STATE].find_one({"_id": freeze_id(area, start), "state": STATE_FROZEN})
        return None if marker is None else str(marker["move_id"])

    def drop_residents(self, cluster: Servers, server: str, area: str, redundant: Callable[[GDID], bool]) -> int:
        states = documents_of(cluster).database(server)[STATE]
        dropped = 0
        for doc in list(states.find({"area": area, "state": STATE_RESIDENT})):
            if redundant(GDID.from_bytes(doc["gdid"])):
                dropped += int(states.delete_one({"_id": doc["_id"], "state": STATE_RESIDENT}).deleted_count)
        return dropped

    def read_layouts(self, cluster: Servers, server: str) -> dict[str, ShardLayout]:
        return {
            doc["_id"]: ShardLayout(
                doc["_id"], GDID.from_bytes(doc["partition_start"]),
                None if doc.get("partition_end") is None else GDID.from_bytes(doc["partition_end"]),
                int(doc["shard_index"]), int(doc["shard_count"]),
            )
            for doc in documents_of(cluster).database(server)[LAYOUT].find({})
        }

    def replace_layout(
        self, cluster: Servers, server: str, area: str, layout: ShardLayout | None, map_version: int, *, lock_timeout: float
    ) -> None:
        # No table lock exists to wait for in-flight contexts; a write context that read the old
        # stamp in its transaction may still commit. A reshard changes stamps of a frozen
        # partition only, so no write context of it is in flight (docs/mongodb.md).
        db = documents_of(cluster).database(server)
        if layout is None:
            db[LAYOUT].delete_one({"_id": area})
            return
        problem = stamp_layout(db, layout, map_version, replace=True)
        if problem:  # replace=True never refuses; a problem here is a bug, not an operator error
            raise MapEditError(f"server {server!r}: {problem}")
