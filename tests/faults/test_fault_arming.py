"""Test hooks act only where the test harness armed them (``MDB_TESTING=1``, mdb.testing.arm).

A stray ``MDB_FAULT_POINT`` or ``MDB_MONGO_FAKE_DIR`` in a production environment must not
SIGKILL a process or swap a map's MongoDB servers for files; tests/support/plugin.py arms the test run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.mapfiles import write_map

from mdb import Registry, faults
from mdb.cli.app import open_store
from mdb.testing.mongo import FAKE_DIR_ENV, FakeMongo

PASS_A_POINT = "from mdb import faults; faults.register('test.arming'); faults.fault_point('test.arming'); print('passed')"


def _pass_a_point(**env: str) -> subprocess.CompletedProcess[str]:
    unarmed = {k: v for k, v in os.environ.items() if k != faults.TESTING_ENV}
    return subprocess.run([sys.executable, "-c", PASS_A_POINT], env={**unarmed, **env}, capture_output=True, text=True,
                          timeout=60)


def test_a_fault_point_kills_only_a_process_the_harness_armed() -> None:
    ignored = _pass_a_point(**{faults.ENV: "test.arming"})
    assert ignored.returncode == 0 and ignored.stdout == "passed\n", ignored.stderr
    killed = _pass_a_point(**{faults.ENV: "test.arming", faults.TESTING_ENV: "1"})
    assert killed.returncode == -signal.SIGKILL and killed.stdout == "", killed.stderr


@pytest.mark.parametrize("armed", [False, True])
def test_the_cli_takes_the_file_backed_mongodb_fake_only_when_armed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, armed: bool
) -> None:
    path = write_map(tmp_path, {"c": f"sqlite:///{tmp_path / 'central.db'}", "m1": "mongodb://fake-m1/m1"},
                     central=["c"], partitions=[("0:0:0", ["m1"])], area="docs")
    if not armed:
        monkeypatch.delenv(faults.TESTING_ENV)
    monkeypatch.setenv(FAKE_DIR_ENV, str(tmp_path / "fake"))
    monkeypatch.delenv("MDB_TEST_MONGO_URI", raising=False)
    with open_store(str(path), types=[], registry=Registry()) as store:  # no document types another test imported
        assert isinstance(store.mongo.clients.factory, FakeMongo) is armed
