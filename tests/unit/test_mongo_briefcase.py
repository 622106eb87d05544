"""Document briefcases on MongoDB: declaration, confinement, transactions, ownership, schema, fan-out."""

from __future__ import annotations

import random

import pytest
from support.mongo import MongoEnv, UserDocs

from mdb import GDID, CrossBriefcaseError, SchemaError, StaleRouteError
from mdb.router import ShardLayout
from mdb.errors import BriefcaseMovingError
from mdb.mongo import DocumentBriefcaseType, MongoIndex
from mdb.backends.mongo import stamp_layout
from mdb.moves.freeze import freeze_partition, unfreeze_partition
from mdb.mongo.shard_state import GUARD, LAYOUT, STATE, set_guard, state_id
from mdb.system_tables import STATE_GONE, STATE_INCOMING

BOTH = pytest.mark.parametrize("transactions", [True, False], ids=["txn", "no-txn"])


def gdid(n: int) -> GDID:
    return GDID(0, 0, n)


def add_user(store, uid: GDID, email: str, orders: int = 0) -> None:
    with store.documents(UserDocs, uid) as bc:
        bc.root.insert_one({"email": email, "name": f"user {uid.counter}"})
        for i in range(orders):
            bc["orders"].insert_one({"_id": GDID(0, 1, uid.counter * 1000 + i), "number": i, "total": (uid.counter * 7 + i * 13) % 50})


# -- declaration --------------------------------------------------------------------------------


def test_unique_index_not_prefixed_by_key_is_refused() -> None:
    with pytest.raises(SchemaError, match="must start with the briefcase key 'owner_id'"):

        class Bad(DocumentBriefcaseType):
            area = "x"
            key = "owner_id"
            root = "owners"
            indexes = (MongoIndex("owners", [("email", 1)], unique=True),)


def test_declaration_errors_name_the_problem() -> None:
    with pytest.raises(SchemaError, match="must set 'root'"):

        class NoRoot(DocumentBriefcaseType):
            area = "x"
            key = "k"

    with pytest.raises(SchemaError, match="listed twice"):

        class Twice(DocumentBriefcaseType):
            area = "x"
            key = "k"
            root = "a"
            children = ("a",)

    with pytest.raises(SchemaError, match="not a collection"):

        class Elsewhere(DocumentBriefcaseType):
            area = "x"
            key = "k"
            root = "a"
            indexes = (MongoIndex("b", [("k", 1)]),)


# -- schema -------------------------------------------------------------------------------------


def test_schema_apply_creates_collections_indexes_and_stamps(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(3)
    for i, server in enumerate(["m1", "m2", "m3"]):
        db = store.mongo.database(server)
        names = set(db.list_collection_names())
        assert {"users", "orders", "events", LAYOUT, STATE, GUARD} <= names
        stamp = db[LAYOUT].find_one({"_id": "docs"})
        assert (stamp["shard_index"], stamp["shard_count"]) == (i, 3)
        index_names = {ix["name"] for ix in db["orders"].list_indexes()}
        assert {"mdb_user_id_id", "user_id_1_number_1", "total_-1"} <= index_names
    from mdb.schema import apply_schema

    again = apply_schema(store)  # idempotent: nothing created, stamps kept
    mongo_reports = [r for r in again if r.server.startswith("m")]
    assert all(r.created == [] and r.kept == ["docs"] for r in mongo_reports)


# -- confinement and transactions ------------------------------------------------------------------


@BOTH
def test_briefcase_isolation(mongo_env: MongoEnv, transactions: bool) -> None:
    store = mongo_env.store(3, transactions=transactions)
    add_user(store, gdid(1), "a@x", orders=3)
    add_user(store, gdid(4), "b@x", orders=2)  # 1 and 4 are both on shard 1 (v mod 3)
    with store.documents(UserDocs, gdid(1), readonly=True) as bc:
        assert bc.placement.server == "m2"
        assert bc.transactional is False  # readonly never opens a transaction
        assert [d["number"] for d in bc["orders"].find(sort=[("number", 1)])] == [0, 1, 2]
        assert bc["orders"].count_documents({}) == 3
        assert bc["orders"].find_one({"number": 0})["user_id"] == gdid(1)
        # a filter naming another briefcase only narrows: it cannot widen
        assert bc["orders"].find({"user_id": gdid(4)}) == []
        assert bc["orders"].aggregate([{"$group": {"_id": None, "n": {"$sum": 1}}}])[0]["n"] == 3
        with pytest.raises(CrossBriefcaseError, match="readonly"):
            bc["orders"].delete_many({})
    with store.documents(UserDocs, gdid(1)) as bc:
        assert bc.transactional is transactions
        assert bc["orders"].delete_many({}).deleted_count == 3
        assert bc["orders"].update_many({}, {"$set": {"x": 1}}).matched_count == 0
        with pytest.raises(CrossBriefcaseError, match="another briefcase|not this briefcase"):
            bc["orders"].insert_one({"_id": GDID(0, 1, 99), "user_id": gdid(4), "number": 9})
        with pytest.raises(CrossBriefcaseError, match="out of its briefcase"):
            bc["orders"].update_many({}, {"$set": {"user_id": gdid(4)}})
        with pytest.raises(CrossBriefcaseError, match=r"\$lookup"):
            bc["orders"].aggregate([{"$lookup": {"from": "users", "localField": "a", "foreignField": "b", "as": "c"}}])
        with pytest.raises(SchemaError, match="needs an _id"):
            bc["orders"].insert_one({"number": 5})
    with store.documents(UserDocs, gdid(4), readonly=True) as bc:
        assert bc["orders"].count_documents({}) == 2
    assert store.mongo.database("m2")["orders"].count_documents({}) == 2


@BOTH
def test_error_in_context(mongo_env: MongoEnv, transactions: bool) -> None:
    """With transactions an error undoes the context's writes; without, earlier writes stay (documented)."""
    store = mongo_env.store(2, transactions=transactions)
    add_user(store, gdid(2), "c@x")
    with pytest.raises(RuntimeError):
        with store.documents(UserDocs, gdid(2)) as bc:
            bc["events"].insert_one({"_id": GDID(0, 2, 1), "kind": "login"})
            raise RuntimeError("application failure")
    with store.documents(UserDocs, gdid(2), readonly=True) as bc:
        assert bc["events"].count_documents({}) == (0 if transactions else 1)


def test_unique_index_prefixed_by_key_is_enforced(mongo_env: MongoEnv) -> None:
    import pymongo.errors

    store = mongo_env.store(2)
    add_user(store, gdid(2), "c@x", orders=1)
    with pytest.raises(pymongo.errors.DuplicateKeyError):
        with store.documents(UserDocs, gdid(2)) as bc:
            bc["orders"].insert_one({"_id": GDID(0, 1, 77), "number": 0})


# -- ownership check (DESIGN invariant 2) -----------------------------------------------------------


@BOTH
def test_fence_redirects_after_refresh_and_wrong_stamp_is_stale(mongo_env: MongoEnv, transactions: bool) -> None:
    store = mongo_env.store(2, transactions=transactions)
    uid = gdid(3)  # shard 1 = m2
    add_user(store, uid, "d@x")
    src = store.mongo.database("m2")
    src[STATE].insert_one({"_id": state_id("docs", uid), "area": "docs", "gdid": bytes(uid), "state": STATE_GONE, "peer": "m1"})
    # the fence sends the session to m1, whose check refuses it: m1 holds no resident record (this
    # fence was written by hand, nothing moved), so nothing is written on either server
    with pytest.raises(StaleRouteError, match=r"server 'm1': routed here away from its default shard \(a fence or the relocation directory\) but the server holds no resident record"):
        with store.documents(UserDocs, uid):
            pass
    src[STATE].delete_one({"_id": state_id("docs", uid)})
    src[LAYOUT].update_one({"_id": "docs"}, {"$set": {"shard_index": 0}})
    with pytest.raises(StaleRouteError, match="stamped"):
        with store.documents(UserDocs, uid, readonly=True):
            pass


def test_incoming_and_guard_make_sessions_wait(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(2)
    store.move_wait_seconds = 0.05
    uid = gdid(3)
    add_user(store, uid, "d@x")
    db = store.mongo.database("m2")
    set_guard(db, "docs", uid, "move-x")
    with pytest.raises(BriefcaseMovingError, match="move-x holds it"):
        with store.documents(UserDocs, uid):
            pass
    with store.documents(UserDocs, uid, readonly=True) as bc:  # readers are not held by a move's lock
        assert bc.root.find_one()["email"] == "d@x"
    set_guard(db, "docs", uid, None)
    db[STATE].insert_one({"_id": state_id("docs", uid), "area": "docs", "gdid": bytes(uid), "state": STATE_INCOMING, "peer": None})
    with pytest.raises(BriefcaseMovingError, match="not finished"):
        with store.documents(UserDocs, uid, readonly=True):
            pass


def test_a_reshards_freeze_and_map_apply_on_mongodb_are_waits_for_readers_and_writers(mongo_env: MongoEnv) -> None:
    """The document side of ADR 0012: partition 0:0:0 of [m1, m2] frozen for [m1, m2, m3] lets
    writes of briefcases that stay on their shard go on and makes the others wait; once m1 is
    re-stamped for the new list (the map apply, before it publishes the map), a reader and a
    writer with the old map both wait and re-read the map (``refresh``), never a StaleRouteError."""
    stays, moves = gdid(6), gdid(8)  # 6: m1 under 2 and 3 shards; 8: m1 now, m3 under the new list
    app = mongo_env.store(2)
    app.move_wait_seconds = 0.05
    for uid in (stays, moves):
        add_user(app, uid, f"{uid.counter}@x")
    freeze_partition(app, "docs", GDID.ZERO, ["m1", "m2"], "reshard-test", new_shards=["m1", "m2", "m3"])
    with app.documents(UserDocs, stays) as bc:
        bc["orders"].insert_one({"_id": GDID(0, 1, 1), "number": 1, "total": 1})
    with pytest.raises(BriefcaseMovingError, match="frozen for writes by reshard reshard-test$"):
        with app.documents(UserDocs, moves):
            pass
    with app.documents(UserDocs, moves, readonly=True) as bc:  # still to move: readable while frozen
        assert bc.root.find_one()["email"] == "8@x"

    assert stamp_layout(app.mongo.database("m1"), ShardLayout("docs", GDID.ZERO, None, 0, 3), 2, replace=True) is None
    for readonly in (True, False):
        with pytest.raises(BriefcaseMovingError, match="reshard-test is applying partition 0:0:0's new map") as caught:
            with app.documents(UserDocs, stays, readonly=readonly):
                pass
        assert caught.value.refresh
    unfreeze_partition(app, "docs", GDID.ZERO, ["m1", "m2"])
    with pytest.raises(StaleRouteError, match="stamped"):  # no reshard holds it: a stamp that differs is a stale route
        with app.documents(UserDocs, stays, readonly=True):
            pass


# -- fan-out ------------------------------------------------------------------------------------------


def test_fan_out_equals_single_collection_reference(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(3)
    rnd = random.Random(7)
    users = [gdid(n) for n in rnd.sample(range(1, 500), 12)]
    for uid in users:
        add_user(store, uid, f"{uid.counter}@x", orders=rnd.randint(0, 4))
    # the reference: every order in one collection of its own
    ref = mongo_env.factory(mongo_env.url("ref"))[mongo_env.url("ref").rsplit("/", 1)[1].split("?")[0]]["orders"]
    for server in ("m1", "m2", "m3"):
        docs = list(store.mongo.database(server)["orders"].find({}))
        if docs:
            ref.insert_many(docs)
    # a fenced leftover on a shard is not authoritative: excluded from the fan-out
    ghost = gdid(999_999)
    store.mongo.database("m1")["orders"].insert_one({"_id": bytes(GDID(0, 9, 1)), "user_id": bytes(ghost), "number": 1, "total": 10})
    store.mongo.database("m1")[STATE].insert_one(
        {"_id": state_id("docs", ghost), "area": "docs", "gdid": bytes(ghost), "state": STATE_GONE, "peer": "m2"}
    )
    cases = [
        ({}, [("total", -1)], 5, 0),
        ({"total": {"$gte": 10}}, [("total", 1), ("number", -1)], 7, 3),
        ({}, [("number", 1)], None, 2),
        ({"number": {"$in": [0, 2]}}, None, None, 0),
    ]
    for flt, sort, limit, skip in cases:
        got = store.mongo.fan_out("docs", "orders", flt, sort=sort, limit=limit, skip=skip)
        full_sort = [*(sort or []), ("_id", 1)]
        expected = list(ref.find(flt, sort=full_sort, skip=skip, limit=limit or 0))
        assert [bytes(d["_id"]) for d in got] == [d["_id"] for d in expected], (flt, sort, limit, skip)
        assert got.complete and sorted(got.servers) == ["m1", "m2", "m3"]
    assert store.mongo.fan_out_count("docs", "orders") == ref.count_documents({})
