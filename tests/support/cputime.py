"""Where the suite's CPU goes: each test's CPU, its servers and child processes included.

The whole suite is CPU-bound on 2 cores (docs/testing.md), so what shortens it is less work, and
a test's wall time under ``-n 3`` says little about its work. With ``MDB_TEST_CPU_LOG=<file>``
each test appends one line, ``<cpu seconds> <wall seconds> <node id>``, where CPU is everything
the pytest process and its descendants used from the test's setup to its teardown: its own
threads, the ``mdb`` and writer processes it started, and the PostgreSQL servers of the session
(a server's exited backends are in its postmaster's ``cutime``, and an exited child's CPU in
its parent's, so the sum over the tree only grows). A server the worker shares between tests
charges its idle work (checkpoints, autovacuum) to whichever test is running.

``sort -rn <file> | head`` lists the costliest tests. Without the variable this plugin does
nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest

__all__ = ["tree_cpu_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, utime + stime + cutime + cstime in ticks) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is fields[0]
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by ``root`` and every live descendant, with their reaped children."""
    stats = {int(pid): s for pid in os.listdir("/proc") if pid.isdigit() and (s := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo += children.get(pid, [])
    return total / _TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    log = os.environ.get("MDB_TEST_CPU_LOG")
    if not log:
        yield
        return
    cpu, wall = tree_cpu_seconds(os.getpid()), time.monotonic()
    yield
    cpu, wall = tree_cpu_seconds(os.getpid()) - cpu, time.monotonic() - wall
    with open(log, "a") as out:  # one short line per write: appends from the workers do not interleave
        out.write(f"{cpu:.2f} {wall:.2f} {item.nodeid}\n")
