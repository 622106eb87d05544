"""The MongoDB backend: servers whose URL scheme is ``mongodb`` or ``mongodb+srv``.

mdb's own records are collections with the same field names as the SQL tables, GDIDs stored
as their 12 bytes: the layout stamp (``mdb_shard_layout``, one document per area) and, on
CENTRAL servers, the relocation directory (``mdb_relocations``, ``_id`` = ``area:gdid-hex``).
Databases come from the cluster's document clients (:class:`~mdb.backends.base.DocumentServers`);
pymongo itself is never imported here, so the registry can load this module without it.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Final

from mdb.backends.base import (
    AreaData,
    AreaScan,
    Backend,
    BriefcaseSize,
    BriefcaseStateRow,
    Holding,
    SchemaOutcome,
    Servers,
    ServerSchema,
    documents_of,
)
from mdb.errors import MapEditError, MdbError
from mdb.gdid import GDID
from mdb.ownership import APPLYING_PREFIX
from mdb.router import Reach, ShardLayout
from mdb.system_tables import STATE_FROZEN, STATE_RESIDENT, briefcase_state
from mdb.urls import MONGO

__all__ = ["LAYOUT", "RELOCATIONS", "STATE", "MongoBackend", "freeze_id", "stamp_layout", "state_id"]

LAYOUT: Final = "mdb_shard_layout"
RELOCATIONS: Final = "mdb_relocations"
STATE: Final = briefcase_state.name
"""Briefcase states (fences, incoming copies, residents) and partition freeze markers (:func:`freeze_id`)."""


def state_id(area: str, gdid: GDID) -> str:
    """``_id`` of a briefcase's state and guard documents (hex sorts like the GDID)."""
    return f"{area}:{gdid.hex}"


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


STREAM_BATCH: Final = 1000
"""Documents fetched per cursor batch by the scans."""


class MongoAreaScan(AreaScan):
    """An area's collections on one MongoDB server (each call its own reads, no transaction).

    Per briefcase: documents and their BSON sizes (``bson.encode``), what a move copies, summed
    by the client while it streams each collection sorted by the briefcase key (the key's index
    serves the sort; GDIDs are 12-byte binaries, which BSON orders like the GDIDs). The server's
    own storage figure (``$collStats`` storage size + index size) is reported as storage bytes
    where the server answers it; the in-process fake does not implement ``$collStats`` (None).
    """

    def __init__(self, cluster: Servers, server: str, data: AreaData) -> None:
        self.cluster = cluster
        self.server = server
        self.data = data

    def _db(self) -> Any:
        return documents_of(self.cluster).database(self.server)

    def _stream(self, name: str, key: str, projection: dict[str, int] | None) -> Iterator[tuple[bytes, str, dict[str, Any]]]:
        cursor = self._db()[name].find({key: {"$type": "binData"}}, projection, sort=[(key, 1)], batch_size=STREAM_BATCH)
        for doc in cursor:
            yield bytes(doc[key]), name, doc

    def sizes(self) -> Iterator[BriefcaseSize]:
        import bson  # pymongo's: present wherever a MongoDB server is reachable

        merged = heapq.merge(*(self._stream(n, k, None) for n, k in self.data.collections), key=lambda item: item[0])
        current: bytes | None = None
        docs = size = 0
        names: list[str] = []
        for key, name, doc in merged:
            if key != current:
                if current is not None:
                    yield BriefcaseSize(GDID.from_bytes(current), docs, size, tuple(names))
                current, docs, size, names = key, 0, 0, []
            docs += 1
            size += len(bson.encode(doc))
            if not names or names[-1] != name:
                names.append(name)
        if current is not None:
            yield BriefcaseSize(GDID.from_bytes(current), docs, size, tuple(names))

    def keys(self) -> Iterator[GDID]:
        streams = (self._stream(n, k, {k: 1, "_id": 0}) for n, k in self.data.collections)
        last: bytes | None = None
        for key, _, _ in heapq.merge(*streams, key=lambda item: item[0]):
            if key != last:
                last = key
                yield GDID.from_bytes(key)

    def rows_of(self, gdid: GDID) -> int:
        db = self._db()
        return sum(int(db[n].count_documents({k: bytes(gdid)})) for n, k in self.data.collections)

    def storage_bytes(self) -> int | None:
        db = self._db()
        total = 0
        for name, _ in self.data.collections:
            try:
                stats = db[name].aggregate([{"$collStats": {"storageStats": {}}}])
            except NotImplementedError:  # mongomock-ng (the fake): no storage engine to ask
                return None
            for part in stats:  # one per shard of a sharded collection
                storage = part.get("storageStats", {})
                total += int(storage.get("storageSize", 0)) + int(storage.get("totalIndexSize", 0))
        return total

    def states(self) -> Iterator[BriefcaseStateRow]:
        found = self._db()[STATE].find({"area": self.data.area}, sort=[("_id", 1)], batch_size=STREAM_BATCH)
        for doc in found:
            yield BriefcaseStateRow(GDID.from_bytes(doc["gdid"]), doc["state"], doc.get("peer"), doc.get("move_id"), doc.get("changed_at"))


class MongoBackend(Backend):
    """Servers reached through pymongo; each call is one operation on the server's mdb database."""

    kind: ClassVar[str] = MONGO
    holds_documents = declares_indexes = True

    def stamp_layout(
        self, cluster: Servers, server: str, layout: ShardLayout, map_version: int, *, replace: bool
    ) -> str | None:
        return stamp_layout(documents_of(cluster).database(server), layout, map_version, replace=replace)

    def load_relocations(self, cluster: Servers, server: str) -> dict[tuple[str, GDID], str]:
        docs = documents_of(cluster).database(server)[RELOCATIONS].find({})
        return {(doc["area"], GDID.from_bytes(doc["gdid"])): doc["server"] for doc in docs}

    def relocation_of(self, cluster: Servers, server: str, area: str, gdid: GDID) -> str | None:
        doc = documents_of(cluster).database(server)[RELOCATIONS].find_one({"_id": f"{area}:{gdid.hex}"})
        return None if doc is None else str(doc["server"])

    def relocation_reach(self, cluster: Servers, server: str) -> dict[tuple[str, str], Reach]:
        # streamed and summed here (a few fields per document, nothing kept per briefcase): linear
        # in the entries, unlike the SQL backend's one aggregate; document directories are small
        out: dict[tuple[str, str], Reach] = {}
        for doc in documents_of(cluster).database(server)[RELOCATIONS].find({}, {"area": 1, "gdid": 1, "server": 1}):
            v = GDID.from_bytes(doc["gdid"]).sharding_value
            key = (doc["area"], doc["server"])
            seen = out.get(key)
            out[key] = Reach(1, v, v) if seen is None else seen.merge(Reach(1, v, v))
        return out

    def set_relocations(self, cluster: Servers, server: str, area: str, targets: Mapping[GDID, str | None]) -> None:
        directory = documents_of(cluster).database(server)[RELOCATIONS]
        for gdid, target in targets.items():  # each entry is one document; a write of one is atomic
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

    def scan(self, cluster: Servers, server: str, data: AreaData) -> AreaScan:
        return MongoAreaScan(cluster, server, data)

    def holds_area(self, cluster: Servers, server: str, data: AreaData) -> bool:
        if not data.collections:
            return False
        names = set(documents_of(cluster).database(server).list_collection_names())
        return any(name in names for name, _ in data.collections)

    def holding(self, cluster: Servers, server: str, data: AreaData, gdid: GDID) -> Holding:
        db = documents_of(cluster).database(server)
        rows = sum(int(db[name].count_documents({key: bytes(gdid)})) for name, key in data.collections)
        doc = db[STATE].find_one({"_id": state_id(data.area, gdid)})
        state = None if doc is None else BriefcaseStateRow(gdid, doc["state"], doc.get("peer"), doc.get("move_id"), doc.get("changed_at"))
        return Holding(rows, state)

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

    def mark_applying(self, cluster: Servers, server: str, area: str, start: GDID, mark: str) -> bool:
        found = documents_of(cluster).database(server)[STATE].update_one(
            {"_id": freeze_id(area, start)},
            {"$setOnInsert": {"area": area, "state": STATE_FROZEN, "peer": str(start), "move_id": mark}},
            upsert=True,
        )
        return found.upserted_id is not None

    def clear_applying(self, cluster: Servers, server: str) -> int:
        found = documents_of(cluster).database(server)[STATE].delete_many(
            {"state": STATE_FROZEN, "move_id": {"$regex": f"^{re.escape(APPLYING_PREFIX)}"}}
        )
        return int(found.deleted_count)

    def frozen_by(self, cluster: Servers, server: str, area: str, start: GDID) -> str | None:
        marker = documents_of(cluster).database(server)[STATE].find_one({"_id": freeze_id(area, start), "state": STATE_FROZEN})
        return None if marker is None else str(marker["move_id"])

    def drop_residents(self, cluster: Servers, server: str, area: str, redundant: Callable[[GDID], bool]) -> int:
        states = documents_of(cluster).database(server)[STATE]
        ids = [doc["_id"] for doc in states.find({"area": area, "state": STATE_RESIDENT}, {"gdid": 1})
               if redundant(GDID.from_bytes(doc["gdid"]))]
        dropped = 0
        for i in range(0, len(ids), 1000):  # one per briefcase a reshard moved: in bulk, like the SQL side
            dropped += int(states.delete_many({"_id": {"$in": ids[i : i + 1000]}, "state": STATE_RESIDENT}).deleted_count)
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
