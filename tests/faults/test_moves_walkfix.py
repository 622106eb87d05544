"""Defects a new-user walkthrough of the moves tools found, on SQLite (the embedded default).

1. A reshard started with a relative map path and resumed from another folder must rewrite
   the map file it started with (it used to write a new file in the current folder).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml
from support import forkserver
from support.moves import ROOT, Cluster, create_user, make_cluster

from mdb.gdid import GDID
from mdb.moves.journal import Journal
from mdb.partition_map import parse_map

pytestmark = pytest.mark.slow  # processes killed or paused at fault points: seconds to minutes per test (docs/testing.md)

SERVERS = ["u1", "u2", "x"]
USERS = [GDID(0, 0, i) for i in range(1, 7)]


def cli(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `mdb ARGS` in a child process from folder CWD (relative paths resolve there)."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + full.get("PYTHONPATH", "")
    return forkserver.run([sys.executable, "-c", "from mdb.cli import main; main()", *args],
                          capture_output=True, text=True, env=full, timeout=120, cwd=str(cwd))


@pytest.fixture
def cluster(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> Cluster:
    tour = tmp_path / "tour"
    tour.mkdir()
    cluster = make_cluster(dict(zip(["c", *SERVERS], tmp_sqlite_urls(4))), tour, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g, orders=1, lines=1)
    return cluster


def test_resume_from_another_folder_rewrites_the_map_the_reshard_started_with(cluster: Cluster, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = cli(["reshard", cluster.path.name, "user", "--partition", "0:0:0", "--shards", "u1,u2,x"], cwd=cluster.path.parent,
              env={"MDB_FAULT_POINT": "reshard.after_final_moves"})
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stdout, run.stderr)
    with cluster.store() as store:
        [entry] = [e for e in Journal(store).entries(unfinished=True) if e.kind == "reshard"]
    assert entry.params["map_path"] == str(cluster.path.resolve())
    resumed = cli(["moves", "resume", str(cluster.path)], cwd=elsewhere)
    assert resumed.returncode == 0, (resumed.stdout, resumed.stderr)
    assert not (elsewhere / cluster.path.name).exists()
    new_map = parse_map(cluster.path.read_text(encoding="utf-8"), str(cluster.path))
    assert new_map.version == 2
    assert [p["shards"] for p in yaml.safe_load(cluster.path.read_text(encoding="utf-8"))["areas"]["user"]["partitions"]] == [["u1", "u2", "x"]]
    assert list(cluster.path.parent.glob("map.v1.before-*.yaml")), "the old map file is kept beside it"


def test_a_relative_path_journaled_by_an_older_mdb_resolves_against_the_given_map_or_is_refused(tmp_path: Path) -> None:
    from mdb.errors import MdbError
    from mdb.moves.journal import JournalEntry
    from mdb.moves.reshard import journaled_map_path

    entry = JournalEntry(move_id="reshard-old", kind="reshard", area="user", step="map_apply", status="running",
                         params={"map_path": "my-map.yaml"})
    given = tmp_path / "tour" / "my-map.yaml"
    assert journaled_map_path(entry, given) == str(given.resolve())
    with pytest.raises(MdbError, match=r"relative path 'my-map.yaml'.*run `mdb moves resume` with that map file \(my-map.yaml\)"):
        journaled_map_path(entry, tmp_path / "other.yaml")


def _locked_error(tmp_path: Path) -> Exception:
    """The real error SQLite gives a writer while another connection holds the file's write lock."""
    import sqlite3

    from sqlalchemy import create_engine

    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")
    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
    except Exception as exc:  # returned to the caller, which asserts on it
        return exc
    finally:
        holder.close()
        engine.dispose()
    raise AssertionError("the insert did not meet the lock")


def test_database_is_locked_is_a_retryable_mdb_error(tmp_path: Path) -> None:
    from mdb.dberrors import translate
    from mdb.errors import TransactionConflictError

    exc = _locked_error(tmp_path)
    assert "database is locked" in str(exc)
    mapped = translate("u1", exc)
    assert isinstance(mapped, TransactionConflictError)
    assert "server 'u1'" in str(mapped) and "database is locked" in str(mapped)


def test_a_driver_error_no_translation_knows_is_one_line_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    cli_app = importlib.import_module("mdb.cli.app")  # the module: `mdb.cli.app` the attribute is the Typer app
    exc = _locked_error(tmp_path)

    def raising(**_: object) -> int:
        raise exc

    monkeypatch.setattr(cli_app, "app", raising)
    with pytest.raises(SystemExit) as ended:
        cli_app.main()
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: database error: database is locked"


def test_reshard_with_parallel_on_sqlite_runs_one_move_at_a_time_and_says_so(cluster: Cluster) -> None:
    with cluster.store() as store:
        for i in range(10, 40):
            create_user(store, GDID(0, 0, i), orders=1, lines=1)
    run = cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x", "--parallel", "4"], cwd=cluster.path.parent)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "note: --parallel runs as 1: SQLite lets one writer at a time into a file (u1, u2, x are SQLite)" in run.stderr
    assert "Traceback" not in run.stderr
    with cluster.store() as store:
        [entry] = [e for e in Journal(store).entries() if e.kind == "reshard"]
    assert entry.params["parallel"] == 1 and entry.status == "done"


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
def test_a_move_onto_a_model_with_a_new_column_lists_the_drift_not_a_driver_error(
    cluster: Cluster, tmp_path: Path, extra: list[str]
) -> None:
    """The CLI (and a dry run) measured the briefcase by the models' columns before comparing
    the schema, so the user saw "no such column: users.name" under another table's name."""
    from sqlalchemy import create_engine, text

    from mdb.urls import sqlalchemy_url

    engine = create_engine(sqlalchemy_url(cluster.urls["u1"]))
    with engine.begin() as conn:  # the database predates the model's `name` column
        conn.execute(text("ALTER TABLE users DROP COLUMN name"))
    engine.dispose()
    gdid = next(g for g in USERS if g.sharding_value % 2 == 0)  # on u1 under [u1, u2]
    run = cli(["move", str(cluster.path), "user", str(gdid), "--to", "x", *extra], cwd=tmp_path)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.strip() == (
        f"error: move of user/{gdid} from 'u1' to 'x': the tables on 'u1' differ from the models "
        "(1 difference(s): users: column 'name' (VARCHAR(200)) is missing); nothing moved (run `mdb schema check MAP`)"
    )


def _popen(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", *args], cwd=str(cwd), env=full,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_ctrl_c_of_a_reshard_names_it_and_the_resume_command(cluster: Cluster) -> None:
    import time

    proc = _popen(["reshard", cluster.path.name, "user", "--partition", "0:0:0", "--shards", "u1,u2,x"], cwd=cluster.path.parent,
                  env={"MDB_FAULT_POINT": "reshard.after_first_move", "MDB_FAULT_ACTION": "sleep:600"})
    try:
        deadline = time.monotonic() + 120
        entry = None
        while entry is None and time.monotonic() < deadline:  # held alive after its first move
            assert proc.poll() is None, proc.communicate()
            with cluster.store() as store:
                entry = next((e for e in Journal(store).entries(unfinished=True) if e.briefcases_done >= 1), None)
            time.sleep(0.2)
        assert entry is not None, "the reshard never finished its first move"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert (f"note: reshard {entry.move_id} interrupted at step moves: run `mdb moves resume map.yaml` to finish it "
            f"(or `mdb moves cancel map.yaml {entry.move_id}` to undo it)") in err, err
    assert "Traceback" not in err


def test_ctrl_c_ends_moves_status_watch_with_130_and_no_error_line(cluster: Cluster) -> None:
    proc = _popen(["moves", "status", str(cluster.path), "--watch", "1"], cwd=cluster.path.parent)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline(), "the watch printed nothing"  # it is in its loop
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "error" not in err and "Traceback" not in err, err
