"""``mdb balance`` / ``rebalance --plan`` / ``fsck`` on a document area (issue 17 for MongoDB shards).

Run on the in-process fake MongoDB (or ``MDB_TEST_MONGO_URI``): the fleet tools read every
server through its backend's scan, so a document area is measured (documents, BSON bytes, the
largest briefcases) and checked like a SQL one. The figures are compared with an independent
count made here with plain ``find`` calls; fsck's planted defects are the document forms of the
SQL ones (a misplaced document, a verified leftover copy, the copy of a crashed move, a stale
``incoming`` row with its copy, a stale fence, an orphan relocation entry); ``--repair``
removes only the verified copies (with their ``incoming`` row) and the fence whose peer holds
nothing, each under the briefcase's guard on that server.
"""

from __future__ import annotations

from typing import Any

import bson
import pytest
from support.mongo import MongoEnv, UserDocs

from mdb import GDID, Store
from mdb.fleet.balance import balance
from mdb.fleet.fsck import RESUME, FsckReport, fsck
from mdb.fleet.rebalance import apply_plan, plan_rebalance
from mdb import faults
from mdb.moves.document_move import move_documents
from mdb.mongo.shard_state import STATE, state_id
from mdb.relocations import set_relocation
from mdb.system_tables import STATE_GONE, STATE_INCOMING

SHARDS = ["m1", "m2", "m3", "m4"]
USERS = [GDID(0, 0, i) for i in range(1, 25)]


class Crash(BaseException):
    """Raised at a move's hook point: nothing after it runs, like a killed mover."""


def fill(store: Store, g: GDID, orders: int) -> None:
    with store.documents(UserDocs, g) as bc:
        bc.root.insert_one({"email": f"{g}@x", "name": "n" * 40})
        bc["orders"].insert_many([{"_id": GDID(1, 0, g.counter * 100 + i), "number": i, "total": i, "note": "x" * 60} for i in range(orders)])


def skewed(env: MongoEnv) -> Store:
    """4 document shards; the briefcases routed to m1 hold 3x the bytes of the others'."""
    store = env.store(4)
    home = {g: store.router.locate("docs", g).server for g in USERS}
    assert sorted(set(home.values())) == SHARDS and sum(1 for s in home.values() if s == "m1") == 6
    for g in USERS:
        fill(store, g, 11 if home[g] == "m1" else 3)  # a root of ~1/5 of 3 orders: 11 orders make 3x the bytes
    return store


def independent(store: Store) -> dict[str, tuple[int, int, int]]:
    """server -> (briefcases, documents, BSON bytes), counted with plain finds."""
    out = {}
    for server in SHARDS:
        db = store.mongo.database(server)
        keys: set[bytes] = set()
        docs = size = 0
        for name in UserDocs.collections:
            for doc in db[name].find({}):
                keys.add(bytes(doc["user_id"]))
                docs += 1
                size += len(bson.encode(doc))
        out[server] = (len(keys), docs, size)
    return out


def snapshot(store: Store) -> dict[str, list[Any]]:
    return {s: sorted((repr(d) for n in (*UserDocs.collections, STATE) for d in store.mongo.database(s)[n].find({})))
            for s in SHARDS}


@pytest.fixture(autouse=True)
def _no_hook() -> Any:
    yield
    faults.hook = None


def test_balance_measures_documents_and_the_skew(mongo_env: MongoEnv) -> None:
    store = skewed(mongo_env)
    report = balance(store, "docs", top=3)
    assert {s.server: (s.briefcases, s.rows, s.bytes) for s in report.servers} == independent(store)
    assert all(s.measured for s in report.servers)
    by_bytes = {s.server: s.bytes for s in report.servers}
    assert all(2.85 <= by_bytes["m1"] / by_bytes[s] <= 3.15 for s in SHARDS[1:]), by_bytes  # one shard with 3x the bytes
    skew = report.skew("bytes")
    assert max(skew, key=lambda k: skew[k]) == "m1" and skew["m1"] > 0.5, skew
    assert [srv for srv, _ in report.largest()] == ["m1"] * 3
    if not mongo_env.real:
        assert all(s.disk_bytes is None for s in report.servers), "the fake has no $collStats: unknown, not 0"
    assert report.to_json()["max_skew"]["bytes"] > 0.5


def test_a_rebalance_plan_for_documents_evens_the_bytes(mongo_env: MongoEnv) -> None:
    store = skewed(mongo_env)
    plan = plan_rebalance(store, "docs", by="bytes")
    assert plan.moves and all(m.source == "m1" for m in plan.moves)
    assert plan.max_skew(plan.before) > 0.5 and plan.max_skew(plan.after) < 0.10, plan.to_json()
    outcome = apply_plan(store, plan)  # a rebalance job; document briefcases move one at a time through it
    assert (outcome.kind, outcome.moved, outcome.planned) == ("rebalance", len(plan.moves), len(plan.moves)), outcome
    store.refresh()
    assert [store.router.locate("docs", m.gdid).server for m in plan.moves] == [m.target for m in plan.moves]
    after = balance(store, "docs")
    assert max(abs(v) for v in after.skew("bytes").values()) < 0.10, {s.server: s.bytes for s in after.servers}
    assert sum(s.briefcases for s in after.servers) == len(USERS)


def _found(report: FsckReport) -> set[tuple[str, str, str | None, str]]:
    return {(f.kind, f.server, None if f.gdid is None else str(f.gdid), f.action) for f in report.findings}


def _copy(store: Store, g: GDID, source: str, target: str) -> None:
    src, dst = store.mongo.database(source), store.mongo.database(target)
    for name in UserDocs.collections:
        docs = list(src[name].find({"user_id": bytes(g)}))
        if docs:
            dst[name].insert_many(docs)


def test_fsck_on_documents_finds_each_planted_defect_and_repairs_only_the_safe_ones(mongo_env: MongoEnv) -> None:
    store = mongo_env.store(4)
    for g in USERS[:12]:
        fill(store, g, 2)
    owner = {g: store.router.locate("docs", g).server for g in USERS}
    moved = USERS[0]
    move_documents(store, UserDocs, moved, "m4" if owner[moved] != "m4" else "m3")  # a finished move: normal
    clean = fsck(store, "docs")
    assert clean.clean and clean.briefcases == 12 and clean.not_checked == [], [f.to_json() for f in clean.findings]

    owner = {g: store.router.locate("docs", g).server for g in [*USERS, GDID(0, 0, 500)]}  # before planting

    def other(g: GDID) -> str:
        return next(s for s in SHARDS if s != owner[g])

    def crash(name: str) -> None:
        if name == "mongo.move.after_copy":
            raise Crash(name)

    wrong, leftover, crashed, stale_in, fenced, ghost = USERS[2], USERS[3], USERS[4], USERS[5], USERS[6], USERS[7]
    impostor = GDID(0, 0, 500)  # a briefcase nobody created, routed elsewhere
    # a misplaced document: the owner does not hold it
    store.mongo.database(other(impostor))["users"].insert_one({"_id": bytes(impostor), "user_id": bytes(impostor), "email": "i@x"})
    # a copy the owner holds identically (a leftover)
    _copy(store, leftover, owner[leftover], other(leftover))
    # a copy of the same briefcase that differs (misplaced, it may be the only copy of that edit)
    _copy(store, wrong, owner[wrong], other(wrong))
    store.mongo.database(other(wrong))["orders"].update_many({"user_id": bytes(wrong)}, {"$set": {"total": -1}})
    # a move that crashed after its copy: the journal still says running
    faults.hook = crash
    with pytest.raises(Crash):
        move_documents(store, UserDocs, crashed, other(crashed))
    faults.hook = None
    # an incoming row of a move the journal never heard of, with its copy
    _copy(store, stale_in, owner[stale_in], other(stale_in))
    store.mongo.database(other(stale_in))[STATE].insert_one(
        {"_id": state_id("docs", stale_in), "area": "docs", "gdid": bytes(stale_in), "state": STATE_INCOMING, "peer": owner[stale_in], "move_id": "move-lost"})
    # a fence on the owner whose peer holds nothing
    store.mongo.database(owner[fenced])[STATE].insert_one(
        {"_id": state_id("docs", fenced), "area": "docs", "gdid": bytes(fenced), "state": STATE_GONE, "peer": other(fenced), "move_id": "move-gone"})
    # a relocation entry sending a briefcase where none of it is
    set_relocation(store, "docs", ghost, other(ghost))
    before = snapshot(store)

    expected = {
        ("misplaced", other(impostor), str(impostor), "reported"),
        ("leftover_copy", other(leftover), str(leftover), "reported"),
        ("misplaced", other(wrong), str(wrong), "reported"),
        ("unfinished_move", other(crashed), str(crashed), RESUME),
        ("stale_incoming", other(stale_in), str(stale_in), "reported"),
        ("leftover_copy", other(stale_in), str(stale_in), "reported"),
        ("stale_fence", owner[fenced], str(fenced), "reported"),
        ("orphan_relocation", other(ghost), str(ghost), "reported"),
        ("misplaced", owner[ghost], str(ghost), "reported"),  # its documents, now routed away (as on SQL)
    }
    assert _found(fsck(store, "docs")) == expected
    assert snapshot(store) == before, "fsck without --repair changes nothing"

    safe = {("leftover_copy", other(leftover), str(leftover)), ("leftover_copy", other(stale_in), str(stale_in)),
            ("stale_fence", owner[fenced], str(fenced))}
    repaired = fsck(store, "docs", repair=True)
    assert _found(repaired) == {(k, srv, g, "repaired" if (k, srv, g) in safe else a) for k, srv, g, a in expected}
    left = {(k, srv, g, a) for k, srv, g, a in expected if (k, srv, g) not in safe and k != "stale_incoming"}
    assert _found(fsck(store, "docs")) == left, "the incoming row went with its copy"
    after = snapshot(store)
    for g in (leftover, stale_in):  # the copies are gone, the owners' documents stay
        assert store.mongo.database(other(g))["users"].count_documents({"user_id": bytes(g)}) == 0
        assert store.mongo.database(owner[g])["users"].count_documents({"user_id": bytes(g)}) == 1
    assert store.mongo.database(other(stale_in))[STATE].count_documents({"gdid": bytes(stale_in)}) == 0
    for srv in SHARDS:  # everything unsafe is untouched
        keep = [d for d in before[srv] if all(repr(bytes(g)) not in d for g in (leftover, stale_in, fenced))]
        assert [d for d in after[srv] if all(repr(bytes(g)) not in d for g in (leftover, stale_in, fenced))] == keep
    with store.documents(UserDocs, fenced) as bc:  # the fenced briefcase is reachable and writable again
        assert bc.root.find_one()["email"] == f"{fenced}@x"
