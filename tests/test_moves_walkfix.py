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
from movehelp import ROOT, Cluster, create_user, make_cluster

from mdb.gdid import GDID
from mdb.moves.journal import Journal
from mdb.partition_map import parse_map

SERVERS = ["u1", "u2", "x"]
USERS = [GDID(0, 0, i) for i in range(1, 7)]


def cli(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `mdb ARGS` in a child process from folder CWD (relative paths resolve there)."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", "from mdb.cli import main; main()", *args],
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
