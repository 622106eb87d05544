"""Server name -> pymongo client: lazy, one client per URL, primary or secondary reads.

The MongoDB counterpart of :mod:`mdb.engines`: it knows nothing of GDIDs or areas. A map server
whose primary URL starts with ``mongodb://`` or ``mongodb+srv://`` is a MongoDB server; its
database is the URL's path (``mongodb://h/user_1`` -> ``user_1``; ``mdb`` when the path is
empty). Readonly work goes to the map's replica URL when there is one, otherwise to the primary
URL with read preference ``secondaryPreferred``. The client factory is pluggable so that the
same code runs against a real server (``pymongo.MongoClient``) or the in-process fake
(:mod:`mdb.testing.mongo`). URLs are masked in every repr and error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from mdb.errors import RoutingError, ServerUnavailableError
from mdb.partition_map import PartitionMap, ServerSpec
from mdb.servers import ServerDirectory
from mdb.urls import MONGO, kind_of_url, mask_secrets, mask_url

__all__ = [
    "ClientFactory",
    "MongoClients",
    "database_name",
    "is_mongo_url",
    "pymongo_factory",
    "supports_transactions",
]

DEFAULT_DATABASE = "mdb"

ClientFactory = Callable[..., Any]
"""``factory(url, **client_options) -> MongoClient``-like object."""


def is_mongo_url(url: str) -> bool:
    return kind_of_url(url) == MONGO


def mongo_servers(pmap: PartitionMap) -> list[str]:
    """Names of the map's servers that are MongoDB servers."""
    return [name for name, spec in pmap.servers.items() if is_mongo_url(spec.primary)]


def database_name(url: str) -> str:
    path = urlsplit(url.strip()).path.lstrip("/")
    return path or DEFAULT_DATABASE


def pymongo_factory(url: str, **options: Any) -> Any:
    """A real client; connects lazily, fails fast (5 s) when the server cannot be reached."""
    import pymongo

    options.setdefault("serverSelectionTimeoutMS", 5000)
    options.setdefault("uuidRepresentation", "standard")
    return pymongo.MongoClient(url, **options)


def supports_transactions(client: Any) -> bool:
    """True when the deployment runs multi-document transactions (replica set or mongos).

    A standalone ``mongod`` refuses them; the fake says what it was configured to do.
    """
    declared = getattr(client, "mdb_supports_transactions", None)
    if declared is not None:
        return bool(declared)
    hello = client.admin.command("hello")
    return bool(hello.get("setName")) or hello.get("msg") == "isdbgrid"


class MongoClients(ServerDirectory):
    """Lazily created clients for the MongoDB servers of a map (the EngineRegistry of documents)."""

    def __init__(
        self, servers: Mapping[str, ServerSpec], factory: ClientFactory | None = None, *, transactions: bool | None = None
    ) -> None:
        super().__init__(servers)
        self.factory: ClientFactory = factory or pymongo_factory
        self.force_transactions = transactions
        """None: ask each server; False: never use transactions (e.g. to measure or test that path)."""
        self._clients: dict[tuple[str, bool], Any] = {}
        self._transactions: dict[str, bool] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MongoClients(servers={sorted(self.server_names)}, open={len(self._clients)})"

    @property
    def server_names(self) -> list[str]:
        return [name for name, spec in self._servers.items() if is_mongo_url(spec.primary)]

    def is_mongo(self, server: str) -> bool:
        return is_mongo_url(self.spec(server).primary)

    def client(self, server: str, readonly: bool = False) -> Any:
        spec = self.spec(server)
        if not is_mongo_url(spec.primary):
            raise RoutingError(f"server {server!r} is not a MongoDB server ({mask_url(spec.primary)})")
        url = self.url(server, readonly)
        secondary = readonly and spec.replica is None
        key = (url, secondary)
        client = self._clients.get(key)
        if client is not None:
            return client
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                options: dict[str, Any] = {"readPreference": "secondaryPreferred"} if secondary else {}
                try:
                    client = self.factory(url, **options)
                except Exception as exc:
                    raise ServerUnavailableError(server, mask_secrets(str(exc), self._secrets(spec))) from None
                self._clients[key] = client
        return client

    def database(self, server: str, readonly: bool = False) -> Any:
        spec = self.spec(server)
        url = spec.replica if readonly and spec.replica else spec.primary
        return self.client(server, readonly)[database_name(url)]

    def transactions(self, server: str) -> bool:
        """Whether ``server`` runs multi-document transactions (asked once, then cached)."""
        known = self._transactions.get(server)
        if known is None and self.force_transactions is False:
            return False
        if known is None:
            try:
                known = supports_transactions(self.client(server))
            except Exception as exc:
                raise self.unavailable(server, exc) from None
            self._transactions[server] = known
        return known

    def unavailable(self, server: str, exc: BaseException) -> ServerUnavailableError:
        """A driver error as an mdb error, the URL's secrets masked."""
        return ServerUnavailableError(server, mask_secrets(f"{type(exc).__name__}: {exc}", self._secrets(self.spec(server))))

    @staticmethod
    def _secrets(spec: ServerSpec) -> list[str]:
        out = []
        for url in (spec.primary, spec.replica):
            if url:
                password = urlsplit(url.strip()).password
                if password:
                    out.append(password)
        return out

    def update(self, servers: Mapping[str, ServerSpec]) -> None:
        with self._lock:
            live = self._adopt(servers)
            for key in [k for k in self._clients if k[0] not in live]:
                self._clients.pop(key).close()

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
