"""``mdb schema apply MAP`` on real PostgreSQL servers: tables on every shard, first stamps, idempotence.

URLs carry a password (the test servers use trust auth and ignore it) so every output can be
checked for leaks.
"""

from __future__ import annotations

import pytest
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from support import forkserver
from support.mapfiles import map_dict
from sqlalchemy import create_engine, inspect, select, update
from typer.testing import CliRunner

from mdb.cli import app
from mdb.urls import sqlalchemy_url
from mdb.partition_map import load_map
from mdb.router import Router
from mdb.system_tables import shard_layout
from support.schema import write_models_map

MDB = Path(sys.executable).parent / "mdb"

SECRET = "Tr0ub4dor-schema-7c1"
BRIEFCASE_TABLES = {"users", "pay_accounts", "account_authorization_history", "addresses", "orders",
                    "order_line_items", "transactions", "balances"}
runner = CliRunner()


def with_password(url: str) -> str:
    return url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://postgres:{SECRET}@", 1)


def run(*args: str) -> Any:
    result = runner.invoke(app, ["schema", "apply", *args], env={"COLUMNS": "250"})
    assert SECRET not in result.stdout and SECRET not in result.stderr
    return result


def tables_of(url: str) -> set[str]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def stamps_of(url: str) -> set[tuple[Any, ...]]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(shard_layout.c.area, shard_layout.c.partition_start, shard_layout.c.partition_end,
                                       shard_layout.c.shard_index, shard_layout.c.shard_count))
            return {tuple(r) for r in rows}
    finally:
        engine.dispose()


def test_apply_creates_tables_stamps_layouts_and_is_idempotent(pg_databases: Any, tmp_path: Path) -> None:
    c, u1, u2 = (with_password(u) for u in pg_databases(3))
    spare = with_password(pg_databases(1)[0])
    servers = {"c": c, "u1": u1, "u2": u2, "spare": spare}
    path = write_models_map(tmp_path, servers, central=["c"], partitions=[("0:0:0", ["u1", "u2"]), ("0:0:500", ["c"])])

    first = run(str(path), "--json")
    assert first.exit_code == 0, first.stdout + first.stderr
    report = json.loads(first.stdout)
    assert report["ok"] and report["map_version"] == 1
    shards = {s["server"]: s for s in report["shards"]}
    assert shards["c"]["roles"] == ["central", "user"]
    assert shards["u1"]["roles"] == ["user"] and shards["spare"]["roles"] == ["spare"]
    assert {"mdb_relocations", "mdb_shard_layout", "mdb_briefcase_state"} | BRIEFCASE_TABLES <= set(shards["c"]["created"])
    assert "mdb_relocations" not in shards["u1"]["created"] and BRIEFCASE_TABLES <= set(shards["u1"]["created"])
    assert BRIEFCASE_TABLES <= set(shards["spare"]["created"])  # ready to receive moves
    assert sorted(shards["c"]["stamped"]) == ["central", "user"] and shards["spare"]["stamped"] == []
    assert all(SECRET not in s["url"] and "***" in s["url"] for s in report["shards"])

    # What is on the servers, not only what the report says.
    router = Router(load_map(path))
    expected: dict[str, set[tuple[Any, ...]]] = {name: set() for name in servers}
    for server, layout in router.layouts():
        expected[server].add((layout.area, layout.partition_start, layout.partition_end, layout.shard_index,
                              layout.shard_count))
    for name, url in servers.items():
        assert BRIEFCASE_TABLES <= tables_of(url), name
        assert stamps_of(url) == expected[name], name
    assert "mdb_relocations" in tables_of(c) and "mdb_relocations" not in tables_of(u2)

    second = run(str(path))  # the table, for people
    assert second.exit_code == 0, second.stdout
    assert "(kept)" in second.stdout and "(new)" not in second.stdout and "all 4 shards ok" in second.stdout
    third = json.loads(run(str(path), "--json").stdout)
    for shard in third["shards"]:
        assert shard["created"] == [] and shard["stamped"] == [] and shard["ok"], shard
        assert sorted(shard["kept"]) == sorted(shards[shard["server"]]["stamped"])
    for name, url in servers.items():
        assert stamps_of(url) == expected[name]


def test_a_conflicting_stamp_is_reported_and_the_rest_applied(pg_databases: Any, tmp_path: Path) -> None:
    c, u1, u2 = (with_password(u) for u in pg_databases(3))
    path = write_models_map(tmp_path, {"c": c, "u1": u1, "u2": u2}, central=["c"], partitions=[("0:0:0", ["u1", "u2"])])
    assert run(str(path)).exit_code == 0
    engine = create_engine(sqlalchemy_url(u2))
    with engine.begin() as conn:  # as if another map had put u2 first
        conn.execute(update(shard_layout).where(shard_layout.c.area == "user").values(shard_index=0))
    engine.dispose()
    result = run(str(path), "--json")
    assert result.exit_code == 1
    shards = {s["server"]: s for s in json.loads(result.stdout)["shards"]}
    assert not shards["u2"]["ok"] and "mdb map apply" in shards["u2"]["problems"][0]
    assert shards["u1"]["ok"] and shards["c"]["ok"]
    text = run(str(path))
    assert text.exit_code == 1 and "problems" in text.stdout and "1 of 3 shards not done: u2" in text.stdout


def test_models_option_and_a_bad_module(tmp_path: Path, tmp_sqlite_urls: Any) -> None:
    c, u1 = tmp_sqlite_urls(2)
    data = map_dict({"c": c, "u1": u1}, central=["c"], partitions=[("0:0:0", ["u1"])])
    path = tmp_path / "plain.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    result = run(str(path), "--models", "mdb.demo.models", "--json")
    assert result.exit_code == 0, result.stdout
    assert BRIEFCASE_TABLES <= set(json.loads(result.stdout)["shards"][1]["created"])
    bad = run(str(path), "--models", "no_such_pkg.models")
    assert bad.exit_code == 2 and "cannot import models module 'no_such_pkg.models'" in bad.stderr


@pytest.mark.slow  # 22 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_the_console_script_imports_models_from_the_folder_it_runs_in(tmp_path: Path) -> None:
    """A map's ``models: [tourapp.models]`` is found in the current folder, as with ``python -m``
    (a console script does not put the current folder on the import path by itself)."""
    package = tmp_path / "tourapp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(
        "from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column\n"
        "from mdb import GDID, GDIDType, BriefcaseType\n"
        "class Base(DeclarativeBase):\n"
        "    type_annotation_map = {GDID: GDIDType}\n"
        "class Member(Base):\n"
        "    __tablename__ = 'tour_members'\n"
        "    member_id: Mapped[GDID] = mapped_column(primary_key=True)\n"
        "class MemberBriefcase(BriefcaseType):\n"
        "    area, key, root, children = 'member', 'member_id', Member, ()\n"
    )
    (tmp_path / "map.yaml").write_text(
        yaml.safe_dump({
            "version": 1, "models": ["tourapp.models"],
            "servers": {"c": {"primary": "sqlite:///data/c.db"}, "m": {"primary": "sqlite:///data/m.db"}},
            "areas": {"central": {"kind": "central", "shards": ["c"]}, "member": {"partitions": [{"start": "0:0:0", "shards": ["m"]}]}},
        })
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = forkserver.run([str(MDB), "schema", "apply", "map.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "tour_members" in inspect(create_engine(f"sqlite:///{tmp_path / 'data' / 'm.db'}")).get_table_names()
