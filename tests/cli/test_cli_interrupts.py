"""A SIGTERM landing inside a finalizer still stops the command, with no traceback on stderr.

Each case runs in its own interpreter (signal handlers, the root logger and the unraisable hook
are process-wide), set up by ``interrupts.install()`` exactly as ``mdb``'s ``main`` does.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from mdb.cli.interrupts import OneLineLog

SIGTERM_DURING_A_POOL_RESET = """
import os, signal
from sqlalchemy import create_engine, event
from mdb.cli import interrupts
interrupts.install()
engine = create_engine("sqlite://")
@event.listens_for(engine, "reset")
def signalled(dbapi_connection, record, state):
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode: inside the pool's reset
    for _ in range(1000):
        pass
try:
    with engine.connect():
        pass
except KeyboardInterrupt:
    print("stopped", interrupts.terminated())
"""
SIGTERM_DURING_A_DEL = """
import os, signal, time
from mdb.cli import interrupts
interrupts.install()
class Held:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the interrupt is raised inside __del__, which cannot raise
        for _ in range(1000):
            pass
try:
    held = Held()
    del held
    time.sleep(30)
    print("ran on")
except KeyboardInterrupt:
    print("stopped", interrupts.terminated())
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_sigterm_during_a_pool_reset_stops_without_the_pools_traceback() -> None:
    proc = _run(SIGTERM_DURING_A_POOL_RESET)
    assert proc.stdout.strip() == "stopped True", (proc.stdout, proc.stderr)
    assert proc.stderr == "", proc.stderr  # SQLAlchemy logged the interrupt with its traceback: dropped


def test_sigterm_swallowed_by_a_del_is_delivered_again_and_stops_the_command() -> None:
    proc = _run(SIGTERM_DURING_A_DEL)
    assert proc.stdout.strip() == "stopped True", (proc.stdout, proc.stderr)
    assert proc.stderr == "", proc.stderr  # no "Exception ignored in ..." and its traceback


def test_other_log_records_print_as_one_masked_line_with_their_exception(capsys: pytest.CaptureFixture[str]) -> None:
    log = logging.getLogger("tests.cli.interrupts")
    handler = OneLineLog()
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            raise ValueError("could not reach\npostgresql://app:s3cret@db1/main")
        except ValueError:
            log.error("closing idle connections of %s failed", "db1", exc_info=True)
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            log.error("Exception during reset or similar", exc_info=True)
        log.info("below the handler's level")
        log.warning("a plain warning")
    finally:
        log.removeHandler(handler)
        log.propagate = True
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "closing idle connections of db1 failed (ValueError: could not reach postgresql://app:***@db1/main)",
        "a plain warning",
    ], err
