"""Named crash points, one registry for every protocol that must survive a crash at any step.

SQL moves, reshards, resume, cancel, document moves and CENTRAL's atomic creation each
:func:`register` the names of their points at import time; registering a name twice fails, so
two protocols can never share (and so confuse) a point. Tests reach a point two ways:

* ``MDB_FAULT_POINT=batch.after_precopy`` in the environment of a process the test harness
  armed (``MDB_TESTING=1``, set by :func:`mdb.testing.arm` from tests/support/plugin.py and inherited
  by the processes tests start) makes that process kill itself with SIGKILL the moment it
  reaches that point: no cleanup, no ``finally``, exactly what a power cut or an OOM kill does.
  ``MDB_FAULT_SKIP=N`` lets the point pass N times first (to crash in the middle of a reshard).
  ``MDB_FAULT_ACTION=sleep:S`` makes the point sleep S seconds instead (a driver held alive
  mid-way, its heartbeat running: the lease tests), and ``MDB_FAULT_ACTION=stop`` makes the
  process SIGSTOP itself there, once: paused exactly at that step, with its transactions and
  locks held, until the test sends SIGCONT (a driver paused past its lease:
  tests/faults/test_moves_fencing.py; repair tools against a move caught mid-way:
  tests/faults/test_fsck_moves.py).
* :data:`hook`, a callable given each point's name as the process passes it, for in-process
  tests (a test raises from it to stand in for a crash, or changes data at the exact step).

Without ``MDB_TESTING=1`` the ``MDB_FAULT_*`` variables are ignored: a stray one in a production
environment never kills a process. Unset, a fault point costs one dict lookup. This module sits
below every protocol that uses it (CENTRAL is a lower layer than the move tools): it imports
nothing of mdb but its errors.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from mdb.errors import FaultPointError

__all__ = ["ENV", "TESTING_ENV", "armed", "fault_point", "hook", "kill", "points", "register"]

ENV = "MDB_FAULT_POINT"
TESTING_ENV = "MDB_TESTING"
"""``MDB_TESTING=1``: the test harness's switch for the environment's test hooks (the ``MDB_FAULT_*``
points here, the CLI's file-backed MongoDB fake). Nothing in mdb sets it; only mdb.testing does."""

hook: Callable[[str], None] | None = None
"""Tests assign a callable that receives each point's name as it is passed (None: no hook)."""

_registered: dict[str, None] = {}
_lock = threading.Lock()
_passed: dict[str, int] = {}


def register(*names: str) -> tuple[str, ...]:
    """Declare crash points; returns them (a module keeps the tuple for its tests to iterate).

    A name registered before (by this module or another) fails: one name, one place in the code.
    """
    with _lock:
        for name in names:
            if name in _registered:
                raise FaultPointError(f"fault point {name!r} is registered twice")
            _registered[name] = None
    return names


def points(prefix: str = "") -> tuple[str, ...]:
    """Every registered point whose name starts with ``prefix``, in registration order."""
    return tuple(name for name in _registered if name.startswith(prefix))


def armed() -> bool:
    """Whether the test harness switched the environment's test hooks on (``MDB_TESTING=1``)."""
    return os.environ.get(TESTING_ENV) == "1"


def kill() -> None:
    """SIGKILL this process now (what a point does when the environment names it)."""
    os.kill(os.getpid(), signal.SIGKILL)


def fault_point(name: str) -> None:
    """Pass the point ``name``: call :data:`hook`, and SIGKILL here when armed and ``MDB_FAULT_POINT`` names it."""
    if name not in _registered:
        raise FaultPointError(f"fault point {name!r} is not registered")
    if hook is not None:
        hook(name)
    if os.environ.get(ENV) != name or not armed():
        return
    skip = int(os.environ.get("MDB_FAULT_SKIP", "0"))
    with _lock:
        seen = _passed.get(name, 0)
        _passed[name] = seen + 1
    if seen < skip:
        return
    action = os.environ.get("MDB_FAULT_ACTION", "kill")
    if action == "stop":
        if seen == skip:  # once: after SIGCONT the process goes on past this point and any later pass
            # Sent to this thread, not the process: a process-directed SIGSTOP is taken by whichever
            # thread the kernel picks (the main one), and this one ran on for a moment first (into
            # a connect whose timeout then expired during the stop: a point passed in a worker thread).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return
    if action.startswith("sleep:"):
        time.sleep(float(action.removeprefix("sleep:")))
        return
    kill()
