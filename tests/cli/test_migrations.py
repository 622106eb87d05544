"""Schema migrations over a fleet (issue 13), on real PostgreSQL: 4 shards, CENTRAL and a spare.

The history migrates area ``notes`` (one table, ``mig_notes``): revision 1 creates the table,
revision 2 adds a column with a server default and an index (the models below are at revision
2, so a server at head matches them). Every test writes the history by hand into the map's
folder, as a developer would commit it, and drives the library or the real CLI in a
subprocess (the SIGKILL test kills that process at a fault point between two servers).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.mapfiles import map_dict
from support.moves import ROOT, run_cli
from sqlalchemy import Integer, String, create_engine, inspect, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdb.briefcase import BriefcaseType
from mdb.demo.models import UserBriefcase
from mdb.errors import MigrationError, SchemaError
from mdb.gdid import GDID
from mdb.migrations import ledger
from mdb.migrations.fleet import fleet_status, migrate
from mdb.migrations.revisions import current_revision, lock_out_migrations, lock_out_moves, stamp_revision, version_table
from mdb.moves import move_briefcase
from mdb.migrations.scripts import make_revision, open_history, stamp_created
from mdb.schema import apply_schema, create_tables
from mdb.sqltypes import GDIDType
from mdb.registry import Registry
from mdb.store import Store
from mdb.urls import sqlalchemy_url

pytestmark = pytest.mark.postgres


class NoteBase(DeclarativeBase):
    type_annotation_map = {GDID: GDIDType}


class Note(NoteBase):
    """The model at revision 2 (head)."""

    __tablename__ = "mig_notes"
    note_id: Mapped[GDID] = mapped_column(primary_key=True)
    body: Mapped[str] = mapped_column(String(200))
    priority: Mapped[int] = mapped_column(Integer, server_default=text("0"), index=True)


# In the default registry other modules' in-process CLI runs would look for its table (see
# tests/support/stats.py): a registry of its own, but the default one in this module's CLI subprocesses,
# which import it as the map's models.
NOTES_REGISTRY = None if os.environ.get("MDB_TEST_KEEP_NOTES") == "1" else Registry()


class NoteBriefcase(BriefcaseType, registry=NOTES_REGISTRY):
    area = "notes"
    key = "note_id"
    root = Note


REV1 = '''"""create mig_notes"""
from alembic import op
import sqlalchemy as sa

revision = "a1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "mig_notes",
        sa.Column("note_id", sa.LargeBinary(), primary_key=True),
        sa.Column("body", sa.String(200), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("mig_notes")
'''

REV2 = '''"""priority: a column with a server default, and its index"""
from alembic import op
import sqlalchemy as sa

revision = "b2"
down_revision = "a1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("mig_notes", sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False))
    op.create_index("ix_mig_notes_priority", "mig_notes", ["priority"])


def downgrade() -> None:
    op.drop_index("ix_mig_notes_priority", table_name="mig_notes")
    op.drop_column("mig_notes", "priority")
'''

REV3_CHECK = '''"""bodies are short: a constraint the data of one shard violates"""
from alembic import op

revision = "c3"
down_revision = "b2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_check_constraint("ck_mig_notes_short", "mig_notes", "length(body) < 50")


def downgrade() -> None:
    op.drop_constraint("ck_mig_notes_short", "mig_notes", type_="check")
'''

SHARDS = ["u1", "u2", "u3", "u4"]
SERVERS = [*SHARDS, "s"]  # the targets of area notes: its shards and the spare


@dataclass
class Fleet:
    urls: dict[str, str]
    map_path: Path
    root: Path

    def store(self) -> Store:
        return Store.from_yaml(self.map_path, types=[UserBriefcase, NoteBriefcase])

    def write_revision(self, name: str, body: str) -> None:
        open_history(self.root, "notes", create=True)
        (self.root / "notes" / "versions" / f"{name}.py").write_text(body, encoding="utf-8")

    def sql(self, server: str, *statements: str) -> list[tuple[object, ...]]:
        engine = create_engine(sqlalchemy_url(self.urls[server]))
        try:
            with engine.begin() as conn:
                rows: list[tuple[object, ...]] = []
                for statement in statements:
                    result = conn.execute(text(statement))
                    rows = [tuple(r) for r in result] if result.returns_rows else []
                return rows
        finally:
            engine.dispose()

    def revision_of(self, server: str) -> str | None:
        engine = create_engine(sqlalchemy_url(self.urls[server]))
        try:
            with engine.connect() as conn:
                return current_revision(conn, "notes")
        finally:
            engine.dispose()

    def columns_of(self, server: str) -> dict[str, dict[str, object]]:
        engine = create_engine(sqlalchemy_url(self.urls[server]))
        try:
            with engine.connect() as conn:
                return {c["name"]: dict(c) for c in inspect(conn).get_columns("mig_notes")}
        finally:
            engine.dispose()

    def cli(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        tests = os.pathsep.join(str(p) for p in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]))  # this module (--models) and tests/support
        full = {"MDB_TEST_KEEP_NOTES": "1", "PYTHONPATH": tests + os.pathsep + str(ROOT), "COLUMNS": "250", **(env or {})}
        done = run_cli(["migrate", *args, "--models", "test_migrations"], env=full)
        return done.returncode, done.stdout, done.stderr


@pytest.fixture
def fleet(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Fleet:
    first, second = pg_databases(4), pg_databases(2)
    urls = dict(zip(["c", *SHARDS, "s"], [*first, *second]))
    data = map_dict(urls, central=["c"], partitions=[("0:0:0", SHARDS)], extra_areas={"notes": [("0:0:0", SHARDS)]})
    data["models"] = ["mdb.demo.models"]
    map_path = tmp_path / "map.yaml"
    map_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    with Store.from_yaml(map_path, types=[UserBriefcase]) as store:  # the notes tables come from the history
        assert all(r.ok for r in apply_schema(store))
    return Fleet(urls, map_path, tmp_path / "migrations")


def test_up_adds_a_column_with_a_default_and_an_index_on_every_shard_and_the_spare(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    fleet.sql("u1", "CREATE TABLE mig_notes (note_id bytea primary key, body varchar(200) not null)")
    stamp_engine = create_engine(sqlalchemy_url(fleet.urls["u1"]))
    with stamp_engine.begin() as conn:  # u1 got revision 1 earlier (by hand): status shows the fleet mixed
        stamp_revision(conn, "notes", "a1")
        conn.execute(text("INSERT INTO mig_notes VALUES ('\\x01', 'an old note')"))
    stamp_engine.dispose()

    with fleet.store() as store:
        before = fleet_status(store, fleet.root)
        assert before.heads == {"notes": "b2"}
        assert [(s.server, s.current, s.pending) for s in before.servers] == [
            ("u1", "a1", ["b2"]), ("u2", None, ["a1", "b2"]), ("u3", None, ["a1", "b2"]), ("u4", None, ["a1", "b2"]),
            ("s", None, ["a1", "b2"]),
        ]
        assert before.mixed and {s.state for s in before.servers} == {"behind"}
        assert dict((s.server, s.roles) for s in before.servers)["s"] == ("spare",)

        run = migrate(store, fleet.root, parallel=3, canary="u2")
        assert run.ok, [(r.server, r.detail) for r in run.results]
        assert [(r.server, r.before, r.after, r.outcome, r.steps) for r in run.results] == [
            ("u1", "a1", "b2", "done", ["b2"]), ("u2", None, "b2", "done", ["a1", "b2"]),
            ("u3", None, "b2", "done", ["a1", "b2"]), ("u4", None, "b2", "done", ["a1", "b2"]),
            ("s", None, "b2", "done", ["a1", "b2"]),
        ]
        after = fleet_status(store, fleet.root)
        assert [(s.server, s.current, s.pending, s.state) for s in after.servers] == [(s, "b2", [], "at head") for s in SERVERS]
        assert all(s.drift_checked and not s.differences for s in after.servers)
        assert not after.mixed
        assert {(r.server, r.outcome) for r in after.last_run} == {(s, "done") for s in SERVERS}

        again = migrate(store, fleet.root)
        assert [r.outcome for r in again.results] == ["already"] * 5

    for server in SERVERS:
        columns = fleet.columns_of(server)
        assert not columns["priority"]["nullable"] and "0" in str(columns["priority"]["default"])
        assert fleet.sql(server, "SELECT indexname FROM pg_indexes WHERE tablename = 'mig_notes' AND indexname = 'ix_mig_notes_priority'")
    assert fleet.sql("u1", "SELECT body, priority FROM mig_notes") == [("an old note", 0)]  # the default filled old rows


def test_autogenerate_writes_the_revision_the_models_need_and_touches_nothing_else(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    with fleet.store() as store:
        assert migrate(store, fleet.root).ok
        written = make_revision(store, fleet.root, "notes", "add priority", autogenerate=True)
        assert len(written) == 1
        source = written[0].read_text(encoding="utf-8")
        assert "op.add_column('mig_notes'" in source and "'priority'" in source and "server_default=sa.text('0')" in source
        assert "op.create_index" in source and "ix_mig_notes_priority" in source
        # mdb's own tables and the other area's tables are on the reference shard too: never in a revision
        for other in ("mdb_shard_layout", "mdb_briefcase_state", "users", "orders", "alembic_version"):
            assert f"'{other}'" not in source
        run = migrate(store, fleet.root)
        assert run.ok and {r.after for r in run.results} == {open_history(fleet.root, "notes").get_current_head()}
        after = fleet_status(store, fleet.root)
        assert all(s.state == "at head" for s in after.servers), [(s.server, s.differences) for s in after.servers]


@pytest.mark.slow  # 26 s measured at load ~15 on 2 cores: docs/testing.md
def test_sigkill_halfway_then_rerun_brings_every_server_to_head_exactly_once(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    code, out, err = fleet.cli("up", str(fleet.map_path), "--parallel", "1",
                               env={"MDB_FAULT_POINT": "migrate.after_server", "MDB_FAULT_SKIP": "2"})
    assert code == -signal.SIGKILL, (code, out, err)
    assert [fleet.revision_of(s) for s in SERVERS] == ["b2", "b2", "b2", None, None]

    code, out, err = fleet.cli("status", str(fleet.map_path), "--json")
    assert code == 0, (out, err)
    status = json.loads(out)
    assert status["mixed"] is True
    assert [(s["server"], s["current"], s["state"]) for s in status["servers"]] == [
        ("u1", "b2", "at head"), ("u2", "b2", "at head"), ("u3", "b2", "at head"), ("u4", None, "behind"), ("s", None, "behind"),
    ]
    # The ledger shows where the killed run stopped: its last two servers were never finished.
    assert [(r["server"], r["outcome"]) for r in status["last_run"]] == [
        ("s", "pending"), ("u1", "done"), ("u2", "done"), ("u3", "pending"), ("u4", "pending"),
    ]  # u3 migrated and committed; the kill came before its ledger row was written

    code, out, err = fleet.cli("up", str(fleet.map_path), "--json")
    assert code == 0, (out, err)
    rerun = json.loads(out)
    assert [(s["server"], s["outcome"]) for s in rerun["servers"]] == [
        ("u1", "already"), ("u2", "already"), ("u3", "already"), ("u4", "done"), ("s", "done"),
    ]
    for server in SERVERS:
        assert fleet.sql(server, f"SELECT version_num FROM {version_table('notes')}") == [("b2",)]
        assert list(fleet.columns_of(server)) == ["note_id", "body", "priority"]


@pytest.mark.slow  # 24 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_revision_one_shards_data_violates_stops_the_rollout_naming_that_shard(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    with fleet.store() as store:
        assert migrate(store, fleet.root).ok
    fleet.sql("u3", "INSERT INTO mig_notes (note_id, body) VALUES ('\\x03', '" + "x" * 80 + "')")
    fleet.write_revision("c3_short", REV3_CHECK)

    with fleet.store() as store:
        canary = migrate(store, fleet.root, canary="u3")
        assert [(r.server, r.outcome) for r in canary.results] == [
            ("u1", "not started"), ("u2", "not started"), ("u3", "failed"), ("u4", "not started"), ("s", "not started"),
        ]
        assert "u3" in (canary.failed[0].detail or "") and "ck_mig_notes_short" in (canary.failed[0].detail or "")

        run = migrate(store, fleet.root, parallel=1)
        assert [(r.server, r.outcome, r.after) for r in run.results] == [
            ("u1", "done", "c3"), ("u2", "done", "c3"), ("u3", "failed", None), ("u4", "not started", None),
            ("s", "not started", None),
        ]
        status = fleet_status(store, fleet.root)
        assert [(s.server, s.current, s.pending) for s in status.servers] == [
            ("u1", "c3", []), ("u2", "c3", []), ("u3", "b2", ["c3"]), ("u4", "b2", ["c3"]), ("s", "b2", ["c3"]),
        ]
        assert status.mixed
    # u3's transaction rolled back whole: no constraint, still revision b2
    assert not fleet.sql("u3", "SELECT conname FROM pg_constraint WHERE conname = 'ck_mig_notes_short'")

    code, out, err = fleet.cli("up", str(fleet.map_path), "--parallel", "1")
    assert code == 1, (out, err)
    assert "stopped: notes on server u3 failed" in out and "ck_mig_notes_short" in out


@pytest.mark.slow  # 28 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_column_added_by_hand_is_drift_and_a_move_across_revisions_is_refused(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    with fleet.store() as store:
        assert migrate(store, fleet.root, to="a1").ok
    fleet.write_revision("b2_priority", REV2)
    with fleet.store() as store:
        assert migrate(store, fleet.root, canary="u1", parallel=1, to="b2", areas=["notes"]).ok
        note = next(GDID(0, 1, n) for n in range(1, 1000) if store.router.locate("notes", GDID(0, 1, n)).server == "u2")
        with store.briefcase(NoteBriefcase, note) as session:
            session.add(Note(note_id=note, body="moves with its revision", priority=3))
        # The spare goes back to a1 (down, on that server only): a move from u2 to it is refused.
        down = migrate(store, fleet.root, direction="down", to="a1", areas=["notes"], servers=["s"])
        assert [(r.server, r.before, r.after, r.steps) for r in down.results] == [("s", "b2", "a1", ["b2"])]
        assert "priority" not in fleet.columns_of("s")
    with fleet.store() as store:
        with pytest.raises(MigrationError, match=r"different revisions \('s' at a1, 'u2' at b2\).*mdb migrate up"):
            move_briefcase(store, "notes", note, "s")
        assert store.router.locate("notes", note).server == "u2"  # refused before anything was written
        assert fleet.sql("s", "SELECT count(*) FROM mig_notes") == [(0,)]
        assert [r.outcome for r in migrate(store, fleet.root).results] == ["already"] * 4 + ["done"]
        moved = move_briefcase(store, "notes", note, "s")  # one revision again: the move goes through
        assert (moved.status, moved.rows) == ("done", 1)
        assert store.router.locate("notes", note).server == "s"
        assert fleet.sql("s", "SELECT body, priority FROM mig_notes") == [("moves with its revision", 3)]

    fleet.sql("u2", "ALTER TABLE mig_notes ADD COLUMN added_by_hand integer")
    code, out, err = fleet.cli("status", str(fleet.map_path), "--json")
    assert code == 1, (out, err)
    servers = {s["server"]: s for s in json.loads(out)["servers"]}
    assert servers["u2"]["state"] == "drift"
    assert servers["u2"]["differences"] == [
        {"table": "mig_notes", "kind": "extra column", "detail": "column 'added_by_hand' (nullable) is not in the model"}
    ]
    assert all(servers[s]["state"] == "at head" for s in SERVERS if s != "u2")
    code, out, err = fleet.cli("status", str(fleet.map_path))
    assert code == 1 and "drift: mig_notes: column 'added_by_hand' (nullable) is not in the model" in out, (out, err)
    assert "last run" in out and "5 of 5 servers done" in out


def test_a_server_that_holds_a_lock_fails_within_the_lock_timeout(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    with fleet.store() as store:
        assert migrate(store, fleet.root, to="a1").ok
    fleet.write_revision("b2_priority", REV2)
    engine = create_engine(sqlalchemy_url(fleet.urls["u4"]))
    try:
        with engine.connect() as blocker:
            blocker.execute(text("BEGIN"))
            blocker.execute(text("SELECT * FROM mig_notes"))  # ACCESS SHARE until the end: ALTER TABLE waits
            with fleet.store() as store:
                run = migrate(store, fleet.root, parallel=1, lock_timeout=0.3)
            blocker.execute(text("ROLLBACK"))
    finally:
        engine.dispose()
    outcomes = {r.server: (r.outcome, r.seconds) for r in run.results}
    assert outcomes["u4"][0] == "failed" and outcomes["u4"][1] < 5
    assert "lock timeout" in (run.failed[0].detail or "")
    assert outcomes["s"][0] == "not started"


def test_ledger_table_is_created_on_demand_in_central(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    with fleet.store() as store:
        dry = migrate(store, fleet.root, dry_run=True)
        assert [(r.outcome, r.steps) for r in dry.results] == [("planned", ["a1"])] * 5
        assert [fleet.revision_of(s) for s in SERVERS] == [None] * 5
        run = migrate(store, fleet.root)
        with store.transaction("c") as conn:
            rows = ledger.last_run(conn)
    assert {(r.run_id, r.server, r.outcome, r.target) for r in rows} == {(run.run_id, s, "done", "a1") for s in SERVERS}


def test_a_migration_never_runs_on_a_server_a_move_is_copying_on(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    with fleet.store() as store:
        with store.transaction("u2") as copying:  # a move's copy holds the schema lock shared
            lock_out_migrations(copying, "u2")
            run = migrate(store, fleet.root, parallel=1)
        with store.transaction("u3") as migrating:  # and a migration holds it exclusive: no move copies then
            lock_out_moves(migrating, "u3")
            with pytest.raises(SchemaError, match="a schema migration is running"), store.transaction("u3") as copying:
                lock_out_migrations(copying, "u3")
    assert [(r.server, r.outcome) for r in run.results][:3] == [("u1", "done"), ("u2", "failed"), ("u3", "not started")]
    assert "a move is copying briefcases to or from it" in (run.failed[0].detail or "")


@pytest.mark.slow  # 43 s measured at load ~15 on 2 cores: docs/testing.md
def test_schema_apply_on_a_new_server_records_head_and_the_cli_writes_a_revision(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    with fleet.store() as store:
        assert migrate(store, fleet.root, servers=SHARDS).ok
        with store.transaction("s") as conn:  # the spare's notes tables made from the models, as schema apply does
            created = create_tables(conn, list(NoteBriefcase.tables))
            assert created == ["mig_notes"]
            assert stamp_created(conn, fleet.root, "notes", ["mig_notes"], created) == "b2"
        with store.transaction("u1") as conn:  # tables already there: nothing is stamped
            assert stamp_created(conn, fleet.root, "notes", ["mig_notes"], []) is None
        status = fleet_status(store, fleet.root)
        assert [(s.server, s.state) for s in status.servers] == [(s, "at head") for s in SERVERS]

    code, out, err = fleet.cli("revision", str(fleet.map_path), "notes", "-m", "nothing yet")
    assert code == 0, (out, err)
    written = Path(out.split("wrote ", 1)[1].strip())
    assert written.parent == fleet.root / "notes" / "versions" and "down_revision: Union[str, Sequence[str], None] = 'b2'" in written.read_text()
    code, out, err = fleet.cli("up", str(fleet.map_path), "--dry-run", "--json")
    assert code == 0, (out, err)
    assert {s["outcome"] for s in json.loads(out)["servers"]} == {"planned"}
    code, out, err = fleet.cli("down", str(fleet.map_path), "--to", "nope")
    assert code == 2 and "nope" in err, (out, err)


def test_a_revision_whose_code_raises_fails_its_server_and_stops_the_rollout(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_bug", REV2.replace('    op.add_column(', '    raise RuntimeError("boom")\n    op.add_column(', 1))
    with fleet.store() as store:
        run = migrate(store, fleet.root, parallel=1)
    assert [(r.server, r.outcome) for r in run.results] == [("u1", "failed")] + [(s, "not started") for s in SERVERS[1:]]
    assert "the revision raised RuntimeError: boom" in (run.failed[0].detail or "")
    assert fleet.revision_of("u1") is None  # a1 ran in the same transaction: rolled back with b2


@pytest.mark.slow  # 26 s measured at load ~15 on 2 cores: docs/testing.md
def test_status_lists_each_replica_with_the_revision_it_replayed(
    pg_replica_pair: Any, pg_databases: Callable[[int], list[str]], tmp_path: Path
) -> None:
    central, other = pg_databases(2)
    urls = {"c": central, "u1": pg_replica_pair.primary_url, "u2": other}
    data = map_dict(urls, central=["c"], partitions=[("0:0:0", ["u1", "u2"])], replicas={"u1": pg_replica_pair.replica_url},
                    extra_areas={"notes": [("0:0:0", ["u1", "u2"])]})
    map_path = tmp_path / "map.yaml"
    map_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    fleet = Fleet(urls, map_path, tmp_path / "migrations")
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    with Store.from_yaml(map_path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    with fleet.store() as store:
        run = migrate(store, fleet.root)
        assert [(r.server, r.outcome) for r in run.results] == [("u1", "done"), ("u2", "done")]  # a replica is never migrated
        pg_replica_pair.wait_for_replay()
        status = fleet_status(store, fleet.root)
    assert [(s.server, s.replica, s.current, s.state) for s in status.servers] == [
        ("u1", False, "b2", "at head"), ("u1", True, "b2", "at head"), ("u2", False, "b2", "at head"),
    ]
    assert all(s.drift_checked for s in status.servers)


def test_up_to_an_older_revision_leaves_servers_past_it_alone_and_an_unknown_revision_fails_its_server(fleet: Fleet) -> None:
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    with fleet.store() as store:
        assert migrate(store, fleet.root, servers=["u1", "u2"]).ok
        older = migrate(store, fleet.root, to="a1", parallel=1)
        assert [(r.server, r.before, r.after, r.outcome) for r in older.results] == [
            ("u1", "b2", "b2", "already"), ("u2", "b2", "b2", "already"), ("u3", None, "a1", "done"),
            ("u4", None, "a1", "done"), ("s", None, "a1", "done"),
        ]
        assert older.results[0].detail == "at b2, already past a1 going up"
        fleet.sql("u4", f"UPDATE {version_table('notes')} SET version_num = 'zz99'")  # a revision from another branch of the code
        run = migrate(store, fleet.root, parallel=1)
        assert [(r.server, r.outcome) for r in run.results] == [
            ("u1", "already"), ("u2", "already"), ("u3", "done"), ("u4", "failed"), ("s", "not started"),
        ]
        assert "zz99" in (run.failed[0].detail or "")
        status = {s.server: s for s in fleet_status(store, fleet.root).servers}
        assert status["u4"].state == "failed" and "zz99" in (status["u4"].error or "")


@pytest.mark.slow  # 49 s measured at load ~15 on 2 cores: docs/testing.md
def test_mdb_schema_apply_records_head_on_a_server_it_built_and_schema_check_accepts_the_version_table(fleet: Fleet) -> None:
    """`mdb schema apply` (the CLI) on a fleet whose shards were migrated: the spare gets the notes table
    from the models and is recorded at head, so `mdb migrate up` has nothing to run there; the
    version tables are mdb's own, never "extra tables" to `mdb schema check`."""
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    with fleet.store() as store:
        assert migrate(store, fleet.root, servers=SHARDS).ok
    assert fleet.revision_of("s") is None
    tests = os.pathsep.join(str(p) for p in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]))  # this module (--models) and tests/support
    env = {"MDB_TEST_KEEP_NOTES": "1", "PYTHONPATH": tests + os.pathsep + str(ROOT), "COLUMNS": "250"}
    # JSON: the per-server reports. (Not the exit code: in the full suite the fixture's in-process
    # apply_schema also created the CENTRAL tables of indexes other test modules declared, which
    # this CLI process does not know, so CENTRAL may report extra tables that are not ours.)
    done = run_cli(["schema", "apply", str(fleet.map_path), "--models", "test_migrations", "--json"], env=env)
    reports = {r["server"]: r for r in json.loads(done.stdout)["shards"]}
    assert reports["s"]["ok"] and reports["s"]["created"] == ["mig_notes"], reports["s"]
    assert fleet.revision_of("s") == "b2"
    assert all(reports[u]["ok"] for u in SHARDS), reports
    with fleet.store() as store:
        assert [r.outcome for r in migrate(store, fleet.root).results] == ["already"] * 5
    text = run_cli(["schema", "apply", str(fleet.map_path), "--models", "test_migrations"], env=env).stdout
    assert "alembic_version" not in text  # the version tables are never reported as extra tables
    check = run_cli(["schema", "check", str(fleet.map_path), "--models", "test_migrations", "--json"], env=env)
    checked = {r["server"]: r for r in json.loads(check.stdout)["shards"]}
    assert all(checked[x]["ok"] for x in [*SHARDS, "s"]), checked


@pytest.mark.slow  # 48 s measured at load ~15 on 2 cores: docs/testing.md
def test_mdb_map_apply_records_head_on_a_server_it_adds(fleet: Fleet, pg_databases: Callable[[int], list[str]]) -> None:
    """A new map version gives the notes area a partition on a new server: `mdb map apply` builds its
    tables from the models and records the head there, so the fleet stays at one revision."""
    fleet.write_revision("a1_create", REV1)
    fleet.write_revision("b2_priority", REV2)
    with fleet.store() as store:
        assert migrate(store, fleet.root).ok
    (new_url,) = pg_databases(1)
    data = yaml.safe_load(fleet.map_path.read_text(encoding="utf-8"))
    data["version"] = 2
    data["servers"]["n"] = {"primary": new_url}
    data["areas"]["notes"]["partitions"].append({"start": "1:0:0", "shards": ["n"]})
    new_map = fleet.map_path.with_name("map.v2.yaml")
    new_map.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    tests = os.pathsep.join(str(p) for p in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]))  # this module (--models) and tests/support
    env = {"MDB_TEST_KEEP_NOTES": "1", "PYTHONPATH": tests + os.pathsep + str(ROOT), "COLUMNS": "250"}
    done = run_cli(["map", "apply", str(fleet.map_path), str(new_map), "--models", "test_migrations"], env=env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "n: area notes recorded at migration revision b2 (created from the models)" in done.stdout
    fleet.urls["n"] = new_url
    assert fleet.revision_of("n") == "b2"
    assert "priority" in fleet.columns_of("n")
