"""The fleet clusters and helpers shared by the fleet, metrics and ops-kit suites (tests/cli)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from support import forkserver
from support.moves import ROOT, Cluster, cloned_cluster, create_user, make_cluster, run_cli
from support.templates import Databases

from mdb.gdid import GDID
from mdb.store import Store

SHARDS = ["u1", "u2", "u3", "u4"]
SKEWED_USERS = [GDID(0, 0, i) for i in range(1, 25)]
"""The briefcases of :func:`build_skewed`."""
STATUS_SERVERS = ["u1", "u2", "x"]  # x: spare (in no area's layout)
STATUS_USERS = [GDID(0, 0, i) for i in range(1, 9)]
"""The briefcases of :func:`build` (the ``mdb status`` fleet)."""
HEALTHY, ATTENTION, BROKEN = 0, 5, 6


def _skewed_users(store: Store) -> None:
    for g in SKEWED_USERS:
        create_user(store, g, orders=10 if g.counter % 4 == 0 else 3, lines=3)


def build_skewed(urls: list[str], tmp_path: Path) -> Cluster:
    """4 shards; u1 holds 3x the bytes of each other shard (issue 17): its briefcases (counter % 4 == 0) have
    10 orders, the others 3 (with the user row, 10 orders weigh 3x what 3 do)."""
    return make_cluster(dict(zip(["c", *SHARDS], urls)), tmp_path, [("0:0:0", SHARDS)], seed=_skewed_users)


def cloned_skewed(pg_databases: Databases, tmp_path: Path) -> Cluster:
    """``build_skewed(pg_databases(1) + pg_databases(4), tmp_path)``, copied from a template (support.templates)."""
    return cloned_cluster(pg_databases, ["c", *SHARDS], tmp_path, [("0:0:0", SHARDS)], seed=_skewed_users, calls=[1, 4])


SERVE = """
import sys, urllib.request
from mdb import telemetry
from mdb.cli.metrics import serve_metrics
port = int(sys.argv[1])
with serve_metrics(port, host="127.0.0.1"):
    telemetry.move_done("user", None, 5, 0.1)
    telemetry.stale_retry("user", "u1", RuntimeError())
    print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
try:
    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
except OSError:
    print("CLOSED")
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return forkserver.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60, cwd=str(ROOT))


def _status_users(store: Store) -> None:
    for g in STATUS_USERS:
        create_user(store, g, orders=1, lines=1)


def build(urls: list[str], tmp_path: Path) -> Cluster:
    return make_cluster(dict(zip(["c", *STATUS_SERVERS], urls)), tmp_path, [("0:0:0", ["u1", "u2"])], seed=_status_users)


def cloned(pg_databases: Databases, tmp_path: Path, calls: list[int] | None = None) -> Cluster:
    """``build(pg_databases(4), tmp_path)`` (``calls=[1, 4]``: ``pg_databases(1) + pg_databases(4)``),
    copied from a template (support.templates)."""
    return cloned_cluster(pg_databases, ["c", *STATUS_SERVERS], tmp_path, [("0:0:0", ["u1", "u2"])], seed=_status_users,
                          calls=calls)


def status(cluster: Cluster, *extra: str) -> tuple[int, dict[str, Any]]:
    done = run_cli(["status", str(cluster.path), "--json", "--max-skew", "100", *extra])
    assert done.returncode in (HEALTHY, ATTENTION, BROKEN), (done.returncode, done.stdout, done.stderr)
    return done.returncode, json.loads(done.stdout)


def start_reshard(cluster: Cluster, point: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MDB_FAULT_POINT": point, "MDB_FAULT_ACTION": "sleep:600"}
    return forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", "reshard", str(cluster.path), "user",
                             "--partition", "0:0:0", "--shards", "u1,u2,x"], cwd=str(ROOT), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)


REVISION = '''"""a no-op revision: enough to put the fleet at two revisions"""
revision = "a1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
'''
