"""`mdb reshard` of a document area through the CLI: the same driver, journal, verification and resume as SQL.

The MongoDB servers are the file-backed fake (``MDB_MONGO_FAKE_DIR``), so a CLI process
SIGKILLed mid-reshard (``MDB_FAULT_POINT``) leaves what it committed for ``mdb moves resume``
in the next process, as real servers would. The area's partition starts on m1,m2 (m3 a spare)
and is resharded onto m1,m2,m3: every briefcase must end on ``m[v mod 3]`` exactly once, with
the documents it had (same checksums), routed there by default (no relocation left).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from support.documents import Env, forget_cli_docs  # noqa: F401 (autouse here too)

from mdb import GDID
from mdb.errors import BriefcaseMovingError
from mdb.moves.document_move import checksums
from mdb.moves.freeze import freeze_partition, frozen_by, unfreeze_partition
from mdb.moves.journal import DONE, Journal
from mdb.schema import apply_schema

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

pytest.importorskip("mongomock_ng")

OLD = ("m1", "m2")
NEW = ("m1", "m2", "m3")
START = GDID(0, 0, 0)
USERS = [GDID(0, 0, v) for v in range(1, 13)]


@pytest.fixture
def env(tmp_path: Path) -> Env:
    env = Env(tmp_path, shards=OLD)
    store = env.store()
    reports = apply_schema(store)
    assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    for n, uid in enumerate(USERS):
        with store.documents(env.dtype, uid) as bc:
            bc.root.insert_one({"email": f"{n}@x"})
            bc["orders"].insert_many([{"_id": GDID(0, 1, 100 * n + i), "number": i, "total": n + i} for i in range(n % 4 + 1)])
    return env


def snapshot(env: Env) -> dict[GDID, dict[str, tuple[int, str]]]:
    """Each briefcase's checksums where it is routed now (asserting it is held there only)."""
    store = env.store()
    store.refresh()
    out = {}
    for uid in USERS:
        server = store.router.locate("docs", uid).server
        held = [s for s in NEW if store.mongo.database(s)["users"].count_documents({"user_id": bytes(uid)})]
        assert held == [server], f"{uid} routed to {server!r}, held by {held}"
        out[uid] = checksums(store.mongo.database(server), env.dtype, uid)
    return out


def assert_resharded(env: Env, before: dict[GDID, dict[str, tuple[int, str]]]) -> None:
    """Every briefcase on its new default shard, exactly once, unchanged; the area writable; nothing left over."""
    store = env.store()
    store.refresh()
    assert [list(p[2]) for p in store.router.partitions("docs")] == [list(NEW)]
    assert not store.router.relocations
    for uid in USERS:
        home = NEW[uid.sharding_value % len(NEW)]
        for server in NEW:
            db = store.mongo.database(server)
            docs = sum(db[c].count_documents({"user_id": bytes(uid)}) for c in ("users", "orders"))
            assert (docs > 0) == (server == home), f"{uid}: {docs} documents on {server!r} (home {home!r})"
        assert checksums(store.mongo.database(home), env.dtype, uid) == before[uid], uid
        assert store.mongo.database(home)["mdb_briefcase_state"].find_one({"gdid": bytes(uid)}) is None  # no 'resident' left
    for server in OLD:
        assert frozen_by(store, "docs", START, server) is None, server
    with store.documents(env.dtype, USERS[1]) as bc:  # v=2: routed by the new map's stamps, and writable (not frozen)
        assert bc.placement.server == "m3"
        bc["orders"].insert_one({"_id": GDID(0, 2, 1), "number": 99, "total": 0})
    assert Journal(store).entries(unfinished=True) == []


def test_reshard_of_a_document_area_moves_every_briefcase_once(env: Env) -> None:
    before = snapshot(env)
    code, out, err = env.cli("reshard", "MAP", "docs", "--partition", "0:0:0", "--shards", ",".join(NEW), "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    moving = [u for u in USERS if NEW[u.sharding_value % 3] != OLD[u.sharding_value % 2]]
    assert plan["briefcases_in_partition"] == len(USERS) and plan["briefcases_to_move"] == len(moving)
    code, out, err = env.cli("reshard", "MAP", "docs", "--partition", "0:0:0", "--shards", ",".join(NEW))
    assert code == 0, err
    assert_resharded(env, before)
    reshards = [e for e in Journal(env.store()).entries() if e.kind == "reshard"]
    assert len(reshards) == 1 and reshards[0].status == DONE and reshards[0].briefcases_done == len(moving)
    moves = Journal(env.store()).moves_of(reshards[0].move_id)
    assert {m.kind for m in moves} == {"mongo-move"} and {m.gdid for m in moves} == set(moving)
    code, out, err = env.cli("moves", "status", "MAP")
    assert code == 0 and reshards[0].move_id in out, (out, err)


@pytest.mark.parametrize(
    "point", ["reshard.after_first_move", "reshard.during_freeze", "reshard.after_freeze", "reshard.before_map_apply"]
)
def test_sigkilled_document_reshard_is_finished_by_moves_resume(env: Env, point: str) -> None:
    before = snapshot(env)
    code, _, err = env.cli("reshard", "MAP", "docs", "--partition", "0:0:0", "--shards", ",".join(NEW), fault=point)
    assert code == -signal.SIGKILL, f"{point}: the CLI was not killed there: {code} {err}"
    (entry,) = [e for e in Journal(env.store()).entries(unfinished=True) if e.kind == "reshard"]
    code, out, err = env.cli("moves", "status", "MAP")
    assert code == 0, err
    assert entry.move_id in out and "docs" in out, out  # the interrupted reshard is listed
    code, out, err = env.cli("moves", "resume", "MAP")
    assert code == 0, err
    assert "reshard completed" in out and f"was at step {entry.step!r}" in out, out
    assert_resharded(env, before)


def test_a_frozen_partition_turns_document_writers_away_until_unfrozen(env: Env) -> None:
    """The freeze marker is read by the write contexts' ownership check; readers go on."""
    store = env.store()
    store.move_wait_seconds = 0.2
    uid = USERS[0]
    home = store.router.locate("docs", uid).server
    freeze_partition(store, "docs", START, [home], "reshard-test")
    assert frozen_by(store, "docs", START, home) == "reshard-test"
    with pytest.raises(BriefcaseMovingError, match="frozen for writes by reshard reshard-test"):
        with store.documents(env.dtype, uid) as bc:
            bc["orders"].insert_one({"_id": GDID(0, 3, 1), "number": 50, "total": 0})
    with store.documents(env.dtype, uid, readonly=True) as bc:
        assert bc.root.find_one({}) is not None
    assert unfreeze_partition(store, "docs", START, [home]) == 1
    with store.documents(env.dtype, uid) as bc:
        bc["orders"].insert_one({"_id": GDID(0, 3, 1), "number": 50, "total": 0})


def test_an_interrupted_document_reshard_is_cancelled_back_to_the_old_map(env: Env) -> None:
    """`mdb moves cancel` moves what the reshard moved back with DocumentMove; the old map stays in force."""
    before = snapshot(env)
    code, _, err = env.cli("reshard", "MAP", "docs", "--partition", "0:0:0", "--shards", ",".join(NEW),
                           fault="reshard.after_first_move")
    assert code == -signal.SIGKILL, err
    (entry,) = [e for e in Journal(env.store()).entries(unfinished=True) if e.kind == "reshard"]
    code, out, err = env.cli("moves", "cancel", "MAP", entry.move_id)
    assert code == 0, err
    store = env.store()
    store.refresh()
    assert [list(p[2]) for p in store.router.partitions("docs")] == [list(OLD)]
    assert not store.router.relocations
    assert snapshot(env) == before  # every briefcase on its old shard only, unchanged
    assert Journal(store).entries(unfinished=True) == []
    for server in OLD:
        assert frozen_by(store, "docs", START, server) is None, server
