"""Moving document briefcases: verification, fence, relocation, and resume after a crash at every step.

The fake MongoDB server lives in the test process, so a crash is simulated by raising at the
move's named fault points (``mdb.moves.document_move.FAULT_POINTS``, through ``mdb.faults.hook``)
and then resuming with a fresh Store; tests/faults/test_moves_documents_cli.py SIGKILLs real CLI processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mdb import GDID, Store
from mdb.moves.journal import DONE, ROLLED_BACK, Journal
from mdb import faults
from mdb.errors import MoveAbortedError
from mdb.moves import document_move as moves
from mdb.mongo import MongoStore
from mdb.mongo.hot import MongoCounter, MongoStatsLock
from mdb.moves.document_move import FAULT_POINTS as HOOK_POINTS, checksums, move_documents
from mdb.moves.resume import resume_all as resume_mongo_moves
from mdb.mongo.shard_state import STATE, state_id
from support.mongo import MongoEnv, UserDocs

UID = GDID(0, 0, 4)  # v mod 3 = 1 -> m2
COUNTER = MongoCounter("logins", slots=2)


class SimulatedCrash(BaseException):
    """Raised at a hook point: nothing after it runs, like a killed process."""


@pytest.fixture(autouse=True)
def _no_hook() -> Iterator[None]:
    yield
    faults.hook = None


def fill(store: Store) -> None:
    with store.documents(UserDocs, UID) as bc:
        bc.root.insert_one({"email": "m@x", "tags": ["a", {"b": 1}]})
        bc["orders"].insert_many([{"_id": GDID(0, 1, 40 + i), "number": i, "total": i * 3} for i in range(5)])
        bc["events"].insert_one({"_id": {"user_id": UID, "seq": 1}, "kind": "signup"})
        COUNTER.add(bc, n=3)
        MongoStatsLock().apply(bc, "e1", "active", "overall", lambda b: COUNTER.add(b, n=1))


def holders(store: Store) -> dict[str, int]:
    return {s: store.mongo.database(s)["orders"].count_documents({"user_id": bytes(UID)}) for s in ("m1", "m2", "m3")}


def read_back(store: Store) -> tuple[str, int, dict[str, int]]:
    with store.documents(UserDocs, UID, readonly=True) as bc:
        return bc.placement.server, bc["orders"].count_documents({}), COUNTER.read(bc)


@pytest.mark.parametrize("transactions", [True, False], ids=["txn", "no-txn"])
def test_move_and_move_back(mongo_env: MongoEnv, transactions: bool) -> None:
    store = mongo_env.store(3, transactions=transactions)
    fill(store)
    before = checksums(store.mongo.database("m2"), UserDocs, UID)
    result = move_documents(store, UserDocs, UID, "m3")
    assert result.documents["orders"] == 5 and result.documents["mdb_counters"] >= 1
    assert checksums(store.mongo.database("m3"), UserDocs, UID) == before
    assert holders(store) == {"m1": 0, "m2": 0, "m3": 5}
    assert read_back(store) == ("m3", 5, {"n": 4})
    assert store.mongo.database("m2")[STATE].find_one({"_id": state_id("docs", UID)})["state"] == "gone"
    # a Store that still routes by the old directory is redirected by the fence
    stale = mongo_env.store(3, transactions=transactions)
    with stale.documents(UserDocs, UID) as bc:
        assert bc.placement.server == "m3"
        bc["orders"].insert_one({"_id": GDID(0, 1, 99), "number": 99, "total": 1})
    assert store.mongo.fan_out_count("docs", "orders") == 6
    # and home again: the default shard holds it with no state document
    move_documents(store, UserDocs, UID, "m2")
    assert holders(store) == {"m1": 0, "m2": 6, "m3": 0}
    assert read_back(store) == ("m2", 6, {"n": 4})
    assert store.mongo.database("m2")[STATE].find_one({"_id": state_id("docs", UID)}) is None
    assert [e.status for e in Journal(store).entries() if e.kind == moves.KIND] == [DONE, DONE]


@pytest.mark.parametrize("transactions", [True, False], ids=["txn", "no-txn"])
@pytest.mark.parametrize("point", HOOK_POINTS)
def test_crash_at_every_point_then_resume(mongo_env: MongoEnv, point: str, transactions: bool) -> None:
    store = mongo_env.store(3, transactions=transactions)
    fill(store)
    before = checksums(store.mongo.database("m2"), UserDocs, UID)

    def crash(name: str) -> None:
        if name == point:
            raise SimulatedCrash(name)

    faults.hook = crash
    with pytest.raises(SimulatedCrash):
        move_documents(store, UserDocs, UID, "m3")
    faults.hook = None
    fresh = Store.from_yaml(store.map_path, types=[])
    MongoStore.attach(fresh, client_factory=mongo_env.factory, types=[UserDocs], transactions=transactions)
    outcome = resume_mongo_moves(fresh)
    assert len(outcome) == 1
    # with transactions the fence and the deletions commit together (a crash between them aborts
    # both); without, the fence document alone is the commit point
    first_committed = "mongo.move.after_commit_point" if transactions else "mongo.move.after_fence"
    committed = HOOK_POINTS.index(point) >= HOOK_POINTS.index(first_committed)
    home = "m3" if committed else "m2"
    assert holders(fresh) == {s: (5 if s == home else 0) for s in ("m1", "m2", "m3")}
    assert checksums(fresh.mongo.database(home), UserDocs, UID) == before
    assert read_back(fresh) == (home, 5, {"n": 4})
    status = Journal(fresh).entries()[0].status
    assert status == (DONE if committed else ROLLED_BACK)
    with fresh.documents(UserDocs, UID) as bc:  # writable again: the lock is gone
        bc["orders"].insert_one({"_id": GDID(0, 1, 98), "number": 98, "total": 0})
    assert resume_mongo_moves(fresh) == []  # nothing left to do


def test_verification_failure_rolls_back(mongo_env: MongoEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    store = mongo_env.store(3)
    fill(store)

    def corrupt(name: str) -> None:
        if name == "mongo.move.after_copy":
            store.mongo.database("m3")["orders"].update_one({"user_id": bytes(UID)}, {"$set": {"total": -1}})

    faults.hook = corrupt
    with pytest.raises(MoveAbortedError, match="rolled back"):
        move_documents(store, UserDocs, UID, "m3")
    assert holders(store) == {"m1": 0, "m2": 5, "m3": 0}
    assert store.mongo.database("m3")[STATE].find_one({"_id": state_id("docs", UID)}) is None
    assert read_back(store) == ("m2", 5, {"n": 4})
    assert Journal(store).entries()[0].status == ROLLED_BACK
