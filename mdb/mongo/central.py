"""CENTRAL indexes on MongoDB CENTRAL servers (the relocation directory is the backend's: :mod:`mdb.backends.mongo`).

:mod:`mdb.central`'s storage is SQL, so when a map's CENTRAL servers are MongoDB servers the
same decisions are kept here on documents: an index is declared with :class:`mdb.central.CentralIndex`
(its name, explicit normalization and uniqueness are reused as they are), the entry lives on
the CENTRAL shard ``router.locate_central(normalized key)`` names, and uniqueness is a unique
index on ``(index_name, key, slot)`` with ``slot`` = the zero GDID for a unique index, exactly
the SQL primary key. Entries are written ``live`` (this module has no pending/confirm creation
protocol: :meth:`MongoCentral.create` writes the briefcase first and the entry second, so a crash
between leaves a briefcase without its key, never a key without its briefcase; see
docs/mongodb.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from mdb.backends.base import CollectionSpec, IndexSpec
from mdb.backends.mongo import RELOCATIONS
from mdb.central.indexes import STATE_LIVE, CentralIndex, index_by_name
from mdb.errors import DuplicateKeyError
from mdb.gdid import GDID
from mdb.router import Router

if TYPE_CHECKING:
    from mdb.mongo.store import MongoStore

__all__ = ["INDEX", "RELOCATIONS", "MongoCentral", "central_collections"]

INDEX: Final = "mdb_central_index"


def central_collections() -> list[CollectionSpec]:
    """The collections (and indexes) a MongoDB CENTRAL server holds: index entries and the relocation directory."""
    return [
        CollectionSpec(INDEX, [
            IndexSpec([("index_name", 1), ("key", 1), ("slot", 1)], "mdb_index_key_slot", unique=True),
            IndexSpec([("index_name", 1), ("gdid", 1)], "mdb_index_gdid"),
        ]),
        CollectionSpec(RELOCATIONS),
    ]


class MongoCentral:
    """lookup / lookup_all / keys_of / add / remove / create on MongoDB CENTRAL shards."""

    def __init__(self, mongo: MongoStore) -> None:
        self.mongo = mongo

    def _index(self, ref: type[CentralIndex] | str) -> type[CentralIndex]:
        return index_by_name(ref, self.mongo.store.registry) if isinstance(ref, str) else ref

    def _collection(self, nkey: str) -> Any:
        router = Router(self.mongo.store.map)  # pure: CENTRAL placement needs no relocations
        return self.mongo.database(router.locate_central(nkey).server)[INDEX]

    def lookup(self, index: type[CentralIndex] | str, key: str) -> GDID | None:
        idx = self._index(index)
        nkey = idx.key_of(key)
        doc = self._collection(nkey).find_one({"index_name": idx.name, "key": nkey, "slot": bytes(GDID.ZERO)}) if idx.unique else None
        if not idx.unique:
            found = self.lookup_all(idx, key)
            return found[0] if found else None
        return None if doc is None else GDID.from_bytes(doc["gdid"])

    def lookup_all(self, index: type[CentralIndex] | str, key: str) -> list[GDID]:
        idx = self._index(index)
        nkey = idx.key_of(key)
        docs = self._collection(nkey).find({"index_name": idx.name, "key": nkey}, sort=[("slot", 1)])
        return [GDID.from_bytes(d["gdid"]) for d in docs]

    def keys_of(self, index: type[CentralIndex] | str, gdid: GDID | str) -> list[str]:
        """Every key of ``gdid`` in the index (asks every CENTRAL shard: keys hash anywhere)."""
        idx = self._index(index)
        gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
        keys: list[str] = []
        for server in Router(self.mongo.store.map).central_servers():
            keys += [d["key"] for d in self.mongo.database(server)[INDEX].find({"index_name": idx.name, "gdid": bytes(gid)})]
        return sorted(keys)

    def add(self, index: type[CentralIndex] | str, key: str, gdid: GDID | str) -> None:
        """Point ``key`` at ``gdid``; DuplicateKeyError when a unique key already points elsewhere."""
        import pymongo.errors

        idx = self._index(index)
        nkey = idx.key_of(key)
        gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
        doc = {
            "index_name": idx.name, "key": nkey, "slot": bytes(idx.slot(gid)), "gdid": bytes(gid),
            "state": STATE_LIVE, "created_at": time.time(),
        }
        coll = self._collection(nkey)
        try:
            coll.insert_one(doc)
        except pymongo.errors.DuplicateKeyError:
            holder = coll.find_one({"index_name": idx.name, "key": nkey, "slot": doc["slot"]})
            if holder is not None and holder["gdid"] == bytes(gid):
                return  # already there: adding is idempotent
            raise DuplicateKeyError(idx.name, nkey, None if holder is None else GDID.from_bytes(holder["gdid"])) from None

    def remove(self, index: type[CentralIndex] | str, key: str, gdid: GDID | str | None = None) -> bool:
        idx = self._index(index)
        nkey = idx.key_of(key)
        where: dict[str, Any] = {"index_name": idx.name, "key": nkey}
        if gdid is not None:
            where["gdid"] = bytes(gdid if isinstance(gdid, GDID) else GDID.parse(gdid))
        return bool(self._collection(nkey).delete_many(where).deleted_count)

    def create(
        self, index: type[CentralIndex] | str, key: str, gdid: GDID, write: Callable[[], None],
    ) -> GDID:
        """Create an entity reachable by ``key``: refuse a taken key, write the briefcase, then the entry.

        A crash after ``write`` leaves a briefcase without its key (found by a fan-out, re-added
        with :meth:`add`); no order leaves a key pointing at nothing.
        """
        idx = self._index(index)
        existing = self.lookup(idx, key) if idx.unique else None
        if existing is not None and existing != gdid:
            raise DuplicateKeyError(idx.name, idx.key_of(key), existing)
        write()
        self.add(idx, key, gdid)
        return gdid
