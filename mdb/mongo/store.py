"""``store.mongo``: document briefcases on the map's MongoDB servers, routed like SQL briefcases.

The same router, map and relocation directory as the Store's SQL sessions; only the server is
a MongoDB one. A briefcase context (:meth:`MongoStore.documents`) runs the ownership check on
the shard first (:func:`mdb.ownership.check_ownership` on the shard's own layout and state
documents), then hands out the briefcase's collections confined to its key. Where the server
runs transactions (replica set, mongos) a write context is one transaction and the check is
its first read; on a standalone server (or the fake configured without transactions) each
operation commits on its own and the check precedes the work: documented, and tested both ways.
Readonly contexts read the map's replica URL, or the primary's URL with ``secondaryPreferred``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from mdb import telemetry
from mdb.backends import open_routed, servers_where
from mdb.cluster import Cluster
from mdb.errors import MdbError, QueryError, RetryableError, RoutingError
from mdb.fanout import ShardFailure, SortKey, SortTerm, fan_out_servers, gather, merge_sorted
from mdb.gdid import GDID
from mdb.mongo.clients import ClientFactory, MongoClients
from mdb.mongo.collection import BriefcaseCollection, _decode
from mdb.mongo.shard_state import check_guard, excluded_gdids, ownership_rows
from mdb.briefcase import types_by_area
from mdb.mongo.types import DocumentBriefcaseType, encode, registered_document_types
from mdb.ownership import check_ownership
from mdb.retry import RoutedOpen
from mdb.router import Placement, Router



class DocumentCluster(Cluster, Protocol):
    """The cluster a MongoStore routes over, with the Store's routing and retry policy for stale routes."""

    max_stale_retries: int
    move_wait_seconds: float

    def routed_open(self, area: str, gdid: GDID) -> RoutedOpen:
        """The routing and retry policy of one session open (:mod:`mdb.retry`)."""
        ...


class _Host(DocumentCluster, Protocol):
    def attach_documents(self, mongo: MongoStore) -> MongoStore: ...

__all__ = ["DocumentBriefcase", "FanOutDocuments", "MongoStore"]


@dataclass
class DocumentBriefcase:
    """One briefcase's collections on its shard, plus the session and transaction mode."""

    dtype: type[DocumentBriefcaseType]
    gdid: GDID
    placement: Placement
    readonly: bool
    transactional: bool
    session: Any
    db: Any

    def collection(self, name: str) -> BriefcaseCollection:
        if name not in self.dtype.collections:
            raise RoutingError(f"{name!r} is not a collection of {self.dtype.__name__} ({', '.join(self.dtype.collections)})")
        return BriefcaseCollection(
            self.db[name], name, self.dtype.key, self.gdid,
            root=name == self.dtype.root, session=self.session if self.transactional else None, readonly=self.readonly,
        )

    __getitem__ = collection

    @property
    def root(self) -> BriefcaseCollection:
        return self.collection(self.dtype.root)


@dataclass
class FanOutDocuments:
    """Merged documents of a fan-out, plus the shards that failed (only with ``allow_partial``)."""

    documents: list[dict[str, Any]]
    failed: list[ShardFailure] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.failed

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.documents)

    def __len__(self) -> int:
        return len(self.documents)


def _is_transient(exc: BaseException) -> bool:
    has = getattr(exc, "has_error_label", None)
    return bool(has and has("TransientTransactionError"))


def _is_driver_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith(("pymongo", "mongomock"))


class MongoStore:
    """Document briefcases, fan-out reads and schema of one Store's MongoDB servers."""

    def __init__(
        self, store: DocumentCluster, *, client_factory: ClientFactory | None = None,
        types: Sequence[type[DocumentBriefcaseType]] | None = None, transactions: bool | None = None,
    ) -> None:
        self.store = store
        self.clients = MongoClients(store.map.servers, client_factory, transactions=transactions)
        self._map_version = store.map.version
        self.types: list[type[DocumentBriefcaseType]] = list(registered_document_types(store.registry) if types is None else types)
        self.types_by_area = types_by_area(self.types)

    @classmethod
    def attach(
        cls, store: _Host, *, client_factory: ClientFactory | None = None,
        types: Sequence[type[DocumentBriefcaseType]] | None = None, transactions: bool | None = None,
    ) -> MongoStore:
        """Give ``store`` its MongoStore (``store.mongo``) built with this client factory."""
        return store.attach_documents(cls(store, client_factory=client_factory, types=types, transactions=transactions))

    def __repr__(self) -> str:
        return f"MongoStore(servers={self.clients.server_names}, types={[t.__name__ for t in self.types]})"

    def types_of(self, area: str) -> list[type[DocumentBriefcaseType]]:
        return self.types_by_area.get(area, [])

    def _sync(self) -> None:
        if self.store.map.version != self._map_version:
            self.clients.update(self.store.map.servers)
            self._map_version = self.store.map.version

    def database(self, server: str, readonly: bool = False) -> Any:
        self._sync()
        return self.clients.database(server, readonly)

    def translate(self, server: str, exc: BaseException) -> MdbError | None:
        """A pymongo error as an mdb error (secrets masked), or None when it is not a driver error."""
        if isinstance(exc, MdbError):
            return exc
        if _is_transient(exc):
            return RetryableError(f"server {server!r}: transaction conflict, retry the briefcase context ({type(exc).__name__})")
        import pymongo.errors

        if isinstance(exc, (pymongo.errors.ConnectionFailure, pymongo.errors.ConfigurationError)):
            return self.clients.unavailable(server, exc)
        return None

    # -- briefcase contexts ----------------------------------------------------------------------

    @telemetry.observed_documents
    @contextmanager
    def documents(
        self, dtype: type[DocumentBriefcaseType], gdid: GDID | str, *, readonly: bool = False
    ) -> Iterator[DocumentBriefcase]:
        """The briefcase's collections on its shard: commit on success, abort on error."""
        gid = gdid if isinstance(gdid, GDID) else GDID.parse(gdid)
        if dtype not in self.types_of(dtype.area):
            raise RoutingError(f"document briefcase type {dtype.__name__} is not registered with this Store")
        ctx = self._open(dtype, gid, readonly)
        server = ctx.placement.server
        try:
            yield ctx
            if ctx.session.in_transaction:
                ctx.session.commit_transaction()
        except BaseException as exc:
            if ctx.session.in_transaction:
                ctx.session.abort_transaction()
            translated = self.translate(server, exc) if isinstance(exc, Exception) else None
            if translated is not None and translated is not exc:
                raise translated from exc
            raise
        finally:
            ctx.session.end_session()

    def _open(self, dtype: type[DocumentBriefcaseType], gdid: GDID, readonly: bool) -> DocumentBriefcase:
        def attempt(router: Router, placement: Placement) -> DocumentBriefcase:
            server = placement.server
            db = self.database(server, readonly)
            transactional = not readonly and self.clients.transactions(server)
            try:
                session = self.clients.client(server, readonly).start_session()
            except Exception as exc:
                raise self.clients.unavailable(server, exc) from None
            try:
                if transactional:
                    session.start_transaction()
                txn = session if transactional else None
                if not readonly:  # readers may read the source during a move: it is authoritative until the fence
                    check_guard(db, placement, txn)
                check_ownership(ownership_rows(db, placement, txn), placement, router.version, write=not readonly)
            except RetryableError:
                session.end_session()
                raise
            except Exception as exc:
                session.end_session()
                translated = self.translate(server, exc)
                if translated is not None and translated is not exc:
                    raise translated from None
                raise
            return DocumentBriefcase(dtype, gdid, placement, readonly, transactional, session, db)

        return open_routed(
            self.store, attempt, self.store.routed_open(dtype.area, gdid),
            on_refused=lambda placement, exc: telemetry.ownership_refused(dtype.area, placement.server, exc),
            on_retry=lambda placement, exc: telemetry.stale_retry(dtype.area, placement.server, exc),
        )

    # -- fan-out reads ---------------------------------------------------------------------------

    def fan_out(
        self, area: str, collection: str, filter: Mapping[str, Any] | None = None, *,
        projection: Any = None, sort: Sequence[tuple[str, int]] | None = None, limit: int | None = None,
        skip: int = 0, readonly: bool = True, allow_partial: bool = False, max_workers: int = 8,
    ) -> FanOutDocuments:
        """``find`` on every MongoDB shard of ``area``, merged as one collection would answer.

        Each shard gets the filter, the sort (plus ``_id`` as the final tie-breaker, so the
        order is total and identical to a single collection's) and ``limit + skip``; the sorted
        streams are k-way merged and skip/limit applied once. Documents of briefcases that are
        incoming or fenced on a shard are excluded there (the other copy is authoritative).
        Not a snapshot: each shard is read at its own moment.
        """
        if limit is not None and limit < 0 or skip < 0:
            raise QueryError(f"fan-out on {area}.{collection}: limit and skip must not be negative")
        dtype = next((t for t in self.types_of(area) if collection in t.collections), None)
        if dtype is None:
            raise QueryError(f"fan-out: area {area!r} has no document collection {collection!r}")
        order = [(f, d) for f, d in (sort or []) if f != "_id"]
        id_dir = next((d for f, d in (sort or []) if f == "_id"), 1)
        order.append(("_id", id_dir))
        for f, d in order:
            if d not in (1, -1):
                raise QueryError(f"fan-out on {area}.{collection}: sort direction of {f!r} must be 1 or -1, got {d!r}")
        router = self.store.router
        servers = servers_where(router.map, lambda b: b.holds_documents, fan_out_servers(router, area))
        per_shard = None if limit is None else limit + skip

        def run(server: str) -> list[dict[str, Any]]:
            with telemetry.fanout_shard(server):
                db = self.database(server, readonly)
                gone = excluded_gdids(self.database(server), area)
                where: dict[str, Any] = encode(dict(filter or {}))
                if gone:
                    where = {"$and": [{dtype.key: {"$nin": gone}}, where]} if where else {dtype.key: {"$nin": gone}}
                return [
                    d for d in (_decode(doc, dtype.key) for doc in db[collection].find(where, projection, sort=order, limit=per_shard or 0))
                    if d is not None
                ]

        results, failed = gather(self.store, servers, run, allow_partial=allow_partial, max_workers=max_workers)
        terms = [SortTerm(descending=d == -1) for _, d in order]
        docs = merge_sorted(results, lambda doc: SortKey([_bson_key(_get(doc, f)) for f, _ in order], terms), skip, limit)
        return FanOutDocuments(docs, failed, servers)

    def fan_out_count(self, area: str, collection: str, filter: Mapping[str, Any] | None = None) -> int:
        """The number of matching documents over every shard of ``area`` (authoritative copies only)."""
        dtype = next((t for t in self.types_of(area) if collection in t.collections), None)
        if dtype is None:
            raise QueryError(f"fan-out: area {area!r} has no document collection {collection!r}")
        total = 0
        router = self.store.router
        for server in servers_where(router.map, lambda b: b.holds_documents, fan_out_servers(router, area)):
            with telemetry.fanout_shard(server):
                db = self.database(server)
                where: dict[str, Any] = encode(dict(filter or {}))
                gone = excluded_gdids(db, area)
                if gone:
                    where = {"$and": [{dtype.key: {"$nin": gone}}, where]}
                total += int(db[collection].count_documents(where))
        return total

    def close(self) -> None:
        self.clients.close()


# -- ordering of BSON values (the subset documents use), as MongoDB compares them ------------------

_RANK = {type(None): 0, int: 1, float: 1, str: 2, dict: 3, list: 4, bytes: 5, bool: 7, datetime: 8}


def _bson_key(value: Any) -> tuple[int, Any]:
    if isinstance(value, GDID):
        return (5, (12, bytes(value)))
    if isinstance(value, bool):
        return (7, value)
    rank = _RANK.get(type(value))
    if rank is None:
        from decimal import Decimal

        if isinstance(value, Decimal):
            return (1, value)
        return (6, str(value))  # ObjectId and the rest: by text, after binaries
    if rank == 3:
        return (3, tuple((k, _bson_key(v)) for k, v in value.items()))
    if rank == 4:
        return (4, tuple(_bson_key(v) for v in value))
    if rank == 5:
        return (5, (len(value), value))
    return (rank, value)


def _get(doc: Mapping[str, Any], path: str) -> Any:
    value: Any = doc
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value

