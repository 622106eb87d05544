"""MongoDB test harness: the same tests run on the in-process fake or on a real server.

The ``mongo_env`` fixture (in conftest.py) yields a :class:`MongoEnv` whose ``factory`` is a
client factory: a :class:`mdb.testing.mongo.FakeMongo` by default, ``pymongo.MongoClient`` when
``MDB_TEST_MONGO_URI`` names a real server (each test then gets its own databases
``mdbt_<random>_<name>``, dropped afterwards by :meth:`MongoEnv.drop`). ``transactions`` is
parametrized where a test must cover both the transactional path (replica set / mongos) and the
standalone path. The fake is in-process, so crash tests raise at named hook points instead of
SIGKILLing (the SQL move tests use real SIGKILL).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from support.mapfiles import write_map

from mdb import Store
from mdb.mongo import DocumentBriefcaseType, MongoIndex, MongoStore
from mdb.testing.mongo import FakeMongo
from mdb.mongo.clients import pymongo_factory
from mdb.schema import apply_schema

REAL_URI = os.environ.get("MDB_TEST_MONGO_URI", "").strip()


class UserDocs(DocumentBriefcaseType):
    area = "docs"
    key = "user_id"
    root = "users"
    children = ("orders", "events")
    indexes = (
        MongoIndex("users", [("user_id", 1), ("email", 1)], unique=True),
        MongoIndex("orders", [("user_id", 1), ("number", 1)], unique=True),
        MongoIndex("orders", [("total", -1)]),
    )


@dataclass
class MongoEnv:
    factory: Any
    real: bool
    prefix: str
    tmp_path: Path
    urls: dict[str, str] = field(default_factory=dict)

    def url(self, name: str) -> str:
        if not self.real:
            return f"mongodb://fake-{name}/{name}"
        parts = urlsplit(REAL_URI)
        url = urlunsplit((parts.scheme, parts.netloc, f"/{self.prefix}_{name}", parts.query, ""))
        self.urls[name] = url
        return url

    def store(self, shards: int = 3, *, transactions: bool | None = None, central_on_mongo: int = 0) -> Store:
        """A Store with ``shards`` MongoDB shards for area ``docs``, schema applied.

        CENTRAL is one SQLite file, or ``central_on_mongo`` MongoDB servers.
        """
        names = [f"m{i}" for i in range(1, shards + 1)]
        central = [f"c{i}" for i in range(1, central_on_mongo + 1)] or ["c"]
        if central_on_mongo:
            servers = {c: self.url(c) for c in central}
        else:
            servers = {"c": f"sqlite:///{self.tmp_path / 'central.db'}"}
        servers.update({n: self.url(n) for n in names})
        path = write_map(self.tmp_path, servers, central=central, partitions=[("0:0:0", names)], area="docs")
        store = Store.from_yaml(path, types=[])
        MongoStore.attach(store, client_factory=self.factory, types=[UserDocs], transactions=transactions)
        reports = apply_schema(store)
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
        return store

    @classmethod
    def create(cls, tmp_path: Path) -> MongoEnv:
        prefix = f"mdbt_{uuid.uuid4().hex[:10]}"
        return cls(pymongo_factory if REAL_URI else FakeMongo(), bool(REAL_URI), prefix, tmp_path)

    def drop(self) -> None:
        """Drop this test's databases on the real server (the fake needs nothing)."""
        if not self.real:
            return
        client = pymongo_factory(REAL_URI)
        try:
            for name in client.list_database_names():
                if name.startswith(self.prefix):
                    client.drop_database(name)
        finally:
            client.close()
