"""Named crash points for the move protocol, so tests can SIGKILL a real move at every step.

``MDB_FAULT_POINT=move.after_copy_commit`` in a process's environment makes that process kill
itself with SIGKILL the moment it reaches that point: no cleanup, no ``finally``, exactly what
a power cut or an OOM kill does. ``MDB_FAULT_SKIP=N`` lets the point pass N times first (to
crash in the middle of a reshard). ``MDB_FAULT_ACTION=sleep:S`` makes the point sleep S
seconds instead (a driver held alive mid-way, its heartbeat running: the lease tests). Unset, a
fault point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["FAULT_POINTS", "fault_point"]

FAULT_POINTS: tuple[str, ...] = (
    "move.after_journal_start",
    "move.after_precheck",
    "move.after_precopy",
    "move.after_lock",
    "move.during_copy",
    "move.after_copy_commit",
    "move.after_verify",
    "move.before_commit_point",
    "move.after_commit_point",
    "move.after_relocation",
    "move.after_target_state",
    "move.pause_abort.after_source_rollback",
    "reshard.after_journal_start",
    "reshard.after_plan",
    "reshard.after_prechecks",
    "reshard.after_first_move",
    "reshard.after_moves",
    "reshard.during_freeze",
    "reshard.after_freeze",
    "reshard.after_final_moves",
    "reshard.before_map_apply",
    "reshard.after_map_apply",
    "reshard.after_map_file",
    "reshard.after_unfreeze",
    "reshard.after_clear_relocations",
    "reshard.after_resident_cleanup",
    "resume.after_discard",
    "cancel.after_first_move_back",
)
"""Every point the code defines (tests iterate over these)."""

_lock = threading.Lock()
_passed: dict[str, int] = {}


def fault_point(name: str) -> None:
    """SIGKILL this process here when ``MDB_FAULT_POINT`` names this point (tests only)."""
    wanted = os.environ.get("MDB_FAULT_POINT")
    if wanted != name:
        return
    skip = int(os.environ.get("MDB_FAULT_SKIP", "0"))
    with _lock:
        seen = _passed.get(name, 0)
        _passed[name] = seen + 1
    if seen < skip:
        return
    action = os.environ.get("MDB_FAULT_ACTION", "kill")
    if action.startswith("sleep:"):
        time.sleep(float(action.removeprefix("sleep:")))
        return
    os.kill(os.getpid(), signal.SIGKILL)
