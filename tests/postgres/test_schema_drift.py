"""Schema drift is visible: ``mdb schema apply``/``check``, a move's prechecks and writes report it.

Drift is made the way it happens: the database keeps an older (or hand-edited) table while the
model changed. Each test changes the live table with plain DDL after ``schema apply`` made it
match, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.moves import add_transaction, create_user, make_cluster
from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    create_engine,
    func,
    text,
    update,
)
from support.pgbouncer import pooled_servers, write_pooled_map
from support.schema import write_models_map
from typer.testing import CliRunner

from mdb.cli import app
from mdb.demo.models import User, UserBriefcase
from mdb.urls import sqlalchemy_url
from mdb.errors import SchemaError
from mdb.gdid import GDID
from mdb.moves.move import move_briefcase
from mdb.moves.reshard import reshard
from mdb.schema_diff import Difference, compare_tables
from mdb.sqltypes import GDIDType
from mdb.testing.pgbouncer import PgBouncer

MDB = Path(sys.executable).parent / "mdb"
runner = CliRunner()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def urls(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[int], list[str]]:
    """``urls(n)``: n fresh databases of the parametrized backend."""
    if request.param == "sqlite":
        return lambda n: [f"sqlite:///{tmp_path / f'db{i}.sqlite'}" for i in range(n)]
    factory: Callable[[int], list[str]] = request.getfixturevalue("pg_databases")
    return factory


def ddl(url: str, *statements: str) -> None:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def diff(url: str, tables: list[Table], known: tuple[str, ...] = ()) -> list[Difference]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return compare_tables(conn, tables, known=known)
    finally:
        engine.dispose()


def model_table(metadata: MetaData) -> Table:
    return Table(
        "things", metadata,
        Column("thing_id", GDIDType, primary_key=True),
        Column("name", String(40), nullable=False),
        Column("size", Integer, nullable=True),
        Column("tag", String(10), nullable=False),
        Column("count", BigInteger, nullable=False),
        Index("ix_things_name", "name"),
        Index("ix_things_lower_tag", func.lower(text("tag"))),  # an expression index: not compared
        UniqueConstraint("tag", name="uq_things_tag"),
    )


def test_a_table_created_from_its_model_has_no_differences(urls: Callable[[int], list[str]]) -> None:
    (url,) = urls(1)
    metadata = MetaData()
    table = model_table(metadata)
    engine = create_engine(sqlalchemy_url(url))
    metadata.create_all(engine)
    engine.dispose()
    assert diff(url, [table], known=("things",)) == []


def test_every_kind_of_difference_is_reported(urls: Callable[[int], list[str]]) -> None:
    """The live table: ``size`` NOT NULL, ``count`` text, an extra column, no ``tag``, the index
    on another column, an extra unique key; and a stray table. The model is ``model_table``."""
    (url,) = urls(1)
    blob = "BYTEA" if url.startswith("postgresql") else "BLOB"
    ddl(
        url,
        f"CREATE TABLE things (thing_id {blob} NOT NULL PRIMARY KEY, name VARCHAR(40) NOT NULL, "
        "size INTEGER NOT NULL, count VARCHAR(20) NOT NULL, legacy INTEGER NOT NULL, UNIQUE (name, size))",
        "CREATE INDEX ix_things_size ON things (size)",
        "CREATE TABLE stray (x INTEGER)",
    )
    found = {(d.table, d.kind, d.detail) for d in diff(url, [model_table(MetaData())], known=("things",))}
    by_kind = {kind: (table, detail) for table, kind, detail in found}
    assert set(by_kind) == {"extra table", "missing column", "extra column", "type", "nullable", "missing index",
                            "extra index", "missing unique", "extra unique"}, found
    assert len(found) == len(by_kind)  # one of each
    assert by_kind["extra table"] == ("stray", "table 'stray' is not declared by any model")
    assert by_kind["missing column"][1].startswith("column 'tag' (VARCHAR(10)) is missing")
    assert by_kind["extra column"] == ("things", "column 'legacy' (NOT NULL) is not in the model")
    assert "column 'count' is VARCHAR(20) (string), the model says BIGINT (integer)" == by_kind["type"][1]
    assert by_kind["nullable"][1] == "column 'size' is NOT NULL, the model says nullable"
    assert by_kind["missing index"][1] == "index on (name) is missing"
    assert by_kind["extra index"][1] == "index on (size) is not in the model"
    assert by_kind["missing unique"][1] == "unique on (tag) is missing"
    assert by_kind["extra unique"][1] == "unique on (name, size) is not in the model"


def test_a_missing_table_and_a_changed_primary_key(urls: Callable[[int], list[str]]) -> None:
    (url,) = urls(1)
    metadata = MetaData()
    pair = Table("pairs", metadata, Column("a", Integer, primary_key=True), Column("b", Integer, primary_key=True))
    ddl(url, "CREATE TABLE pairs (a INTEGER NOT NULL PRIMARY KEY, b INTEGER NOT NULL)")
    gone = Table("gone", metadata, Column("a", Integer, primary_key=True))
    found = [(d.table, d.kind, d.detail) for d in diff(url, [pair, gone])]
    assert found == [
        ("gone", "missing table", "table 'gone' is missing"),
        ("pairs", "primary key", "primary key is (a), the model says (a, b)"),
    ]


# -- the commands -------------------------------------------------------------------------------


def write_map(tmp_path: Path, servers: dict[str, str]) -> Path:
    return write_models_map(tmp_path, servers, central=["c"], partitions=[("0:0:0", ["u1", "u2"])])


def cli(*args: str) -> Any:
    return runner.invoke(app, ["schema", *args], env={"COLUMNS": "250"})


@pytest.mark.slow  # 25 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_apply_and_check_report_a_column_the_database_lacks(urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    """The issue's case: the model has a column the shard's table lacks. ``schema apply`` used to
    say ``all 3 shards ok`` (it only creates missing tables); now it and ``schema check`` list
    the difference per shard and exit 1."""
    c, u1, u2 = urls(3)
    path = write_map(tmp_path, {"c": c, "u1": u1, "u2": u2})
    assert cli("apply", str(path)).exit_code == 0
    clean = cli("check", str(path), "--json")
    assert clean.exit_code == 0, clean.stdout
    assert all(s["differences"] == [] and s["ok"] for s in json.loads(clean.stdout)["shards"])

    ddl(u2, "ALTER TABLE users DROP COLUMN name", "ALTER TABLE mdb_briefcase_state ADD COLUMN note VARCHAR(10)")
    for command in ("apply", "check"):
        result = cli(command, str(path), "--json")
        assert result.exit_code == 1, (command, result.stdout)
        shards = {s["server"]: s for s in json.loads(result.stdout)["shards"]}
        assert shards["c"]["ok"] and shards["u1"]["ok"] and not shards["u2"]["ok"]
        assert shards["u2"]["differences"] == [
            {"table": "mdb_briefcase_state", "kind": "extra column", "detail": "column 'note' (nullable) is not in the model"},
            {"table": "users", "kind": "missing column", "detail": "column 'name' (VARCHAR(200)) is missing"},
        ], shards["u2"]
        shown = cli(command, str(path))
        assert shown.exit_code == 1
        assert "all 3 shards" not in shown.stdout
        assert "drift" in shown.stdout and "column 'name' (VARCHAR(200)) is missing" in shown.stdout
        assert "column 'note' (nullable) is not in the model" in shown.stdout


def test_check_notes_a_missing_helper_of_the_ownership_check_without_failing(
    urls: Callable[[int], list[str]], tmp_path: Path
) -> None:
    """A shard whose helpers of the ownership check are gone (an upgrade not yet applied, a hand
    edit): on SQLite its sessions read the whole check every time, which is slower, not wrong;
    on PostgreSQL without a pooler its sessions do not call the functions. ``schema check`` says
    so in a note, exits 0, and ``schema apply`` puts the helper back."""
    c, u1, u2 = urls(3)
    path = write_map(tmp_path, {"c": c, "u1": u1, "u2": u2})
    assert cli("apply", str(path)).exit_code == 0
    clean = cli("check", str(path), "--json")
    assert clean.exit_code == 0, clean.stdout
    assert [s["notes"] for s in json.loads(clean.stdout)["shards"]] == [[], [], []]

    helper = "mdb_check_read" if u2.startswith("postgresql") else "mdb_check_version_state_insert"
    ddl(u2, f"DROP FUNCTION {helper}" if u2.startswith("postgresql") else f"DROP TRIGGER {helper}")
    result = cli("check", str(path), "--json")
    assert result.exit_code == 0, result.stdout
    shards = {s["server"]: s for s in json.loads(result.stdout)["shards"]}
    assert shards["u2"]["ok"] and shards["u2"]["differences"] == []
    assert len(shards["u2"]["notes"]) == 1 and f"({helper})" in shards["u2"]["notes"][0], shards["u2"]
    assert shards["c"]["notes"] == shards["u1"]["notes"] == []
    shown = cli("check", str(path))
    assert shown.exit_code == 0 and "all 3 shards match the models" in shown.stdout
    assert f"note: u2: the ownership check's helpers are missing or outdated ({helper})" in " ".join(shown.stdout.split())

    assert cli("apply", str(path)).exit_code == 0
    assert [s["notes"] for s in json.loads(cli("check", str(path), "--json").stdout)["shards"]] == [[], [], []]


@pytest.mark.postgres
def test_check_fails_a_pooled_server_without_the_check_functions(
    pg_databases: Callable[[int], list[str]], pgbouncer: Callable[..., PgBouncer], tmp_path: Path
) -> None:
    """Behind a transaction pooler a session calls the check functions, and fails without them:
    on a server the map puts behind one, their absence is a problem (exit 1), not a note."""
    direct = dict(zip(("c", "u1"), pg_databases(2), strict=True))
    _bouncer, pooled = pooled_servers(pgbouncer, direct)
    path = write_pooled_map(tmp_path, pooled, direct, central=["c"], partitions=[("0:0:0", ["u1"])])
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**data, "models": ["mdb.demo.models"]}, sort_keys=False))
    assert cli("apply", str(path)).exit_code == 0
    assert cli("check", str(path)).exit_code == 0

    ddl(direct["u1"], "DROP FUNCTION mdb_check_read")
    result = cli("check", str(path), "--json")
    assert result.exit_code == 1, result.stdout
    shards = {s["server"]: s for s in json.loads(result.stdout)["shards"]}
    assert not shards["u1"]["ok"] and shards["u1"]["notes"] == [] and shards["u1"]["differences"] == []
    assert len(shards["u1"]["problems"]) == 1 and "(mdb_check_read)" in shards["u1"]["problems"][0], shards["u1"]
    assert "transaction pooler" in shards["u1"]["problems"][0] and shards["c"]["ok"]

    assert cli("apply", str(path)).exit_code == 0
    assert cli("check", str(path)).exit_code == 0


def test_check_changes_nothing_and_reports_a_down_server(tmp_path: Path) -> None:
    c, u1 = (f"sqlite:///{tmp_path / n}.db" for n in ("c", "u1"))
    path = write_models_map(tmp_path, {"c": c, "u1": u1, "u2": f"sqlite:///{tmp_path}"},
                            central=["c"], partitions=[("0:0:0", ["u1"])])
    result = cli("check", str(path), "--json")
    assert result.exit_code == 1, result.stdout
    shards = {s["server"]: s for s in json.loads(result.stdout)["shards"]}
    missing = {d["table"] for d in shards["u1"]["differences"] if d["kind"] == "missing table"}
    assert {"users", "mdb_shard_layout", "mdb_briefcase_state"} <= missing  # nothing was created
    assert shards["u2"]["error"] and not shards["u2"]["ok"]


# -- moves refuse to cross drift ----------------------------------------------------------------


@pytest.mark.parametrize("drifted", ["source", "target"])
def test_a_move_across_drift_is_refused_with_the_differences(
    urls: Callable[[int], list[str]], tmp_path: Path, drifted: str
) -> None:
    """On SQLite a source that lacks a model column used to crash the copy with a raw
    OperationalError (only the target's column names were compared); now both sides are
    compared before anything is written, and nothing moves."""
    c, u1, u2 = urls(3)
    cluster = make_cluster({"c": c, "u1": u1, "u2": u2}, tmp_path, [("0:0:0", ["u1"])])
    gdid = GDID(0, 0, 7)
    with cluster.store() as store:
        create_user(store, gdid)
    ddl(u1 if drifted == "source" else u2, "ALTER TABLE transactions DROP COLUMN memo")
    with cluster.store() as store:
        with pytest.raises(SchemaError) as caught:
            move_briefcase(store, "user", gdid, "u2")
        message = str(caught.value)
        server = "u1" if drifted == "source" else "u2"
        assert f"{server!r}" in message and "transactions: column 'memo'" in message and "is missing" in message
        with store.briefcase(UserBriefcase, gdid) as s:  # still on u1, not fenced, whole
            assert s.get(User, gdid) is not None
    engine = create_engine(sqlalchemy_url(u2))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM users")).scalar_one() == 0
    engine.dispose()


@pytest.mark.slow  # 78 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_the_cli_move_across_drift_is_one_error_line_not_a_traceback(tmp_path: Path) -> None:
    c, u1, u2 = (f"sqlite:///{tmp_path / n}.db" for n in ("c", "u1", "u2"))
    cluster = make_cluster({"c": c, "u1": u1, "u2": u2}, tmp_path, [("0:0:0", ["u1"])])
    gdid = GDID(0, 0, 9)
    with cluster.store() as store:
        create_user(store, gdid)
    ddl(u1, "ALTER TABLE transactions DROP COLUMN memo")
    command = [str(MDB), "move", str(cluster.path), "user", str(gdid), "--to", "u2"]
    for extra in ([], ["--json"]):  # with and without the progress display (which measures first)
        done = subprocess.run([*command, *extra], capture_output=True, text=True)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "'u1'" in done.stderr and "memo" in done.stderr and "mdb schema check" in done.stderr
    assert "transactions: column 'memo'" in done.stderr  # the precheck's full list


# -- a write into a drifted table ---------------------------------------------------------------


def test_a_write_into_a_drifted_table_is_a_schema_error_naming_server_and_table(
    urls: Callable[[int], list[str]], tmp_path: Path
) -> None:
    c, u1 = urls(2)
    cluster = make_cluster({"c": c, "u1": u1}, tmp_path, [("0:0:0", ["u1"])])
    gdid = GDID(0, 0, 11)
    with cluster.store() as store:
        create_user(store, gdid)
    ddl(u1, "ALTER TABLE transactions DROP COLUMN memo", "ALTER TABLE users DROP COLUMN name")
    with cluster.store() as store:
        with pytest.raises(SchemaError) as inserted:
            add_transaction(store, gdid, 1, 5)
        with pytest.raises(SchemaError) as updated:  # SQLite's "no such column: name" names no table
            with store.briefcase(UserBriefcase, gdid) as session:
                session.execute(update(User).where(User.user_id == gdid).values(name="renamed"))
    for caught, table in ((inserted, "transactions"), (updated, "users")):
        message = str(caught.value)
        assert f"server 'u1', table {table!r}: " in message and "mdb schema check" in message, message


def test_a_reshard_with_a_drifted_source_is_refused_before_anything_moves(tmp_path: Path) -> None:
    """A reshard's prechecks only checked that its sources were reachable; a drifted source
    failed its first move. Now the prechecks (and so the dry run) refuse it, before any move."""
    c, u1, u2 = (f"sqlite:///{tmp_path / n}.db" for n in ("c", "u1", "u2"))
    cluster = make_cluster({"c": c, "u1": u1, "u2": u2}, tmp_path, [("0:0:0", ["u1"])])
    with cluster.store() as store:
        for n in range(1, 5):
            create_user(store, GDID(0, 0, n))
    ddl(u1, "ALTER TABLE transactions DROP COLUMN memo")
    with cluster.store() as store:
        for dry_run in (True, False):
            with pytest.raises(SchemaError, match=r"reshard of user partition 0:0:0: the tables on 'u1' differ"):
                reshard(store, "user", GDID.ZERO, ["u2"], dry_run=dry_run, map_path=cluster.path)
    engine = create_engine(sqlalchemy_url(u2))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM users")).scalar_one() == 0
    engine.dispose()
