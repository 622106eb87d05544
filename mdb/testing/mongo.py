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

``FakeMongo(path=DIR)`` (tests only; the CLI takes it when the test harness armed it,
``MDB_TESTING=1``, and ``MDB_MONGO_FAKE_DIR`` is set: :func:`attach_fake_dir`, docs/mongodb.md) keeps each fake server in a file of ``DIR`` so that several processes share
it, and a process SIGKILLed mid-way leaves what it had committed: the server's lock is then
also an ``fcntl`` lock on ``<file>.lock``; whoever takes it first loads the file if another
process changed it, and whoever lets it go last after a write (or a transaction) writes the
file again (a temporary file renamed over it, so a reader never sees half of one). A
transaction holds the lock from its start to its end, as in one process.
"""

from __future__ import annotations

import copyreg
import fcntl
import io
import os
import pickle
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

if TYPE_CHECKING:
    from mdb.store import Store

__all__ = ["FAKE_DIR_ENV", "FakeMongo", "attach_fake_dir"]

FAKE_DIR_ENV = "MDB_MONGO_FAKE_DIR"
"""The CLI's MongoDB servers are file-backed fakes kept in this folder (when the harness armed it).

For tests that SIGKILL one CLI process mid-move and go on with another: an in-process fake
would die with the first. ``MDB_TEST_MONGO_URI`` (a real server) wins over it.
"""


def attach_fake_dir(store: Store) -> bool:
    """Give ``store`` the file-backed fake of ``MDB_MONGO_FAKE_DIR`` as its
    MongoDB side; False (nothing done) when the variable is unset or a real test server is named."""
    fake_dir = os.environ.get(FAKE_DIR_ENV, "").strip()
    if not fake_dir or os.environ.get("MDB_TEST_MONGO_URI", "").strip():
        return False
    from mdb.mongo.store import MongoStore

    MongoStore.attach(store, client_factory=FakeMongo(path=fake_dir))
    return True


class FakeMongo:
    """A client factory (``factory(url, **options)``) backed by in-process fake servers.

    ``transactions`` is what the fake servers report to :func:`mdb.mongo.clients.supports_transactions`:
    True behaves like a replica set, False like a standalone mongod (no multi-document transactions).
    """

    def __init__(self, *, transactions: bool = True, path: str | os.PathLike[str] | None = None) -> None:
        _patch_mongomock()
        self.transactions = transactions
        self.path = None if path is None else Path(path)
        self._servers: dict[str, tuple[Any, ServerLock]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        where = "" if self.path is None else f", path={str(self.path)!r}"
        return f"FakeMongo(servers={len(self._servers)}, transactions={self.transactions}{where})"

    def __call__(self, url: str, **options: Any) -> FakeClient:
        # store is a submodule: ``import mongomock_ng`` alone does not promise to load it
        import mongomock_ng
        from mongomock_ng.store import ServerStore

        parts = urlsplit(url.strip())
        key = f"{parts.hostname or ''}:{parts.port or ''}/{parts.path.lstrip('/')}"
        with self._lock:
            if key not in self._servers:
                server = ServerStore()
                file = None if self.path is None else self.path / (quote(key, safe="") + ".fake")
                self._servers[key] = (server, ServerLock(server, file))
            store, lock = self._servers[key]
        # mongomock-ng's stubs present its client as pymongo's MongoClient, generic in the document type
        client: mongomock_ng.MongoClient[dict[str, Any]] = mongomock_ng.MongoClient(_store=store)
        return FakeClient(client, lock, self.transactions)


class ServerLock:
    """One fake server's lock: re-entrant in a process and, with a file, across processes too.

    Taken around every operation (and for a whole transaction). With a file, taking it first
    takes ``flock`` on ``<file>.lock`` and loads the file when another process wrote it since
    this one last read or wrote it; letting it go last writes the file if anything was written.
    """

    def __init__(self, server: Any, file: Path | None) -> None:
        self._server = server
        self._file = file
        self._rlock = threading.RLock()
        self._depth = 0
        self._dirty = False
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file as last loaded or written
        self._fd: int | None = None

    def acquire(self) -> None:
        self._rlock.acquire()
        self._depth += 1
        if self._depth == 1 and self._file is not None:
            try:
                self._file.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(f"{self._file}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                self._load_if_changed()
            except BaseException:
                self._unlock_file()
                self._depth -= 1
                self._rlock.release()
                raise

    def release(self) -> None:
        try:
            if self._depth == 1 and self._file is not None:
                try:
                    if self._dirty:
                        self._write()
                finally:
                    self._dirty = False
                    self._unlock_file()
        finally:
            self._depth -= 1
            self._rlock.release()

    def __enter__(self) -> ServerLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def wrote(self) -> None:
        """The operation under the lock may have changed data: write the file when the lock is let go."""
        self._dirty = True

    def _unlock_file(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor lets go of its flock

    def _stat(self) -> tuple[int, int] | None:
        assert self._file is not None
        try:
            st = self._file.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _load_if_changed(self) -> None:
        seen = self._stat()
        if seen is None or seen == self._seen:
            return
        assert self._file is not None
        state: dict[str, dict[str, tuple[Any, Any, Any, Any, bool]]] = pickle.loads(self._file.read_bytes())
        for db_name, collections in state.items():
            db = self._server[db_name]
            for name in list(db._collections):
                if name not in collections:
                    db._collections[name].drop()
            for name, (documents, indexes, ttl, options, forced) in collections.items():
                coll = db[name]
                coll._documents, coll.indexes, coll._ttl_indexes, coll.options = documents, indexes, ttl, options
                coll._is_force_created = forced
        for db_name in list(self._server._databases):
            if db_name not in state:
                for coll in self._server._databases[db_name]._collections.values():
                    coll.drop()
        self._seen = seen

    def _write(self) -> None:
        assert self._file is not None
        state = {
            db_name: {
                name: (coll._documents, coll.indexes, coll._ttl_indexes, coll.options, coll._is_force_created)
                for name, coll in db._collections.items()
            }
            for db_name, db in self._server._databases.items()
        }
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = {**copyreg.dispatch_table, **_reducers()}
        pickler.dump(state)
        tmp = self._file.with_name(f"{self._file.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            out.write(buffer.getvalue())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self._file)
        self._seen = self._stat()


def _reducers() -> dict[type, Any]:
    """mongomock's ``hashdict`` (a compound ``_id``) refuses the item assignment unpickling does:
    pickle it as a call of its constructor on a plain dict instead."""
    from mongomock_ng.helpers import hashdict

    return {hashdict: lambda value: (hashdict, (dict(value),))}


def _patch_mongomock() -> None:
    """mongomock's transaction snapshot deep-copies documents, and its immutable ``hashdict``
    (how it stores a compound ``_id``) refuses the item assignment ``deepcopy`` does. An
    immutable value deep-copies to itself; without this, a compound ``_id`` breaks every
    transaction on the fake."""
    from mongomock_ng.helpers import hashdict

    if "__deepcopy__" not in vars(hashdict):
        hashdict.__deepcopy__ = lambda self, memo: self  # type: ignore[attr-defined]


class FakeClient:
    def __init__(self, inner: Any, lock: ServerLock, transactions: bool) -> None:
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


class _Locked:
    """A mongomock database or collection and the lock of the fake server it belongs to."""

    def __init__(self, inner: Any, lock: ServerLock) -> None:
        self._inner = inner
        self._lock = lock

    @property
    def name(self) -> str:
        return str(self._inner.name)


class FakeDatabase(_Locked):
    def __getitem__(self, name: str) -> FakeCollection:
        return FakeCollection(self._inner[name], self._lock)

    def get_collection(self, name: str) -> FakeCollection:
        return self[name]

    def list_collection_names(self, session: Any = None) -> list[str]:
        with self._lock:
            return list(self._inner.list_collection_names())

    def create_collection(self, name: str, **kwargs: Any) -> FakeCollection:
        with self._lock:
            self._lock.wrote()
            self._inner.create_collection(name, **kwargs)
        return self[name]

    def drop_collection(self, name: str) -> None:
        with self._lock:
            self._lock.wrote()
            self._inner.drop_collection(name)


def _unwrap(kwargs: dict[str, Any]) -> dict[str, Any]:
    session = kwargs.get("session")
    if isinstance(session, FakeSession):
        kwargs["session"] = session.inner if session.in_transaction else None
    return kwargs


class FakeCollection(_Locked):
    """Every call runs under the fake server's lock; cursors are materialized inside it."""

    _CURSORS = frozenset({"find", "aggregate", "list_indexes"})
    _READS = frozenset({
        "find", "find_one", "aggregate", "list_indexes", "index_information", "count_documents",
        "estimated_document_count", "distinct", "options",
    })

    def __getattr__(self, attr: str) -> Any:
        method = getattr(self._inner, attr)
        if not callable(method):
            return method
        materialize = attr in self._CURSORS
        writes = attr not in self._READS

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                if writes:
                    self._lock.wrote()
                result = method(*args, **_unwrap(kwargs))
                return list(result) if materialize else result

        return call


class FakeSession:
    """A session whose transaction holds the fake server's lock until it ends."""

    def __init__(self, inner: Any, lock: ServerLock, transactions: bool) -> None:
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
        self._lock.wrote()  # its commit or abort is written when the transaction lets go of the lock
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
