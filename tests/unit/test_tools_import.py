"""Every benchmark module imports against the library as it is now.

The benchmarks are run by hand (`tools/bench.py`), not by the suite, so a renamed or moved
library name they use would otherwise surface only when someone measures. Importing each one
is cheap and catches that in CI. In a child process: a benchmark may declare briefcase types or
CENTRAL indexes, which would register in this process and be seen by other tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
MODULES = sorted(p.stem for p in (TOOLS / "benchmarks").glob("*.py") if p.stem != "__init__")

CHECK = """
import importlib, sys
missing = [name for name in sys.argv[1:] if not callable(getattr(importlib.import_module("benchmarks." + name), "run", None))]
if missing:
    sys.exit("no run() in: " + ", ".join(missing))
"""


def test_every_benchmark_module_imports_and_has_a_run() -> None:
    assert len(MODULES) >= 10, MODULES
    done = subprocess.run([sys.executable, "-c", CHECK, *MODULES], cwd=TOOLS, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_session_profilers_steps_run_on_sqlite() -> None:
    """``profile_session.py --steps`` reaches into the Store's kept routings and the engine's
    prelude key, which no import catches renamed. A short run: every step prints, and the call
    counts (deterministic) climb from the plain read to the routed one, as each step adds work."""
    done = subprocess.run([sys.executable, str(TOOLS / "profile_session.py"), "--backend", "sqlite", "--steps",
                           "--n", "30", "--cpu-rounds", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("  ") and " calls " in line]
    assert len(steps) == 6, done.stdout
    assert "the baseline" in steps[0] and steps[-1].strip().endswith("judging the row)"), done.stdout
    calls = [int(line.split(" calls ")[0].split()[-1]) for line in steps]
    assert calls[0] < calls[-1] and calls[3] > calls[2], calls  # confinement and the routing each add calls
