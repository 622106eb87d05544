"""Run benchmark sections: ``python tools/bench.py [SECTION ...] [--quick] [--json]``.

Each section is ``tools/benchmarks/<name>.py`` exposing ``run(ctx) -> list[Result]``; with no
SECTION every section runs. Results are printed with their baseline (measured in the same run)
and the ratio value/baseline, and which direction is better.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pkgutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import benchmarks  # noqa: E402
from benchmarks import BenchContext, Result  # noqa: E402


def available_sections() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if not m.name.startswith("_"))


def _fmt(value: float) -> str:
    return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def render(results: list[Result], console: Console) -> None:
    table = Table(title="mdb benchmarks (ratio = value / baseline, same run)")
    for column in ("section", "benchmark", "value", "baseline", "ratio", "better", "note"):
        table.add_column(column, justify="right" if column in ("value", "ratio") else "left")
    for r in results:
        good = (r.ratio >= 1) if r.better == "higher" else (r.ratio <= 1)
        colour = "green" if good else "yellow"
        table.add_row(
            r.section, r.name, f"{_fmt(r.value)} {r.unit}", f"{r.baseline_name}: {_fmt(r.baseline_value)} {r.unit}",
            f"[{colour}]{r.ratio:.3f}[/{colour}]", f"{r.better} is better", r.note,
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    sections = available_sections()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION", help=f"sections to run (default: all of {', '.join(sections)})")
    parser.add_argument("--quick", action="store_true", help="fewer iterations: a smoke run, not a measurement")
    parser.add_argument("--n", type=int, help="size for the sections that take one (reshard_impact: briefcases, default 10000; reshard --workers: briefcases, default 10000, 1200 with --quick)")
    parser.add_argument("--procs", type=int, help="application processes for the sections that start them (reshard_impact: default 4)")
    parser.add_argument("--settled", action="store_true",
                        help="reshard_impact: only briefcases that stay, so the reshard is its freeze, final sweep and map apply alone")
    parser.add_argument("--mover-nice", type=int, default=0, metavar="N",
                        help="reshard_impact: run the mover (this process's reshard threads) at nice N, as if on a host of its own")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--async", dest="aio", action="store_true",
                        help="the asyncio variant of each section that has one (briefcase -> briefcase_async)")
    parser.add_argument("--workers", metavar="N[,N...]", help="reshard: run `mdb worker` processes, e.g. 1,2,4,8 (issue 32's benchmark); 0: today's default, `mdb reshard` alone at --parallel 1")
    parser.add_argument("--shards", metavar="OLD:NEW", default="4:8", help="reshard --workers: shard counts (default 4:8)")
    parser.add_argument("--per-server", type=int, default=None, help="reshard --workers: work items in flight per server")
    args = parser.parse_args(argv)
    if args.aio:
        args.sections = [f"{s}_async" if f"{s}_async" in sections else s for s in args.sections or ["briefcase"]]
    unknown = [s for s in args.sections if s not in sections]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; available: {', '.join(sections)}")
    stream = sys.stderr if args.json else sys.stdout
    console = Console(stderr=args.json, width=None if stream.isatty() else 160)  # a log file gets the whole table
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="mdb-bench-") as tmp:
        ctx = BenchContext(tmpdir=Path(tmp), quick=args.quick, n=args.n, procs=args.procs)
        if args.workers:
            old, _, new = args.shards.partition(":")
            ctx.options = {"workers": [int(w) for w in args.workers.split(",")], "shards": (int(old), int(new)),
                           "per_server": args.per_server}
        if args.settled:
            ctx.options["settled"] = True
        if args.mover_nice:
            ctx.options["mover_nice"] = args.mover_nice
        try:
            for name in args.sections or sections:
                console.print(f"[bold]section {name}[/bold] ...")
                module = importlib.import_module(f"benchmarks.{name}")
                results.extend(module.run(ctx))
        finally:
            ctx.close()
    if args.json:
        print(json.dumps([{**dataclasses.asdict(r), "ratio": r.ratio} for r in results], indent=2))
    else:
        render(results, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
