"""Document briefcases moved through the CLI: `mdb move`, `mdb where`, `mdb moves status|resume`.

The MongoDB servers are the file-backed fake (``MDB_MONGO_FAKE_DIR``, :class:`mdb.testing.mongo.FakeMongo`
with ``path``), so a CLI process SIGKILLed mid-move (``MDB_FAULT_POINT``) leaves what it had
committed for the next process, as a real server would; CENTRAL (journal, directory) is SQLite.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from mdb import GDID, Store
from mdb.moves.document_move import FAULT_POINTS, checksums
from mdb.moves.journal import DONE, ROLLED_BACK, Journal
from mdb.schema import apply_schema
from support.documents import Env, forget_cli_docs  # noqa: F401 (fixtures: forget_cli_docs)
from support.documents import SHARDS

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

pytest.importorskip("mongomock_ng")

UID = GDID(0, 0, 4)  # v mod 3 = 1 -> m2


@pytest.fixture
def env(tmp_path: Path) -> Env:
    env = Env(tmp_path)
    store = env.store()
    reports = apply_schema(store)
    assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    with store.documents(env.dtype, UID) as bc:
        bc.root.insert_one({"email": "m@x"})
        bc["orders"].insert_many([{"_id": GDID(0, 1, 40 + i), "number": i, "total": i * 3} for i in range(5)])
    return env


def holders(store: Store) -> dict[str, int]:
    return {s: store.mongo.database(s)["orders"].count_documents({"user_id": bytes(UID)}) for s in SHARDS}


def where(env: Env) -> dict[str, object]:
    code, out, err = env.cli("where", "MAP", "docs", str(UID), "--json")
    assert code == 0, err
    found: dict[str, object] = json.loads(out)
    return found


def test_where_then_move_then_where(env: Env) -> None:
    before = where(env)
    assert before["routed_to"] == "m2" and before["holders"] == {"m2": 6} and before["consistent"] is True
    code, out, err = env.cli("move", "MAP", "docs", str(UID), "--to", "m3", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["status"] == "done" and result["source"] == "m2" and result["target"] == "m3"
    assert result["tables"]["orders"]["rows"] == 5 and result["rows"] == 6
    after = where(env)
    assert after["routed_to"] == "m3" and after["relocation"] == "m3" and after["holders"] == {"m3": 6}
    assert after["states"]["m2"]["state"] == "gone" and after["moves_in_flight"] == []
    store = env.store()
    assert holders(store) == {"m1": 0, "m2": 0, "m3": 5}
    with store.documents(env.dtype, UID, readonly=True) as bc:
        assert bc.placement.server == "m3" and bc["orders"].count_documents({}) == 5
    # and home again through the CLI: no directory entry, no state document on the home shard
    code, _, err = env.cli("move", "MAP", "docs", str(UID), "--to", "m2")
    assert code == 0, err
    home = where(env)
    assert home["routed_to"] == "m2" and home["relocation"] is None and home["holders"] == {"m2": 6}
    assert list(home["states"]) == ["m3"] and home["states"]["m3"]["state"] == "gone"  # the fence of the move back


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_sigkilled_document_move_is_resolved_by_moves_resume(env: Env, point: str) -> None:
    store = env.store()
    before = checksums(store.mongo.database("m2"), env.dtype, UID)
    code, _, err = env.cli("move", "MAP", "docs", str(UID), "--to", "m3", fault=point)
    assert code == -signal.SIGKILL, f"{point}: the CLI was not killed there: {code} {err}"
    code, out, err = env.cli("moves", "status", "MAP")
    assert code == 0, err
    assert "mongo-move" in out and "docs" in out, out  # the interrupted move is listed
    code, out, err = env.cli("moves", "resume", "MAP")
    assert code == 0, err
    committed = FAULT_POINTS.index(point) >= FAULT_POINTS.index("mongo.move.after_commit_point")  # the fake has transactions
    assert ("finalized" if committed else "rolled back") in out, out
    home = "m3" if committed else "m2"
    fresh = env.store()
    assert holders(fresh) == {s: (5 if s == home else 0) for s in SHARDS}
    assert checksums(fresh.mongo.database(home), env.dtype, UID) == before
    entries = Journal(fresh).entries()
    assert [e.status for e in entries] == [DONE if committed else ROLLED_BACK]
    with fresh.documents(env.dtype, UID) as bc:  # routed to its home and writable again: the lock is gone
        assert bc.placement.server == home
        bc["orders"].insert_one({"_id": GDID(0, 1, 98), "number": 98, "total": 0})
    code, out, err = env.cli("moves", "resume", "MAP")
    assert code == 0, err
    assert Journal(env.store()).entries(unfinished=True) == []


@pytest.mark.parametrize(("point", "home"), [("mongo.move.after_copy", "m2"), ("mongo.move.after_relocation", "m2")])
def test_moves_cancel_resolves_an_interrupted_document_move(env: Env, point: str, home: str) -> None:
    """Before its commit point it is rolled back; past it, finished and (``--move-back``, the default) moved back."""
    code, _, err = env.cli("move", "MAP", "docs", str(UID), "--to", "m3", fault=point)
    assert code == -signal.SIGKILL, err
    (entry,) = Journal(env.store()).entries(unfinished=True)
    assert entry.kind == "mongo-move"
    code, out, err = env.cli("moves", "cancel", "MAP", entry.move_id)
    assert code == 0, err
    fresh = env.store()
    assert holders(fresh) == {s: (5 if s == home else 0) for s in SHARDS}
    assert Journal(fresh).entries(unfinished=True) == []
    with fresh.documents(env.dtype, UID) as bc:
        assert bc.placement.server == home


def test_a_reshard_between_server_kinds_is_refused(env: Env) -> None:
    code, _, err = env.cli("reshard", "MAP", "docs", "--partition", "0:0:0", "--shards", "m1,c")
    assert code == 2 and "between server kinds" in err, err
    assert Journal(env.store()).entries() == []  # refused before anything was journaled


def test_a_move_between_server_kinds_is_refused(env: Env) -> None:
    code, _, err = env.cli("move", "MAP", "docs", str(UID), "--to", "c")
    assert code == 2 and "between server kinds" in err, err
    assert holders(env.store()) == {"m1": 0, "m2": 5, "m3": 0}
    assert Journal(env.store()).entries() == []  # refused before anything was journaled
