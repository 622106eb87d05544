"""Backends: one implementation of the server-side interface per server kind, chosen by kind.

A server's kind comes from its URL scheme (:func:`mdb.urls.kind_of_url`, ``PartitionMap.kind_of``);
this registry maps the kind to its :class:`~mdb.backends.base.Backend`. Features ask
:func:`backend_of` for a server's backend instead of testing URLs or dialects, so a new server
kind is one module plus one :func:`register_backend` call (and ``mdb.urls.register_kind`` for
its scheme). Backends are created on first use: the MongoDB one is loaded only when a map has a
MongoDB server, and pymongo stays an optional dependency.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable

from mdb.backends.base import (
    Backend,
    CollectionSpec,
    DocumentServers,
    HasDocuments,
    IndexSpec,
    SchemaOutcome,
    Servers,
    ServerSchema,
    documents_of,
    open_routed,
)
from mdb.errors import RoutingError
from mdb.partition_map import PartitionMap
from mdb.urls import MONGO, SQL

__all__ = [
    "Backend",
    "CollectionSpec",
    "IndexSpec",
    "SchemaOutcome",
    "ServerSchema",
    "DocumentServers",
    "HasDocuments",
    "Servers",
    "backend_for",
    "backend_of",
    "documents_of",
    "open_routed",
    "register_backend",
    "servers_where",
]

BackendFactory = Callable[[], Backend]

_factories: dict[str, BackendFactory] = {}
_instances: dict[str, Backend] = {}
_lock = threading.Lock()


def register_backend(kind: str, factory: BackendFactory) -> None:
    """Serve servers of ``kind`` with the backend ``factory`` builds (once, on first use).

    A kind has one backend: registering a second one is a mistake that would make the choice
    depend on import order, so it fails.
    """
    with _lock:
        if kind in _factories:
            raise ValueError(f"server kind {kind!r} already has a backend")
        _factories[kind] = factory


def backend_for(kind: str) -> Backend:
    """The backend of server kind ``kind``."""
    backend = _instances.get(kind)
    if backend is not None:
        return backend
    with _lock:
        factory = _factories.get(kind)
        if factory is None:
            raise RoutingError(f"no backend serves servers of kind {kind!r} (known: {', '.join(sorted(_factories))})")
        backend = _instances.get(kind)
        if backend is None:
            backend = _instances[kind] = factory()
        if backend.kind != kind:
            raise RoutingError(f"the backend registered for kind {kind!r} implements kind {backend.kind!r}")
        return backend


def backend_of(pmap: PartitionMap, server: str) -> Backend:
    """The backend of ``server`` (by the kind of its primary URL)."""
    return backend_for(pmap.kind_of(server))


def servers_where(pmap: PartitionMap, capable: Callable[[Backend], bool], servers: Iterable[str] | None = None) -> list[str]:
    """The servers of ``pmap`` (or of ``servers``, in their order) whose backend ``capable`` accepts.

    How a feature picks the servers it can work on: by what their backend can do
    (``lambda b: b.follows_histories``), not by which kind they are.
    """
    return [s for s in (pmap.servers if servers is None else servers) if capable(backend_of(pmap, s))]


def _lazy(module: str, name: str) -> BackendFactory:
    """A factory that imports ``module`` only when the kind is first used."""

    def build() -> Backend:
        backend: Backend = getattr(importlib.import_module(module), name)()
        return backend

    return build


register_backend(SQL, _lazy("mdb.backends.sql", "SqlBackend"))
register_backend(MONGO, _lazy("mdb.backends.mongo", "MongoBackend"))
