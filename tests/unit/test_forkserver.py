"""The tests' fork server (tests/support/forkserver.py) gives a child what ``exec`` would.

The fault suites run their ``mdb`` processes through it; a difference from a cold start (a
status, a signal, an environment, a descriptor) would change what they prove.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import forkserver

PY = sys.executable


def test_a_child_gets_its_argv_environment_folder_stdin_and_exit_status(tmp_path: Path) -> None:
    code = ("import os, sys\n"
            "print(sys.argv, os.getcwd(), os.environ.get('MDB_X'), 'MDB_Y' in os.environ, sys.stdin.read())\n"
            "sys.stderr.write('to stderr')\n"
            "sys.exit(3)")
    env = {k: v for k, v in os.environ.items() if k != "MDB_Y"} | {"MDB_X": "given"}
    done = forkserver.run([PY, "-c", code, "a", "b c"], input="piped", capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 3
    assert done.stdout == f"['-c', 'a', 'b c'] {tmp_path} given False piped\n"
    assert done.stderr == "to stderr"


def test_a_child_is_a_process_of_its_own_that_signals_reach() -> None:
    slow = forkserver.popen([PY, "-c", "import time; time.sleep(60)"])
    assert isinstance(slow, forkserver.ForkedPopen) and slow.poll() is None
    assert Path(f"/proc/{slow.pid}").exists() and slow.pid != os.getpid()
    slow.send_signal(signal.SIGKILL)
    assert slow.wait(timeout=30) == -signal.SIGKILL

    code = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('interrupted')\n    raise SystemExit(7)"
    interrupted = forkserver.popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # inside its sleep
    interrupted.send_signal(signal.SIGINT)
    assert interrupted.communicate(timeout=30) == ("interrupted\n", None) and interrupted.returncode == 7


def test_an_uncaught_exception_exits_1_with_its_traceback_and_no_descriptor_leaks_in() -> None:
    failed = forkserver.run([PY, "-c", "raise ValueError('boom')"], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: boom")
    fds = forkserver.run([PY, "-c", "import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')))"],
                         capture_output=True, text=True, timeout=60)
    assert fds.stdout.strip() == "[0, 1, 2, 3]"  # 3: the listing's own descriptor


def test_the_mdb_script_and_a_wait_with_a_timeout_work_as_with_exec() -> None:
    shown = forkserver.run([str(forkserver.MDB_SCRIPT), "--version"], capture_output=True, text=True, timeout=60)
    cold = subprocess.run([str(forkserver.MDB_SCRIPT), "--version"], capture_output=True, text=True, timeout=60)
    assert (shown.returncode, shown.stdout, shown.stderr) == (cold.returncode, cold.stdout, cold.stderr) == (0, cold.stdout, "")
    waiting = forkserver.popen([PY, "-c", "import time; time.sleep(60)"])
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.2)
    waiting.kill()
    assert waiting.wait(timeout=30) == -signal.SIGKILL


def test_a_child_whose_environment_differs_where_the_preloaded_imports_read_it_is_started_cold() -> None:
    """The server records the variables its imports read (OpenTelemetry's provider choice, for
    one); a child with another value there must import for itself."""
    same = forkserver.popen([PY, "-c", "pass"])
    other = forkserver.popen([PY, "-c", "pass"], env={**os.environ, "OTEL_PYTHON_CONTEXT": "contextvars_context"})
    assert type(same) is forkserver.ForkedPopen and type(other) is subprocess.Popen
    assert same.wait(timeout=60) == other.wait(timeout=60) == 0


def test_what_the_server_does_not_model_is_started_the_ordinary_way() -> None:
    own_session = forkserver.popen([PY, "-c", "pass"], start_new_session=True)
    assert type(own_session) is subprocess.Popen and own_session.wait(timeout=60) == 0
    child = forkserver.popen([PY, "-c", "import sys; print(sys.argv[1:])", b"\xff"], stdout=subprocess.PIPE)
    assert type(child) is subprocess.Popen and child.communicate(timeout=60)[0] == b"['\\udcff']\n"
