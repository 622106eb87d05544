"""Document briefcase types: a root collection and child collections keyed by the root's GDID.

    class UserDocs(DocumentBriefcaseType):
        area = "docs"
        key = "user_id"
        root = "users"
        children = ("orders", "events")
        indexes = (
            MongoIndex("users", [("user_id", 1), ("email", 1)], unique=True),
            MongoIndex("orders", [("user_id", 1), ("placed_at", -1)]),
        )

Every document of a briefcase carries the key field. ``_id``s are GDIDs stored as their 12
bytes (BSON binary, subtype 0): BSON orders binaries by length, then subtype, then bytes, so
equal-length GDIDs sort exactly like the GDIDs (era, raw id), in half the space of the 24-char
hex text and with the same value the SQL side stores (``GDIDType`` is the 12 bytes too), which
keeps the move checksums and the CENTRAL code byte-for-byte alike. A compound ``_id`` is allowed
when its first field is the briefcase key. The root document's ``_id`` is the briefcase GDID.

A unique index whose keys do not start with the briefcase key is refused here: on a MongoDB
cluster sharded by the briefcase key, ``mongos`` refuses it too (a unique index must be
prefixed by the shard key), and on mdb's own shards it could only be enforced per shard.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mdb.errors import SchemaError
from mdb.gdid import GDID
from mdb.registry import Kind, Registry, default_registry

__all__ = [
    "DocumentBriefcaseType",
    "MongoIndex",
    "decode_gdid",
    "encode",
    "registered_document_types",
]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass(frozen=True)
class MongoIndex:
    """A secondary index of one collection of a document briefcase type."""

    collection: str
    keys: Sequence[tuple[str, Any]]
    unique: bool = False
    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def index_name(self) -> str:
        return self.name or "_".join(f"{k}_{d}" for k, d in self.keys)


class DocumentBriefcaseType:
    """Declare by subclassing; validation runs at class creation."""

    area: ClassVar[str]
    key: ClassVar[str]
    root: ClassVar[str]
    children: ClassVar[Sequence[str]] = ()
    indexes: ClassVar[Sequence[MongoIndex]] = ()

    collections: ClassVar[tuple[str, ...]]
    """Root first, then the children (filled in at declaration)."""

    @classmethod
    def clash_with(cls, other: type[DocumentBriefcaseType]) -> str | None:
        """Two document types of one area may not share a collection (whose documents would they be?)."""
        shared = set(other.collections) & set(cls.collections)
        if shared:
            return (
                f"document briefcase types {cls.__name__} and {other.__name__} of area {cls.area!r} "
                f"share collections {sorted(shared)}"
            )
        return None

    def __init_subclass__(cls, registry: Registry | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__name__
        for attr in ("area", "key", "root"):
            if not isinstance(getattr(cls, attr, None), str):
                raise SchemaError(f"document briefcase type {name} must set {attr!r} to a string")
        if isinstance(cls.children, str):
            raise SchemaError(f"document briefcase type {name}: children must be a tuple of collection names, not a string")
        collections = (cls.root, *cls.children)
        for coll in collections:
            if not isinstance(coll, str) or not _NAME.match(coll) or coll.startswith("mdb_"):
                raise SchemaError(
                    f"document briefcase type {name}: collection name {coll!r} is not valid "
                    "(letters, digits, underscore; at most 63; the mdb_ prefix is reserved)"
                )
        if len(set(collections)) != len(collections):
            raise SchemaError(f"document briefcase type {name}: a collection is listed twice ({', '.join(collections)})")
        if cls.key == "_id" or not _NAME.match(cls.key):
            raise SchemaError(f"document briefcase type {name}: key {cls.key!r} must be a plain field name other than _id")
        for index in cls.indexes:
            _check_index(name, cls.key, collections, index)
        cls.collections = collections
        (registry or default_registry).add(DOCUMENT_TYPES, f"{cls.__module__}.{cls.__qualname__}", cls)

    @classmethod
    def indexes_of(cls, collection: str) -> list[MongoIndex]:
        """Declared indexes of ``collection`` plus the key index every collection gets."""
        own = [i for i in cls.indexes if i.collection == collection]
        if collection == cls.root:
            return own  # the root's _id is the key
        return [MongoIndex(collection, [(cls.key, 1), ("_id", 1)], name=f"mdb_{cls.key}_id"), *own]


def _check_index(type_name: str, key: str, collections: Sequence[str], index: MongoIndex) -> None:
    where = f"document briefcase type {type_name}, index {index.index_name!r} on {index.collection!r}"
    if index.collection not in collections:
        raise SchemaError(f"{where}: {index.collection!r} is not a collection of this type ({', '.join(collections)})")
    if not index.keys:
        raise SchemaError(f"{where}: has no keys")
    for entry in index.keys:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
            raise SchemaError(f"{where}: keys must be (field, direction) pairs, got {entry!r}")
    if index.unique and index.keys[0][0] != key:
        raise SchemaError(
            f"{where}: a unique index must start with the briefcase key {key!r} (its keys start with "
            f"{index.keys[0][0]!r}); a sharded MongoDB cluster refuses a unique index that is not prefixed "
            "by the shard key, and mdb shards could only enforce it per shard. Prefix it with the key, "
            "or keep a global unique key in a CENTRAL index."
        )


DOCUMENT_TYPES: Kind[type[DocumentBriefcaseType]] = Kind("document briefcase type")


def registered_document_types(registry: Registry | None = None) -> list[type[DocumentBriefcaseType]]:
    """Every document briefcase type declared so far in ``registry`` (the default one)."""
    return (registry or default_registry).items(DOCUMENT_TYPES)


def encode(value: Any) -> Any:
    """GDIDs anywhere in a document, filter or update -> their 12 bytes (what is stored)."""
    if isinstance(value, GDID):
        return bytes(value)
    if isinstance(value, Mapping):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode_gdid(value: Any) -> Any:
    """12 stored bytes -> GDID; anything else unchanged."""
    if isinstance(value, (bytes, bytearray)) and len(value) == 12:
        return GDID.from_bytes(bytes(value))
    return value
