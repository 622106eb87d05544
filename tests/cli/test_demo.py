"""``mdb demo`` as a user runs it: a subprocess on a fresh folder, then again on the same folder."""

from __future__ import annotations

import pytest
import os
import subprocess
import sys
from pathlib import Path

from mdb import Store
from mdb.central.reconcile import check
from mdb.demo.models import UserBriefcase
from mdb.demo.repositories import EmailIndex
from mdb.demo.runner import shard_counts

MDB = [sys.executable, "-c", "from mdb.cli import main; main()"]


def run(*args: str) -> str:
    proc = subprocess.run([*MDB, *args], capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.slow  # 87 s measured at load ~15 on 2 cores: docs/testing.md
def test_demo_runs_twice_on_the_same_folder(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    first = run("demo", "--dir", str(folder), "--users", "24")
    assert "registered 24 new users (numbers from 1)" in first
    assert "briefcases and rows per shard" in first and "CENTRAL lookups by email" in first and "cache:" in first
    second = run("demo", "--dir", str(folder), "--users", "10")
    assert "continuing in" in second
    assert "registered 10 new users (numbers from 25), skipped 0" in second
    with Store.from_yaml(folder / "map.yaml", types=[UserBriefcase]) as store:
        counts = shard_counts(store)
        assert sum(c.briefcases for c in counts) == 34
        assert {str(c.partition_start) for c in counts if c.briefcases} == {"0:0:0", "0:0:200"}
        report = check(store.central, [EmailIndex])
        assert report.ok and report.entries == 34 and report.briefcases == 34
    out = run("central", "lookup", str(folder / "map.yaml"), "user_email", "user000030@demo.example")
    assert "-> 0:0:" in out


@pytest.mark.slow  # 25 s measured at load ~15 on 2 cores: docs/testing.md
def test_demo_on_a_postgresql_map(pg_databases, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from mdb.cli import app
    from support.central import make_map

    urls = pg_databases(2) + pg_databases(2)
    path = make_map(tmp_path, urls)
    result = CliRunner().invoke(app, ["demo", "--map", str(path), "--users", "12"])
    assert result.exit_code == 0, result.output
    assert "registered 12 new users (numbers from 1)" in result.output
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert sum(c.briefcases for c in shard_counts(store)) == 12
        assert check(store.central, [EmailIndex]).ok
