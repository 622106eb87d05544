"""Server identity (issue 29): a changed URL that reaches another database is refused, not trusted.

The operator's sequence from the issue, on real PostgreSQL through the installed ``mdb``: a
4-shard fleet with users, then ``user-2``'s URL changed to a mistyped, empty database and the
version bumped. Before, ``map apply --dry-run`` called it safe, ``schema apply`` stamped the
empty database as ``user-2``, and ``central repair`` deleted the index entries of every user
on the real ``user-2``. Now each step refuses, naming the server, both URLs and both
identities, and nothing is stamped, repaired or lost.

URLs carry a password (the test servers use trust auth and ignore it) so every output can be
checked for leaks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import forkserver
from support.mapfiles import map_dict
from sqlalchemy import create_engine, func, inspect, select, text

from mdb import Store
from mdb.central.indexes import central_index
from mdb.demo.models import UserBriefcase
from mdb.demo.repositories import UserRepository
from mdb.maps.history import maps_table
from mdb.maps.identity import identity_table, server_ids
from mdb.urls import sqlalchemy_url

MDB = Path(sys.executable).parent / "mdb"
SECRET = "Tr0ub4dor-identity-3f9"
PW_ENV = "MDB_TEST_IDENTITY_PW"
"""Maps name the password as ${MDB_TEST_IDENTITY_PW}, as map apply requires (it records the text)."""
USERS = ["user-1", "user-2", "user-3", "user-4"]
MODELS = ["mdb.demo.models", "mdb.demo.repositories"]


def with_password(url: str) -> str:
    return url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://postgres:{SECRET}@", 1)


def mdb(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed console script, as an operator types it; no output may carry the password."""
    proc = forkserver.run([str(MDB), *args], capture_output=True, text=True, cwd=cwd, timeout=180,
                          env={**os.environ, PW_ENV: SECRET, "COLUMNS": "250"})
    assert SECRET not in proc.stdout and SECRET not in proc.stderr
    return proc


def tables_of(url: str) -> set[str]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def one_value(url: str, query: Any) -> Any:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return conn.execute(query).scalar()
    finally:
        engine.dispose()


@dataclass
class Fleet:
    urls: dict[str, str]
    typo: str
    """A database nobody prepared: what a mistyped database name in a URL reaches."""
    folder: Path

    def write(self, name: str, version: int, **changed: str) -> Path:
        servers = {**self.urls, **changed}
        data = map_dict(servers, central=["central"], partitions=[("0:0:0", USERS)], version=version)
        data["models"] = MODELS
        path = self.folder / name
        path.write_text(yaml.safe_dump(data, sort_keys=False).replace(SECRET, "${" + PW_ENV + "}"), encoding="utf-8")
        return path

    def entries(self) -> int:
        return int(one_value(self.urls["central"], select(func.count()).select_from(central_index)))


@pytest.fixture
def fleet(pg_databases: Callable[[int], list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    monkeypatch.setenv(PW_ENV, SECRET)
    urls = [with_password(u) for u in pg_databases(3) + pg_databases(3)]
    names = ["central", *USERS]
    yield Fleet(dict(zip(names, urls[:5])), urls[5], tmp_path)


def register(path: Path, count: int, prefix: str) -> dict[str, int]:
    """Register users through the application's repository; returns users per server."""
    per_server: dict[str, int] = {}
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        users = UserRepository(store)
        for i in range(count):
            gdid = users.register(f"{prefix}{i}@example.com", f"user {i}")
            server = store.router.locate("user", gdid).server
            per_server[server] = per_server.get(server, 0) + 1
    return per_server


@pytest.mark.slow  # 369 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_a_mistyped_database_url_is_refused_at_every_step_and_nothing_is_lost(fleet: Fleet) -> None:
    v1 = fleet.write("v1.yaml", 1)
    first = mdb("schema", "apply", str(v1), "--json", cwd=fleet.folder)
    assert first.returncode == 0, first.stdout + first.stderr
    identities = {s["server"]: s["identity"] for s in json.loads(first.stdout)["shards"]}
    assert all(identities.values()) and len(set(identities.values())) == 5  # one per database
    per_server = register(v1, 40, "before")
    assert per_server.get("user-2", 0) > 0
    entries = fleet.entries()

    v2 = fleet.write("v2.yaml", 2, **{"user-2": fleet.typo})

    # 1. map check: the URL reaches another database; both URLs (masked) and both identities named.
    check = mdb("map", "check", str(v2), cwd=fleet.folder)
    assert check.returncode == 2, check.stdout + check.stderr
    assert "refused" in check.stdout and "'user-2'" in check.stdout
    assert identities["user-2"] in check.stdout and "carries no mdb identity" in check.stdout
    typo_db = sqlalchemy_url(fleet.typo).database or ""
    user2_db = sqlalchemy_url(fleet.urls["user-2"]).database or ""
    assert typo_db in check.stdout and user2_db in check.stdout and "***" in check.stdout

    # 2. map apply --dry-run, then map apply: refused in the diff, exit 2.
    dry = mdb("map", "apply", str(v1), str(v2), "--dry-run", cwd=fleet.folder)
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert "server-identity" in dry.stdout and "refused" in dry.stdout and "changes are safe" not in dry.stdout
    real = mdb("map", "apply", str(v1), str(v2), cwd=fleet.folder)
    assert real.returncode == 2, real.stdout + real.stderr
    assert "schema apply" not in real.stdout + real.stderr  # no hint that completes the mistake

    # 3. schema apply with the mistyped map: user-2 refused, the empty database left untouched.
    schema = mdb("schema", "apply", str(v2), "--json", cwd=fleet.folder)
    assert schema.returncode == 1
    shards = {s["server"]: s for s in json.loads(schema.stdout)["shards"]}
    assert not shards["user-2"]["ok"] and identities["user-2"] in shards["user-2"]["error"]
    assert "nothing was created or stamped" in shards["user-2"]["error"]
    assert all(shards[s]["ok"] for s in shards if s != "user-2")
    assert tables_of(fleet.typo) == set()  # nothing stamped, no identity written

    # 4. central check/repair through the mistyped map: user-2's entries are unreachable, not dangling.
    central = mdb("central", "check", str(v2), "--json", cwd=fleet.folder)
    assert central.stdout.startswith("{"), central.stdout[:2000] + central.stderr
    counts = json.loads(central.stdout)["counts"]
    assert central.returncode == 1 and counts["dangling"] == 0 and counts["unreachable"] == per_server["user-2"]
    repair = mdb("central", "repair", str(v2), "--json", cwd=fleet.folder)
    assert repair.returncode == 1 and repair.stdout.startswith("{"), repair.stdout[:2000] + repair.stderr
    assert json.loads(repair.stdout)["fixed"] == {} and fleet.entries() == entries
    # fsck through the mistyped map stops at user-2 (another database: none of the area's tables) and
    # never suggests the repair that would complete the mistake.
    fsck = mdb("fsck", str(v2), "user", "--json", cwd=fleet.folder)
    assert fsck.returncode == 2 and "user-2" in fsck.stderr, fsck.stdout[:2000] + fsck.stderr
    assert "central repair" not in fsck.stdout + fsck.stderr

    # Nothing was applied: the system still runs v1 and every user is there.
    assert one_value(fleet.urls["central"], select(func.count()).select_from(maps_table)) == 0
    with Store.from_yaml(v1, types=[UserBriefcase]) as store:
        users = UserRepository(store)
        for i in range(40):
            gdid = users.find_by_email(f"before{i}@example.com")
            assert gdid is not None and users.get(gdid) is not None, i
    healthy = mdb("central", "check", str(v1), cwd=fleet.folder)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr


@pytest.mark.slow  # 119 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_a_changed_url_that_reaches_the_same_database_is_accepted(fleet: Fleet) -> None:
    v1 = fleet.write("v1.yaml", 1)
    assert mdb("schema", "apply", str(v1), cwd=fleet.folder).returncode == 0
    # Another spelling of the same database: the same identity answers.
    same = fleet.urls["user-1"].replace("@localhost:", "@127.0.0.1:") if "@localhost:" in fleet.urls["user-1"] else \
        fleet.urls["user-1"] + ("&" if "?" in fleet.urls["user-1"] else "?") + "application_name=mdb-renamed"
    assert same != fleet.urls["user-1"]
    v2 = fleet.write("v2.yaml", 2, **{"user-1": same})
    check = mdb("map", "check", str(v2), "--json", cwd=fleet.folder)
    assert check.returncode == 0, check.stdout + check.stderr
    found = json.loads(check.stdout)["identities"]
    verdicts = {s["server"]: s["verdict"] for s in found["servers"]}
    assert found["checked"] and verdicts["user-1"] == "ok" and set(verdicts.values()) == {"ok"}
    applied = mdb("map", "apply", str(v1), str(v2), cwd=fleet.folder)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "map version 2 applied" in applied.stdout


@pytest.mark.slow  # 71 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_two_swapped_urls_are_both_refused(fleet: Fleet) -> None:
    v1 = fleet.write("v1.yaml", 1)
    assert mdb("schema", "apply", str(v1), cwd=fleet.folder).returncode == 0
    v2 = fleet.write("v2.yaml", 2, **{"user-1": fleet.urls["user-2"], "user-2": fleet.urls["user-1"]})
    result = mdb("map", "apply", str(v1), str(v2), "--json", cwd=fleet.folder)
    assert result.returncode == 2
    refused = [c for c in json.loads(result.stdout)["changes"] if c["verdict"] == "refused"]
    assert sorted(c["subject"] for c in refused) == ["server user-1", "server user-2"]
    assert all(c["kind"] == "server-identity" and "reaches a database with identity" in c["reason"] for c in refused)


def test_a_fleet_from_before_identities_is_adopted_and_then_protected(fleet: Fleet) -> None:
    v1 = fleet.write("v1.yaml", 1)
    assert mdb("schema", "apply", str(v1), cwd=fleet.folder).returncode == 0
    for url in fleet.urls.values():  # as if schema apply had run before identities existed
        engine = create_engine(sqlalchemy_url(url))
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {identity_table.name}"))
            conn.execute(text(f"DROP TABLE IF EXISTS {server_ids.name}"))
        engine.dispose()
    v2 = fleet.write("v2.yaml", 2, **{"user-2": fleet.typo})
    # No record and no identity anywhere: the dry run cannot confirm the new URL, and says so.
    dry = mdb("map", "apply", str(v1), str(v2), "--dry-run", "--json", cwd=fleet.folder)
    rows = [c for c in json.loads(dry.stdout)["diff"]["changes"] if c["kind"] == "server-identity"]
    assert [r["subject"] for r in rows] == ["server user-2"] and "cannot" not in rows[0]["reason"]
    assert "neither" in rows[0]["reason"]
    # The real apply gives the running databases their identities first, then refuses the typo.
    real = mdb("map", "apply", str(v1), str(v2), cwd=fleet.folder)
    assert real.returncode == 2, real.stdout + real.stderr
    assert "'user-2'" in real.stderr and "leads to another database" in real.stderr and tables_of(fleet.typo) == set()
    recorded = one_value(fleet.urls["central"], select(func.count()).select_from(server_ids))
    assert recorded == 5
    assert identity_table.name in tables_of(fleet.urls["user-2"])


def test_map_check_refuses_a_literal_password_like_map_apply(tmp_path: Path) -> None:
    data = map_dict({"c": f"postgresql+psycopg://mdb:{SECRET}@127.0.0.1:1/c"}, central=["c"])
    path = tmp_path / "secret.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    result = mdb("map", "check", str(path), "--offline", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "carries a literal password" in result.stdout and "'c' primary URL" in result.stdout


def test_map_check_says_when_it_could_not_ask_the_system(tmp_path: Path) -> None:
    data = map_dict({"c": "postgresql+psycopg://mdb:${MDB_TEST_IDENTITY_PW}@127.0.0.1:1/c"}, central=["c"])
    path = tmp_path / "down.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    proc = forkserver.run([str(MDB), "map", "check", str(path), "--json"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120, env={**os.environ, PW_ENV: SECRET})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout)
    assert found["ok"] and not found["identities"]["checked"] and "CENTRAL did not answer" in found["identities"]["not_checked"]
    assert SECRET not in proc.stdout + proc.stderr
    offline = mdb("map", "check", str(path), "--offline", cwd=tmp_path)
    assert offline.returncode == 0 and "server identities not checked (--offline)" in offline.stdout


def test_map_show_lists_pooler_and_direct_masked(tmp_path: Path) -> None:
    data = map_dict({"c": "postgresql+psycopg://mdb:${MDB_TEST_IDENTITY_PW}@127.0.0.1:1/c"}, central=["c"])
    data["servers"]["c"].update(pooler="transaction", direct="postgresql+psycopg://mdb:${MDB_TEST_IDENTITY_PW}@127.0.0.1:2/c")
    path = tmp_path / "pooled.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    env = {**os.environ, PW_ENV: SECRET, "COLUMNS": "250"}
    shown = forkserver.run([str(MDB), "map", "show", str(path), "--json"], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120, env=env)
    assert shown.returncode == 0, shown.stderr
    server = json.loads(shown.stdout)["servers"]["c"]
    assert server["pooler"] == "transaction" and server["direct"] == "postgresql+psycopg://mdb:***@127.0.0.1:2/c"
    table = forkserver.run([str(MDB), "map", "show", str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=120, env=env)
    assert "transaction" in table.stdout and "127.0.0.1:2/c" in table.stdout and SECRET not in table.stdout + table.stderr
