"""``mdb`` commands and ``mdb worker`` processes started in the background by the job tests (tests/faults).

Every process started here is remembered: the ``no_process_left`` fixture kills what a failed
test left running (a worker would go on working on the next test's databases' jobs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support import forkserver
from support.moves import ROOT, Cluster

SPAWNED: list[subprocess.Popen[str]] = []


def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``mdb ARGS`` in the background, with ``env`` over this process's environment; stdout and stderr piped."""
    full = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    proc = forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", *args], cwd=str(ROOT), env=full,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    SPAWNED.append(proc)
    return proc


def worker(cluster: Cluster, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``mdb worker MAP`` in the background."""
    return spawn(["worker", str(cluster.path)], env)


def stop(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    """SIGTERM every live one (each finishes or gives back its batch), then their exit codes and output."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    out = []
    for p in procs:
        stdout, err = p.communicate(timeout=180)
        out.append((p.returncode, stdout + err))
    return out


@pytest.fixture
def no_process_left() -> Iterator[None]:
    """Kill whatever this module's test started and left running."""
    yield
    while SPAWNED:
        p = SPAWNED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()
