"""The in-process MongoDB stand-in used when no real server is configured (tests, demo).

mongomock-ng implements the query language, unique indexes and sessions, but not a server's
concurrency: its ``$inc`` is a Python read-modify-write that loses updates under threads, and a
transaction abort restores a whole-collection snapshot (wiping what other threads committed
meanwhile). This wrapper gives each fake server one re-entrant lock: every operation runs under
it, and a transaction holds it from ``start_transaction`` to commit/abort. Transactions on the
fake are therefore serial (trivially isolated) and single operations atomic, which is what a
real server guarantees; throughput is not representative and is never measured on the fake.

One fake server per URL (scheme, host and path), shared by every client made for that URL by
the same :class:`FakeMongo`, so a Store and a test see the same data.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FakeMongo"]


class FakeMongo:
    """A client factory (``factory(url, **options)``) backed by in-process fake servers.

    ``transactions`` is what the fake servers report to :func:`mdb.mongo.clients.supports_transactions`:
    True behaves like a replica set, False like a standalone mongod (no multi-document transactions).
    """

    def __init__(self, *, transactions: bool = True) -> None:
        _patch_mongomock()
        self.transactions = transactions
        self._servers: dict[str, tuple[Any, threading.RLock]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FakeMongo(servers={len(self._servers)}, transactions={self.transactions})"

    def __call__(self, url: str, **options: Any) -> FakeClient:
        # store is a submodule: ``import mongomock_ng`` alone does not promise to load it
        import mongomock_ng
        from mongomock_ng.store import ServerStore

        parts = urlsplit(url.strip())
        key = f"{parts.hostname or ''}:{parts.port or ''}/{parts.path.lstrip('/')}"
        with self._lock:
            if key not in self._servers:
                self._servers[key] = (ServerStore(), threading.RLock())
            store, lock = self._servers[key]
        # mongomock-ng's stubs present its client as pymongo's MongoClient, generic in the document type
        client: mongomock_ng.MongoClient[dict[str, Any]] = mongomock_ng.MongoClient(_store=store)
        return FakeClient(client, lock, self.transactions)


def _patch_mongomock() -> None:
    """mongomock's transaction snapshot deep-copies documents, and its immutable ``hashdict``
    (how it stores a compound ``_id``) refuses the item assignment ``deepcopy`` does. An
    immutable value deep-copies to itself; without this, a compound ``_id`` breaks every
    transaction on the fake."""
    from mongomock_ng.helpers import hashdict

    if "__deepcopy__" not in vars(hashdict):
        hashdict.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]


class FakeClient:
    def __init__(self, inner: Any, lock: threading.RLock, transactions: bool) -> None:
        self._inner = inner
        self._lock = lock
        self.mdb_supports_transactions = transactions

    def __repr__(self) -> str:
        return "FakeClient(in-process)"

    def __getitem__(self, name: str) -> FakeDatabase:
        return FakeDatabase(self._inner[name], self._lock)

    def get_database(self, name: str) -> FakeDatabase:
        return self[name]

    def start_session(self, **kwargs: Any) -> FakeSession:
        return FakeSession(self._inner.start_session(**kwargs), self._lock, self.mdb_supports_transactions)

    def close(self) -> None:
        """Nothing to release: the fake server outlives its clients, like a real one."""


class FakeDatabase:
    def __init__(self, inner: Any, lock: threading.RLock) -> None:
        self._inner = inner
        self._lock = lock

    @property
    def name(self) -> str:
        return str(self._inner.name)

    def __getitem__(self, name: str) -> FakeCollection:
        return FakeCollection(self._inner[name], self._lock)

    def get_collection(self, name: str) -> FakeCollection:
        return self[name]

    def list_collection_names(self, session: Any = None) -> list[str]:
        with self._lock:
            return list(self._inner.list_collection_names())

    def create_collection(self, name: str, **kwargs: Any) -> FakeCollection:
        with self._lock:
            self._inner.create_collection(name, **kwargs)
        return self[name]

    def drop_collection(self, name: str) -> None:
        with self._lock:
            self._inner.drop_collection(name)


def _unwrap(kwargs: dict[str, Any]) -> dict[str, Any]:
    session = kwargs.get("session")
    if isinstance(session, FakeSession):
        kwargs["session"] = session.inner if session.in_transaction else None
    return kwargs


class FakeCollection:
    """Every call runs under the fake server's lock; cursors are materialized inside it."""

    _CURSORS = frozenset({"find", "aggregate", "list_indexes"})

    def __init__(self, inner: Any, lock: threading.RLock) -> None:
        self._inner = inner
        self._lock = lock

    @property
    def name(self) -> str:
        return str(self._inner.name)

    def __getattr__(self, attr: str) -> Any:
        method = getattr(self._inner, attr)
        if not callable(method):
            return method
        materialize = attr in self._CURSORS

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                result = method(*args, **_unwrap(kwargs))
                return list(result) if materialize else result

        return call


class FakeSession:
    """A session whose transaction holds the fake server's lock until it ends."""

    def __init__(self, inner: Any, lock: threading.RLock, transactions: bool) -> None:
        self.inner = inner
        self._lock = lock
        self._transactions = transactions
        self._held = False

    @property
    def in_transaction(self) -> bool:
        return bool(self.inner.in_transaction)

    def start_transaction(self, **kwargs: Any) -> None:
        if not self._transactions:
            import pymongo.errors

            raise pymongo.errors.OperationFailure(
                "Transaction numbers are only allowed on a replica set member or mongos", code=20
            )
        self._lock.acquire()
        self._held = True
        self.inner.start_transaction()

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()

    def commit_transaction(self) -> None:
        try:
            self.inner.commit_transaction()
        finally:
            self._release()

    def abort_transaction(self) -> None:
        try:
            self.inner.abort_transaction()
        finally:
            self._release()

    def end_session(self) -> None:
        try:
            if self.inner.in_transaction:
                self.inner.abort_transaction()
            self.inner.end_session()
        finally:
            self._release()
