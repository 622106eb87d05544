"""A collection of one briefcase: every read and write confined to the briefcase key.

The wrapper adds ``{key: <gdid>}`` to every filter (with ``$and``, so a caller's own condition
on the key can only narrow it), fills the key into inserted documents and refuses documents,
updates and pipeline stages that would reach another briefcase. Every call carries the
context's client session, so on a transactional server it is part of the context's transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mdb.errors import CrossBriefcaseError, SchemaError
from mdb.gdid import GDID
from mdb.mongo.types import decode_gdid, encode

__all__ = ["BriefcaseCollection"]

# Stages that read or write other collections, i.e. possibly other briefcases.
_FOREIGN_STAGES = frozenset({"$lookup", "$graphLookup", "$unionWith", "$out", "$merge", "$collStats", "$indexStats", "$currentOp"})
_KEY_CHANGING_OPERATORS = ("$set", "$unset", "$rename", "$setOnInsert", "$inc", "$mul", "$min", "$max", "$currentDate", "$push", "$pull", "$addToSet", "$pop")


def _decode(doc: Mapping[str, Any] | None, key: str) -> dict[str, Any] | None:
    if doc is None:
        return None
    out = dict(doc)
    for field in ("_id", key):
        if field in out:
            out[field] = decode_gdid(out[field])
    return out


class BriefcaseCollection:
    """``find``/``find_one``/``count_documents``/``aggregate`` and the write methods of pymongo, confined."""

    def __init__(self, raw: Any, name: str, key: str, gdid: GDID, *, root: bool, session: Any, readonly: bool) -> None:
        self.raw = raw
        """The underlying pymongo collection (unconfined: for mdb's own tools)."""
        self.name = name
        self.key = key
        self.gdid = gdid
        self._gid = bytes(gdid)
        self._root = root
        self._session = session
        self._readonly = readonly

    def __repr__(self) -> str:
        return f"BriefcaseCollection({self.name!r}, {self.key}={self.gdid})"

    # -- confinement --------------------------------------------------------------------------

    def _where(self, filter: Mapping[str, Any] | None) -> dict[str, Any]:
        if not filter:
            return {self.key: self._gid}
        return {"$and": [{self.key: self._gid}, encode(filter)]}

    def _writable(self, what: str) -> None:
        if self._readonly:
            raise CrossBriefcaseError(f"{what} on {self.name!r}: this briefcase context is readonly")

    def _document(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        out = encode(dict(doc))
        where = f"briefcase {self.key}={self.gdid}, collection {self.name!r}"
        if self.key in out and out[self.key] != self._gid:
            raise CrossBriefcaseError(f"{where}: document has {self.key}={decode_gdid(out[self.key])}, not this briefcase")
        out[self.key] = self._gid
        if self._root:
            out.setdefault("_id", self._gid)
            if out["_id"] != self._gid:
                raise CrossBriefcaseError(f"{where}: the root document's _id must be the briefcase GDID {self.gdid}")
        ident = out.get("_id")
        if ident is None:
            raise SchemaError(
                f"{where}: a document needs an _id: a GDID (e.g. from store.gdids(...)) or a compound "
                f"that starts with {self.key!r}; server-made ObjectIds are not used"
            )
        if isinstance(ident, Mapping):
            first = next(iter(ident), None)
            if first != self.key or ident[first] != self._gid:
                raise CrossBriefcaseError(f"{where}: a compound _id must start with {self.key!r} = {self.gdid}, got {ident!r}")
        elif not (isinstance(ident, bytes) and len(ident) == 12):
            raise SchemaError(f"{where}: _id must be a GDID or a compound starting with {self.key!r}, got {ident!r}")
        return out

    def _update(self, update: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> Any:
        if not isinstance(update, Mapping):
            raise SchemaError(f"collection {self.name!r}: pipeline updates are not supported in a briefcase context")
        for op in _KEY_CHANGING_OPERATORS:
            fields = update.get(op) or {}
            for field in fields:
                if field in (self.key, "_id") or field.startswith((f"{self.key}.", "_id.")):
                    raise CrossBriefcaseError(
                        f"collection {self.name!r}: {op} on {field!r} would move a document out of its briefcase"
                    )
        return encode(update)

    # -- reads -----------------------------------------------------------------------------------

    def find(
        self, filter: Mapping[str, Any] | None = None, projection: Any = None, *,
        sort: Sequence[tuple[str, int]] | None = None, limit: int = 0, skip: int = 0,
    ) -> list[dict[str, Any]]:
        """The matching documents of this briefcase, as a list (a briefcase is small by design)."""
        kwargs: dict[str, Any] = {"session": self._session, "limit": limit, "skip": skip}
        if sort:
            kwargs["sort"] = list(sort)
        docs = self.raw.find(self._where(filter), projection, **kwargs)
        return [d for d in (_decode(doc, self.key) for doc in docs) if d is not None]

    def find_one(self, filter: Mapping[str, Any] | None = None, projection: Any = None) -> dict[str, Any] | None:
        return _decode(self.raw.find_one(self._where(filter), projection, session=self._session), self.key)

    def count_documents(self, filter: Mapping[str, Any] | None = None) -> int:
        return int(self.raw.count_documents(self._where(filter), session=self._session))

    def aggregate(self, pipeline: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The pipeline behind a leading ``$match`` on the briefcase key; cross-collection stages refused."""
        for stage in pipeline:
            foreign = _FOREIGN_STAGES.intersection(stage)
            if foreign:
                raise CrossBriefcaseError(
                    f"collection {self.name!r}: stage {sorted(foreign)[0]} reads or writes outside the briefcase"
                )
        return list(self.raw.aggregate([{"$match": {self.key: self._gid}}, *encode(list(pipeline))], session=self._session))

    # -- writes ----------------------------------------------------------------------------------

    def insert_one(self, document: Mapping[str, Any]) -> Any:
        self._writable("insert_one")
        return self.raw.insert_one(self._document(document), session=self._session)

    def insert_many(self, documents: Sequence[Mapping[str, Any]]) -> Any:
        self._writable("insert_many")
        return self.raw.insert_many([self._document(d) for d in documents], session=self._session)

    def replace_one(self, filter: Mapping[str, Any], replacement: Mapping[str, Any]) -> Any:
        self._writable("replace_one")
        doc = self._document(replacement) if "_id" in replacement or self._root else None
        if doc is None:
            doc = encode(dict(replacement))
            if doc.get(self.key, self._gid) != self._gid:
                raise CrossBriefcaseError(f"collection {self.name!r}: replacement belongs to another briefcase")
            doc[self.key] = self._gid
        return self.raw.replace_one(self._where(filter), doc, session=self._session)

    def update_one(self, filter: Mapping[str, Any], update: Mapping[str, Any]) -> Any:
        self._writable("update_one")
        return self.raw.update_one(self._where(filter), self._update(update), session=self._session)

    def update_many(self, filter: Mapping[str, Any], update: Mapping[str, Any]) -> Any:
        self._writable("update_many")
        return self.raw.update_many(self._where(filter), self._update(update), session=self._session)

    def delete_one(self, filter: Mapping[str, Any]) -> Any:
        self._writable("delete_one")
        return self.raw.delete_one(self._where(filter), session=self._session)

    def delete_many(self, filter: Mapping[str, Any] | None = None) -> Any:
        self._writable("delete_many")
        return self.raw.delete_many(self._where(filter), session=self._session)
