"""The in-process MongoDB fake keeps the promises the Mongo tests rely on (see tests/support/mongo.py)."""

from __future__ import annotations

import threading

import pytest

from mdb.testing.mongo import FakeMongo


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
