"""Instructions per routed read against a plain one: ``python tools/count_instructions.py [--backend pg|sqlite] [--write] [--reads N]``.

On a shared machine a 3% change of a session's price drowns in the spread of its timings (the
2-core machine's plain read moves by 2x from one run to the next), while the number of machine
instructions this process executes per read does not move at all. So each variant (a routed
briefcase point read; a plain ``Session`` on a plain engine, the baseline of ``bench.py
briefcase``) runs in a child process under valgrind's cachegrind, twice: with a few reads and
with ``--reads`` more; the difference, divided by ``--reads``, is the instructions per read
without the start-up. Both variants run in this one invocation, so the ratio is same-run.

What it counts: this process only (a PostgreSQL server is a process of its own, not counted:
its work is in ``tools/profile_session.py``'s server CPU). What it does not show: time lost to
cache misses and waits, so a ratio here is a floor of the wall-time ratio, not a forecast of
it. Its use: telling whether a change to the session path made it cheaper, where timings cannot
(docs/dev/measured-sessions.md). Needs ``valgrind`` on PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WARM_READS = 300
"""Reads every child does first (statement caches, pool, kept routes warm) in both of its runs."""
SHORT_READS = 100
"""The reads of a variant's short run; its long run does ``SHORT_READS + --reads``."""
_IREFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def _child(variant: str, backend: str, write: bool, reads: int) -> None:
    """Run ``WARM_READS + reads`` reads of ``variant`` (``routed`` or ``plain``): what valgrind counts."""
    from sqlalchemy import create_engine, insert, select
    from sqlalchemy.orm import Session

    from benchmarks import BenchContext
    from benchmarks.briefcase import NOW, _store
    from mdb.demo.models import User, UserBriefcase
    from mdb.gdid import GDID

    with tempfile.TemporaryDirectory(prefix="mdb-instr-") as tmp:
        ctx = BenchContext(tmpdir=Path(tmp))
        try:
            if backend == "pg":
                central, shard = ctx.pg_urls(2)
            else:
                central, shard = f"sqlite:///{tmp}/c.db", f"sqlite:///{tmp}/u1.db"
            store = _store(Path(tmp) / "s", central, shard)
            ids = [GDID(0, 0, i) for i in range(1, 101)]
            with store.transaction("u1") as conn:
                conn.execute(insert(User), [{"user_id": g, "email": f"{g}@x", "name": "u", "created_at": NOW} for g in ids])
            plain = create_engine(shard)

            def routed(g: GDID) -> object:
                with store.briefcase(UserBriefcase, g, readonly=not write) as session:
                    return session.scalars(select(User).where(User.user_id == g)).one()

            def direct(g: GDID) -> object:
                with Session(plain) as session:
                    return session.scalars(select(User).where(User.user_id == g)).one()

            read = routed if variant == "routed" else direct
            for i in range(WARM_READS + reads):
                read(ids[i % len(ids)])
            plain.dispose()
            store.close()
        finally:
            ctx.close()


def _instructions(variant: str, backend: str, write: bool, reads: int) -> int:
    """Instructions the child executes for ``reads`` reads after its warm-up (and its start-up)."""
    command = [
        "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, __file__, "--child", variant, "--backend", backend, "--reads", str(reads),
        *(["--write"] if write else []),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = _IREFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"count_instructions: the {variant} child failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("pg", "sqlite"), default="sqlite")
    parser.add_argument("--write", action="store_true", help="a write session instead of a readonly one")
    parser.add_argument("--reads", type=int, default=500, help="reads counted per variant (the long run's extra reads)")
    parser.add_argument("--child", choices=("routed", "plain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.backend, args.write, args.reads)
        return 0
    if shutil.which("valgrind") is None:
        print("count_instructions: valgrind is not on PATH (apt-get install valgrind)", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONHASHSEED", "0")  # the same dict layouts in every child
    per_read = {}
    for variant in ("plain", "routed"):
        short = _instructions(variant, args.backend, args.write, SHORT_READS)
        long = _instructions(variant, args.backend, args.write, SHORT_READS + args.reads)
        per_read[variant] = (long - short) / args.reads
    kind = "write" if args.write else "readonly"
    ratio = per_read["routed"] / per_read["plain"]
    print(f"{args.backend} {kind}: instructions per read routed {per_read['routed']:,.0f} vs plain Session "
          f"{per_read['plain']:,.0f} (ratio {ratio:.3f}; {args.reads} reads each, this process only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
