"""Index changes of document areas on every MongoDB shard: ``status``, ``up``, failure, resume (issue 13).

The MongoDB servers are the file-backed fake (:class:`mdb.testing.mongo.FakeMongo` with ``path``), so
the library tests and the CLI processes (``MDB_MONGO_FAKE_DIR``) see the same servers, and a CLI
process SIGKILLed mid-rollout (``MDB_FAULT_POINT=migrate.after_server``) leaves what it had done
for the rerun. CENTRAL (the run ledger) is SQLite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.mapfiles import map_dict
from support.moves import run_cli

from mdb import Store
from mdb.migrations import ledger
from mdb.migrations.documents import MANAGED, declared_hash, declared_indexes, document_status, migrate_documents
from mdb.mongo import MongoIndex, MongoStore
from mdb.testing.mongo import FakeMongo
from mdb.mongo.types import DocumentBriefcaseType
from mdb.registry import Registry
from mdb.schema import apply_schema

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

pytest.importorskip("mongomock_ng")

SHARDS = ("m1", "m2", "m3")


# Versions of one type (their collections clash): in the default registry a Store of another test
# module would take them for its own types of area "docs". Every Store here names the version it deploys.
VERSIONS = Registry()


class V1(DocumentBriefcaseType, registry=VERSIONS):
    area = "docs"
    key = "user_id"
    root = "users"
    children = ("orders",)
    indexes = (MongoIndex("orders", [("user_id", 1), ("number", 1)], unique=True),)


class V2(DocumentBriefcaseType, registry=VERSIONS):
    """V1 and one more index: ``orders_placed``."""

    area = "docs"
    key = "user_id"
    root = "users"
    children = ("orders",)
    indexes = (*V1.indexes, MongoIndex("orders", [("placed", -1)], name="orders_placed"))


class V2Changed(DocumentBriefcaseType, registry=VERSIONS):
    """``orders_placed`` redeclared with other keys under the same name (refused: never rebuilt in place)."""

    area = "docs"
    key = "user_id"
    root = "users"
    children = ("orders",)
    indexes = (*V1.indexes, MongoIndex("orders", [("placed", 1)], name="orders_placed"))


class V3Unique(DocumentBriefcaseType, registry=VERSIONS):
    """V1 and a unique index that m2's documents violate."""

    area = "docs"
    key = "user_id"
    root = "users"
    children = ("orders",)
    indexes = (*V1.indexes, MongoIndex("orders", [("user_id", 1), ("sku", 1)], unique=True, name="orders_sku"))




class Fleet:
    """Three fake MongoDB shards of area ``docs`` kept in ``tmp/fake``, CENTRAL on SQLite."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.fake_dir = tmp_path / "fake"
        servers = {"c": f"sqlite:///{tmp_path / 'central.db'}", **{m: f"mongodb://fake-{m}/{m}" for m in SHARDS}}
        self.data = map_dict(servers, central=["c"], partitions=[("0:0:0", list(SHARDS))], area="docs")
        self.map_path = tmp_path / "map.yaml"
        self.map_path.write_text(yaml.safe_dump(self.data, sort_keys=False), encoding="utf-8")

    def store(self, dtype: type[DocumentBriefcaseType]) -> Store:
        """A Store whose document area ``docs`` is declared by ``dtype`` (a type "changed" between deploys)."""
        store = Store.from_yaml(self.map_path, types=[])
        MongoStore.attach(store, client_factory=FakeMongo(path=self.fake_dir), types=[dtype])
        return store

    def indexes(self, store: Store, server: str) -> set[str]:
        return set(store.mongo.database(server)["orders"].index_information()) - {"_id_"}


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    fleet = Fleet(tmp_path)
    store = fleet.store(V1)
    try:
        reports = apply_schema(store)
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    finally:
        store.close()
    return fleet


def states(statuses: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {s.server: s.state for s in statuses}


def test_gained_index_is_created_everywhere_and_dropped_index_dropped_but_not_a_dba_one(fleet: Fleet) -> None:
    store = fleet.store(V1)
    assert states(document_status(store)) == dict.fromkeys(SHARDS, "at target")
    store.close()

    store = fleet.store(V2)  # the type gains orders_placed
    before = document_status(store)
    assert states(before) == dict.fromkeys(SHARDS, "behind") and all(s.ok for s in before)
    assert all([f"{i.collection}.{i.name}" for i in s.missing] == ["orders.orders_placed"] for s in before)
    target = declared_hash(declared_indexes(store, "docs"))
    assert all(s.target == target and s.current != target for s in before)
    planned = migrate_documents(store, dry_run=True)
    assert [r.outcome for r in planned.results] == ["planned"] * 3 and all("orders_placed" not in fleet.indexes(store, m) for m in SHARDS)
    run = migrate_documents(store, parallel=2)
    assert run.ok and [(r.server, r.outcome) for r in run.results] == [(m, "done") for m in SHARDS]
    assert all(r.after == target and r.steps == ["create orders.orders_placed {placed: -1}"] for r in run.results)
    assert all("orders_placed" in fleet.indexes(store, m) for m in SHARDS)
    assert states(document_status(store)) == dict.fromkeys(SHARDS, "at target")
    # the ledger in CENTRAL records the run like a SQL one, target = the declared set
    with store.transaction("c") as conn:
        rows = ledger.last_run(conn)
    assert [(r.server, r.direction, r.target, r.outcome) for r in rows] == [(m, "up", target, "done") for m in SHARDS]
    # a DBA's own index on m2, which mdb must never drop
    store.mongo.database("m2")["orders"].create_index([("note", 1)], name="dba_note")
    store.close()

    store = fleet.store(V1)  # the type drops orders_placed again
    after = document_status(store)
    assert states(after) == dict.fromkeys(SHARDS, "behind")
    assert all([i.name for i in s.extra] == ["orders_placed"] for s in after)
    assert [[i.name for i in s.other] for s in after] == [[], ["dba_note"], []]
    run = migrate_documents(store)
    assert run.ok and [r.outcome for r in run.results] == ["done"] * 3
    assert {m: fleet.indexes(store, m) for m in SHARDS} == {
        "m1": {"mdb_user_id_id", "user_id_1_number_1"},
        "m2": {"mdb_user_id_id", "user_id_1_number_1", "dba_note"},
        "m3": {"mdb_user_id_id", "user_id_1_number_1"},
    }
    assert all(store.mongo.database(m)[MANAGED].count_documents({"name": "orders_placed"}) == 0 for m in SHARDS)
    again = migrate_documents(store)  # idempotent: nothing left to do
    assert [r.outcome for r in again.results] == ["already"] * 3
    assert states(document_status(store)) == dict.fromkeys(SHARDS, "at target")
    store.close()


def test_an_index_changed_under_its_name_is_refused_not_rebuilt(fleet: Fleet) -> None:
    store = fleet.store(V2)
    assert migrate_documents(store).ok
    store.close()
    store = fleet.store(V2Changed)
    assert states(document_status(store)) == dict.fromkeys(SHARDS, "differs")
    run = migrate_documents(store, parallel=1)
    assert [r.outcome for r in run.results] == ["failed", "not started", "not started"]
    assert "orders.orders_placed" in (run.results[0].detail or "") and "new name" in (run.results[0].detail or "")
    assert all("orders_placed" in fleet.indexes(store, m) for m in SHARDS)  # still the old one everywhere
    store.close()


def test_a_unique_index_one_shard_violates_fails_that_shard_and_stops_the_rollout(fleet: Fleet) -> None:
    store = fleet.store(V1)
    orders = store.mongo.database("m2")["orders"]
    orders.insert_many([{"user_id": b"\x00" * 11 + b"\x04", "number": n, "sku": "same"} for n in (1, 2)])
    store.close()

    store = fleet.store(V3Unique)
    run = migrate_documents(store, parallel=1)
    assert [(r.server, r.outcome) for r in run.results] == [("m1", "done"), ("m2", "failed"), ("m3", "not started")]
    failed = run.failed[0]
    assert "'m2'" in (failed.detail or "") and "DuplicateKeyError" in (failed.detail or "")
    assert not run.ok
    # status shows the mixed state: m1 at the new set, m2 and m3 still without the index
    status = document_status(store)
    assert states(status) == {"m1": "at target", "m2": "behind", "m3": "behind"}
    assert len({s.current for s in status}) == 2
    assert store.mongo.database("m2")[MANAGED].count_documents({"name": "orders_sku"}) == 0  # never built, not recorded
    with store.transaction("c") as conn:
        assert [(r.server, r.outcome) for r in ledger.last_run(conn)] == [("m1", "done"), ("m2", "failed"), ("m3", "not started")]
    # fixed (the duplicate removed), the same command finishes the rest
    store.mongo.database("m2")["orders"].delete_one({"number": 2})
    rerun = migrate_documents(store)
    assert [(r.server, r.outcome) for r in rerun.results] == [("m1", "already"), ("m2", "done"), ("m3", "done")]
    store.close()


def test_the_canary_runs_first_and_alone_and_servers_select(fleet: Fleet) -> None:
    store = fleet.store(V1)
    store.mongo.database("m3")["orders"].insert_many([{"user_id": b"\x01" * 12, "number": n, "sku": "x"} for n in (1, 2)])
    store.close()
    store = fleet.store(V3Unique)
    run = migrate_documents(store, canary="m3", parallel=3)
    assert [(r.server, r.outcome) for r in run.results] == [("m1", "not started"), ("m2", "not started"), ("m3", "failed")]
    only = migrate_documents(store, servers=["m2"])
    assert [(r.server, r.outcome) for r in only.results] == [("m2", "done")]
    assert states(document_status(store)) == {"m1": "behind", "m2": "at target", "m3": "behind"}
    store.close()


# -- through the CLI, with a SIGKILL -------------------------------------------------------------


MODELS = '''
from mdb.mongo import DocumentBriefcaseType, MongoIndex


class CliDocs(DocumentBriefcaseType):
    area = "docs"
    key = "user_id"
    root = "users"
    children = ("orders",)
    indexes = ({indexes})
'''
BASE = 'MongoIndex("orders", [("user_id", 1), ("number", 1)], unique=True),'
GAINED = BASE + ' MongoIndex("orders", [("placed", -1)], name="orders_placed"),'


def test_cli_sigkill_after_a_server_then_rerun_finishes_exactly_what_is_left(fleet: Fleet) -> None:
    module = "migdocs_models"
    models = fleet.tmp_path / f"{module}.py"
    models.write_text(MODELS.format(indexes=BASE), encoding="utf-8")
    fleet.data["models"] = [module]
    fleet.map_path.write_text(yaml.safe_dump(fleet.data, sort_keys=False), encoding="utf-8")
    env = {"MDB_MONGO_FAKE_DIR": str(fleet.fake_dir), "MDB_TEST_MONGO_URI": "", "PYTHONDONTWRITEBYTECODE": "1"}

    def cli(*args: str, fault: str | None = None) -> tuple[int, str, str]:
        run = run_cli([str(fleet.map_path) if a == "MAP" else a for a in args],
                      env={**env, **({"MDB_FAULT_POINT": fault} if fault else {})})
        return run.returncode, run.stdout, run.stderr

    code, out, err = cli("migrate", "status", "MAP", "--json")
    assert code == 0, err
    assert [d["state"] for d in json.loads(out)["documents"]] == ["at target"] * 3

    models.write_text(MODELS.format(indexes=GAINED), encoding="utf-8")
    code, out, err = cli("migrate", "up", "MAP", "--dry-run", "--json")
    assert code == 0, err
    assert [s["outcome"] for s in json.loads(out)["servers"]] == ["planned"] * 3
    code, _, err = cli("migrate", "up", "MAP", "--parallel", "1", fault="migrate.after_server")
    assert code == -9, err  # SIGKILLed right after the first server
    code, out, err = cli("migrate", "status", "MAP", "--json")
    assert code == 0, err  # behind is a state, not a failure
    status = json.loads(out)
    assert [(d["server"], d["state"]) for d in status["documents"]] == [("m1", "at target"), ("m2", "behind"), ("m3", "behind")]
    # the ledger row of m1 is still pending (killed before it was written): the server's indexes are the truth
    assert [(r["server"], r["outcome"]) for r in status["last_run"]] == [("m1", "pending"), ("m2", "pending"), ("m3", "pending")]

    code, out, err = cli("migrate", "up", "MAP", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["ok"] and [(s["server"], s["outcome"]) for s in result["servers"]] == [("m1", "already"), ("m2", "done"), ("m3", "done")]
    assert result["documents"]["run_id"] == result["run_id"]
    store = fleet.store(V2)
    assert all("orders_placed" in fleet.indexes(store, m) for m in SHARDS)
    store.close()

    code, out, err = cli("migrate", "status", "MAP")
    assert code == 0, err
    assert "document indexes" in out and "behind" not in out
    code, _, err = cli("migrate", "down", "MAP", "--to", "base", "--area", "docs")
    assert code == 2 and "no revisions" in err
