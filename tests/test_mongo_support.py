"""MongoDB test harness: the same tests run on the in-process fake or on a real server.

``mongo_env`` yields a :class:`MongoEnv` whose ``factory`` is a client factory: a
:class:`mdb.mongo.FakeMongo` by default, ``pymongo.MongoClient`` when ``MDB_TEST_MONGO_URI``
names a real server (each test then gets its own databases ``mdbt_<random>_<name>``, dropped
afterwards). ``transactions`` is parametrized where a test must cover both the transactional
path (replica set / mongos) and the standalone path. The fake is in-process, so crash tests
raise at named hook points instead of SIGKILLing (the SQL move tests use real SIGKILL).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from mapfiles import write_map
from mdb import Store
from mdb.mongo import DocumentBriefcaseType, FakeMongo, MongoIndex, MongoStore
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


@pytest.fixture
def mongo_env(tmp_path: Path) -> Iterator[MongoEnv]:
    prefix = f"mdbt_{uuid.uuid4().hex[:10]}"
    env = MongoEnv(pymongo_factory if REAL_URI else FakeMongo(), bool(REAL_URI), prefix, tmp_path)
    yield env
    if env.real:
        client = pymongo_factory(REAL_URI)
        try:
            for name in client.list_database_names():
                if name.startswith(prefix):
                    client.drop_database(name)
        finally:
            client.close()


def test_fake_inc_is_atomic_under_threads() -> None:
    """The fake's per-server lock makes $inc atomic (mongomock alone loses updates under threads)."""
    client = FakeMongo()("mongodb://x/db")
    coll = client["db"]["c"]
    coll.insert_one({"_id": 1, "v": 0})

    def bump() -> None:
        for _ in range(500):
            coll.update_one({"_id": 1}, {"$inc": {"v": 1}})

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert coll.find_one({"_id": 1})["v"] == 2000


def test_fake_transaction_abort_keeps_other_threads_commits() -> None:
    fake = FakeMongo()
    client = fake("mongodb://x/db")
    coll = client["db"]["c"]
    session = client.start_session()
    session.start_transaction()
    coll.insert_one({"_id": "in-txn"}, session=session)
    done = threading.Event()

    def other() -> None:
        fake("mongodb://x/db")["db"]["c"].insert_one({"_id": "other"})
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert not done.wait(0.2)  # blocked: the transaction holds the fake server
    session.abort_transaction()
    t.join()
    assert sorted(d["_id"] for d in coll.find({})) == ["other"]


def test_fake_without_transactions_refuses_them() -> None:
    import pymongo.errors

    client = FakeMongo(transactions=False)("mongodb://x/db")
    with pytest.raises(pymongo.errors.OperationFailure):
        client.start_session().start_transaction()
