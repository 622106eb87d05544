"""What ``import mdb`` costs and gives: no optional plug-in loaded (MongoDB is one, docs/mongodb.md)."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"import sys; {code}; print(*sorted(sys.modules), sep=chr(10))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def test_import_mdb_loads_no_mongodb_module() -> None:
    assert [m for m in _modules_after("import mdb") if "mongo" in m] == []
