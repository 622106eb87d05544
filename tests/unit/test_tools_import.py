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
