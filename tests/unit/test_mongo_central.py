"""CENTRAL indexes and the relocation directory on MongoDB CENTRAL servers."""

from __future__ import annotations

import pytest
from support.mongo import MongoEnv, UserDocs

from mdb import GDID, DuplicateKeyError, Store
from mdb.central.indexes import CentralIndex, exact, strip_casefold
from mdb.mongo import MongoStore
from mdb.mongo.central import INDEX, MongoCentral
from mdb.mongo.shard_state import STATE, state_id
from mdb.relocations import set_relocation
from mdb.router import Router
from mdb.system_tables import STATE_GONE, STATE_RESIDENT


class DocEmail(CentralIndex):
    name = "doc_email"
    area = "docs"
    unique = True
    normalize = strip_casefold


class DocTag(CentralIndex):
    name = "doc_tag"
    area = "docs"
    unique = False
    normalize = exact


def test_lookup_add_remove_on_mongo_central(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(2, central_on_mongo=2)
    central = MongoCentral(store.mongo)
    a, b = GDID(0, 0, 10), GDID(0, 0, 11)
    emails = [f"User{i}@Example.com " for i in range(20)]
    for i, email in enumerate(emails):
        central.add(DocEmail, email, a if i % 2 else b)
    # entries are spread by FNV-1a of the normalized key, each on the shard the router names
    router = Router(store.map)
    per_server = {s: store.mongo.database(s)[INDEX].count_documents({}) for s in ("c1", "c2")}
    assert sum(per_server.values()) == 20 and all(per_server.values())
    for email in emails:
        nkey = DocEmail.key_of(email)
        server = router.locate_central(nkey).server
        assert store.mongo.database(server)[INDEX].find_one({"key": nkey}) is not None
    assert central.lookup(DocEmail, "  user3@EXAMPLE.com") == a
    assert central.lookup(DocEmail, "nobody@example.com") is None
    central.add(DocEmail, "user3@example.com", a)  # idempotent
    with pytest.raises(DuplicateKeyError):
        central.add(DocEmail, "USER3@example.com", b)
    assert len(central.keys_of(DocEmail, a)) == 10
    assert central.remove(DocEmail, "user3@example.com")
    assert central.lookup(DocEmail, "user3@example.com") is None
    assert not central.remove(DocEmail, "user3@example.com")
    # a non-unique index holds one entry per GDID
    central.add(DocTag, "red", a)
    central.add(DocTag, "red", b)
    assert sorted(central.lookup_all(DocTag, "red")) == sorted([a, b])


def test_create_writes_briefcase_then_key_and_refuses_taken_keys(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(2, central_on_mongo=1)
    central = MongoCentral(store.mongo)
    uid = GDID(0, 0, 21)

    def write() -> None:
        with store.documents(UserDocs, uid) as bc:
            bc.root.insert_one({"email": "new@x"})

    central.create(DocEmail, "New@X", uid, write)
    assert central.lookup(DocEmail, "new@x") == uid
    with store.documents(UserDocs, central.lookup(DocEmail, "new@x"), readonly=True) as bc:
        assert bc.root.find_one()["email"] == "new@x"
    with pytest.raises(DuplicateKeyError):
        central.create(DocEmail, "new@x", GDID(0, 0, 22), lambda: pytest.fail("must not write a briefcase for a taken key"))


def test_relocation_directory_on_mongo_central_routes_sessions(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(2, central_on_mongo=2)
    uid = GDID(0, 0, 3)  # default shard m2
    with store.documents(UserDocs, uid) as bc:
        bc.root.insert_one({"email": "r@x"})
    # hand-made relocation to m1 (what a move leaves): documents, resident record, fence, directory
    docs = list(store.mongo.database("m2")["users"].find({"user_id": bytes(uid)}))
    store.mongo.database("m1")["users"].insert_many(docs)
    store.mongo.database("m2")["users"].delete_many({"user_id": bytes(uid)})
    sid = state_id("docs", uid)
    store.mongo.database("m1")[STATE].insert_one({"_id": sid, "area": "docs", "gdid": bytes(uid), "state": STATE_RESIDENT, "peer": "m2"})
    store.mongo.database("m2")[STATE].insert_one({"_id": sid, "area": "docs", "gdid": bytes(uid), "state": STATE_GONE, "peer": "m1"})
    set_relocation(store, "docs", uid, "m1")
    fresh = Store.from_yaml(store.map_path, types=[])
    MongoStore.attach(fresh, client_factory=mongo_env.factory, types=[UserDocs])
    assert fresh.router.locate("docs", uid).server == "m1"
    with store.documents(UserDocs, uid, readonly=True) as bc:  # the old Store: fenced, refreshed, retried
        assert bc.placement.server == "m1" and bc.root.find_one()["email"] == "r@x"
