"""Where a routed session's client time goes: ``python tools/profile_session.py [--backend pg|sqlite] [--write] [--async] [--miss] [--steps] [--top N]``.

Counts Python function calls per read (cProfile, deterministic: steady on a busy machine where
wall time is not) and client CPU per read (``time.process_time``, this process only) for a
routed briefcase point read and for a plain ``Session`` on the same engine (on PostgreSQL also
the server's CPU per read, from /proc: what the ownership check costs the server), then prints the
functions of the routed read with the most own time. The reads cycle over 100 briefcases, so
each finds the routing its briefcase's last session kept (``Store.session_routes``);
``--miss`` turns that cache off, the cost of a session whose briefcase has none kept. Evidence for docs/briefcases.md ("What a
session costs") and its history in docs/dev/measured-sessions.md ("Where
the time goes").

``--steps`` times the way from the plain read to the routed one a step at a time, each step
the one before plus one thing the routed session does (:func:`_steps`), in alternating rounds,
and prints what each step adds: a timing, not a call count. mdb's added instructions run slower
than SQLAlchemy's own (a call count and an instruction count both understate the time:
docs/dev/measured-sessions.md, "Sixth pass"), so the steps are where a cut must be aimed.
"""

from __future__ import annotations

import argparse
import os
import asyncio
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sqlalchemy import create_engine, select  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from benchmarks import BenchContext  # noqa: E402
from benchmarks.briefcase import NOW, _store  # noqa: E402
from mdb.demo.models import User, UserBriefcase  # noqa: E402
from mdb.gdid import GDID  # noqa: E402


def _calls(fn: Callable[[], object], n: int) -> tuple[float, cProfile.Profile]:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        fn()
    profile.disable()
    stats = pstats.Stats(profile)
    return stats.total_calls / n, profile  # type: ignore[attr-defined]


def _extra_calls(routed: cProfile.Profile, plain: cProfile.Profile, n: int) -> list[tuple[str, float]]:
    """(function, calls per read in ``routed`` minus in ``plain``), largest difference first."""
    def counts(profile: cProfile.Profile) -> dict[str, int]:
        return {f"{Path(f).name}:{line}({name})": row[1] for (f, line, name), row in pstats.Stats(profile).stats.items()}  # type: ignore[attr-defined]

    a, b = counts(routed), counts(plain)
    diff = [(k, (a.get(k, 0) - b.get(k, 0)) / n) for k in a.keys() | b.keys()]
    return sorted((d for d in diff if d[1]), key=lambda d: -abs(d[1]))


def _server_cpu(data_dir: Path | None) -> float:
    """CPU seconds used so far by the backends of the PostgreSQL server in ``data_dir`` (every child of
    its postmaster: the sessions' backends and its few background processes), from /proc; 0 without one."""
    if data_dir is None:
        return 0.0
    postmaster = (data_dir / "postmaster.pid").read_text().split()[0]
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process that ended while the folder was read
        if fields[1] == postmaster:  # ppid; then utime and stime are fields 14 and 15 of the whole line
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu(routed: Callable[[], object], plain: Callable[[], object], n: int, rounds: int = 7,
         server: Path | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
    """((client, server) CPU seconds per call of ``routed``), the same of ``plain``: alternating rounds,
    the least of each (a busy machine only ever adds to a round's CPU: contention, cache misses).
    Server CPU is counted in clock ticks (10 ms), so a round should take a second of it or more."""
    a: list[tuple[float, float]] = []
    b: list[tuple[float, float]] = []
    for _ in range(rounds):
        for fn, out in ((routed, a), (plain, b)):
            start, server_start = time.process_time(), _server_cpu(server)
            for _ in range(n):
                fn()
            out.append(((time.process_time() - start) / n, (_server_cpu(server) - server_start) / n))
    return (min(x[0] for x in a), min(x[1] for x in a)), (min(x[0] for x in b), min(x[1] for x in b))


def _steps(store: Any, gdid: Callable[[], GDID], readonly: bool, baseline: Callable[[], object],
           routed: Callable[[], object]) -> list[tuple[str, Callable[[], object]]]:
    """The ladder from a plain read to the routed one; each step adds one thing the routed session does.

    ``baseline`` and ``routed`` are the first and last steps (the reads the rest of this tool
    compares). The steps between reuse what the Store keeps for each briefcase
    (``Store.session_routes``: the confinement context and the rendered ownership check), so a
    step pays only for running it.
    """
    from mdb.engines import PRELUDE
    from mdb.session import BriefcaseSession

    engine = store.engine("u1", readonly)

    def kept(g: GDID) -> Any:
        route = store.session_routes.get((UserBriefcase, g, readonly, False), store.router, store.routes.get("user", g))
        if route is None:
            raise RuntimeError(f"no routing kept for {g}: run routed sessions of every briefcase twice first")
        return route

    def mdb_engine() -> object:
        g = gdid()
        with Session(engine) as session:
            return session.scalars(select(User).where(User.user_id == g)).one()

    def by_hand(confine: bool, check: bool) -> Callable[[], object]:
        def read() -> object:
            g = gdid()
            route = kept(g)
            conn = engine.connect()
            if check:
                conn.info[PRELUDE] = route.check
            conn.begin()
            session = BriefcaseSession(bind=conn, briefcase=route.context if confine else None,
                                       join_transaction_mode="rollback_only", expire_on_commit=False)
            row = session.scalars(select(User).where(User.user_id == g)).one()
            conn.commit()
            session.close()
            conn.close()
            return row
        return read

    return [
        ("plain Session on a plain engine (the baseline)", baseline),
        ("plain Session on mdb's engine (its BEGIN, COMMIT, pool)", mdb_engine),
        ("+ a Session on a Connection begun by hand (the Store's shape)", by_hand(False, False)),
        ("+ confinement (the briefcase's criteria on the statement)", by_hand(True, False)),
        ("+ the ownership check with BEGIN", by_hand(True, True)),
        ("store.briefcase (+ routing, request checks, telemetry, flush, judging the row)", routed),
    ]


def _time_steps(steps: list[tuple[str, Callable[[], object]]], n: int, rounds: int, clock: Callable[[], float]) -> list[float]:
    """Median seconds per call of each step, in rounds that alternate the steps' order."""
    times: list[list[float]] = [[] for _ in steps]
    order = list(range(len(steps)))
    for r in range(rounds):
        for i in (order if r % 2 == 0 else order[::-1]):
            fn = steps[i][1]
            start = clock()
            for _ in range(n):
                fn()
            times[i].append((clock() - start) / n)
    return [statistics.median(t) for t in times]


def _async_pair(store: Any, gdid: Callable[[], GDID], readonly: bool) -> tuple[Callable[[], object], Callable[[], object], Callable[[], None] | None]:
    """A routed and a plain async read, each a sync call that runs one read on one kept event loop, and a closer."""
    from sqlalchemy.ext.asyncio import AsyncSession

    from mdb.aio import AsyncStore

    loop = asyncio.new_event_loop()
    aio = AsyncStore(store)
    loop.run_until_complete(aio.router())
    engine = aio.engines.engine("u1", readonly=readonly)

    async def routed() -> object:
        g = gdid()
        async with aio.briefcase(UserBriefcase, g, readonly=readonly) as session:
            return (await session.scalars(select(User).where(User.user_id == g))).one()

    async def plain() -> object:
        g = gdid()
        async with AsyncSession(engine) as session, session.begin():
            return (await session.scalars(select(User).where(User.user_id == g))).one()

    def close() -> None:
        loop.run_until_complete(aio.close())
        loop.close()

    return (lambda: loop.run_until_complete(routed())), (lambda: loop.run_until_complete(plain())), close


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("pg", "sqlite"), default="pg")
    parser.add_argument("--write", action="store_true", help="a write session instead of a readonly one")
    parser.add_argument("--async", dest="aio", action="store_true", help="AsyncStore vs a plain AsyncSession (PostgreSQL)")
    parser.add_argument("--miss", action="store_true", help="keep no session routing between sessions (placement_cache_size=0)")
    parser.add_argument("--steps", action="store_true",
                        help="time the way from a plain read to the routed one a step at a time (sync sessions)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--cpu-rounds", type=int, default=7, help="alternating rounds timing client CPU (0: count calls only)")
    args = parser.parse_args()
    from sqlalchemy import insert

    with tempfile.TemporaryDirectory(prefix="mdb-prof-") as tmp:
        ctx = BenchContext(tmpdir=Path(tmp))
        try:
            data_dir = None
            if args.backend == "pg":
                central, shard = ctx.pg_urls(2)
                data_dir = ctx.pg_data_dirs()[1]  # the shard's server (the central one serves no session)
            else:
                central, shard = f"sqlite:///{tmp}/c.db", f"sqlite:///{tmp}/u1.db"
            store = _store(Path(tmp) / "s", central, shard)
            if args.miss:
                store.session_routes.capacity = 0  # what Store(placement_cache_size=0) makes
            ids = [GDID(0, 0, i) for i in range(1, 101)]
            with store.transaction("u1") as conn:
                conn.execute(insert(User), [{"user_id": g, "email": f"{g}@x", "name": "u", "created_at": NOW} for g in ids])
            plain = create_engine(shard)
            readonly = not args.write
            state = {"i": 0}

            def gdid() -> GDID:
                state["i"] += 1
                return ids[state["i"] % len(ids)]

            def routed() -> object:
                g = gdid()
                with store.briefcase(UserBriefcase, g, readonly=readonly) as session:
                    return session.scalars(select(User).where(User.user_id == g)).one()

            def direct() -> object:
                g = gdid()
                with Session(plain) as session:
                    return session.scalars(select(User).where(User.user_id == g)).one()

            if args.steps:
                for _ in range(2):  # every briefcase's routing kept (the second session of each keeps it)
                    for _ in ids:
                        routed()
                steps = _steps(store, gdid, readonly, direct, routed)
                for _, fn in steps:
                    for _ in range(300):
                        fn()
                calls = [_calls(fn, args.n)[0] for _, fn in steps]
                # SQLite runs in this thread: its CPU is the cost, steadier than wall time. PostgreSQL: wall.
                clock = time.thread_time if args.backend == "sqlite" else time.perf_counter
                rounds = max(args.cpu_rounds, 3) * 3
                per_round = min(500, args.n)
                medians = _time_steps(steps, per_round, rounds, clock)
                what = "this thread's CPU" if args.backend == "sqlite" else "wall time"
                print(f"{args.backend} {'write' if args.write else 'readonly'}: the steps from a plain read to a routed one "
                      f"({what}, median of {rounds} alternating rounds of {per_round} reads; calls per read counted)")
                for (label, _), seconds, count, before in zip(steps, medians, calls, [None, *medians[:-1]], strict=True):
                    step = "" if before is None else f"{(seconds - before) * 1e6:+6.1f} us"
                    print(f"  {seconds * 1e6:7.1f} us {step:>10} {seconds / medians[0]:6.3f}x {count:5.0f} calls  {label}")
                store.close()
                plain.dispose()
                return 0
            subject, baseline, close = _async_pair(store, gdid, readonly) if args.aio else (routed, direct, None)
            for fn in (subject, baseline):
                for _ in range(300):
                    fn()
            routed_calls, profile = _calls(subject, args.n)
            direct_calls, direct_profile = _calls(baseline, args.n)
            (routed_cpu, routed_server), (direct_cpu, direct_server) = (
                _cpu(subject, baseline, args.n, args.cpu_rounds, data_dir) if args.cpu_rounds else ((0.0, 0.0), (1.0, 0.0)))
            kind = ("async " if args.aio else "") + ("write" if args.write else "readonly") + (", nothing kept" if args.miss else "")
            cpu = (f"; client CPU per read routed {routed_cpu * 1e6:.0f} us vs plain {direct_cpu * 1e6:.0f} us "
                   f"(ratio {routed_cpu / direct_cpu:.2f})") if args.cpu_rounds else ""  # --cpu-rounds 0: not measured
            if args.cpu_rounds and data_dir is not None:
                both, plain_both = routed_cpu + routed_server, direct_cpu + direct_server
                cpu += (f"; server CPU per read routed {routed_server * 1e6:.0f} us vs plain {direct_server * 1e6:.0f} us; "
                        f"client + server {both * 1e6:.0f} us vs {plain_both * 1e6:.0f} us (ratio {both / plain_both:.2f})")
            print(f"{args.backend} {kind}: python calls per read routed {routed_calls:.0f} vs plain {direct_calls:.0f}{cpu}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
            extra = _extra_calls(profile, direct_profile, args.n)
            print("calls per read, routed minus plain, by function:")
            for (where, count) in extra[: args.top]:
                print(f"  {count:+6.1f}  {where}")
            by_file: dict[str, float] = {}
            for where, count in extra:
                name = where.split(":", 1)[0]
                by_file[name] = by_file.get(name, 0.0) + count
            print("the same by file (~: built-in functions):")
            for name, count in sorted(by_file.items(), key=lambda item: -abs(item[1])):
                if count:
                    print(f"  {count:+6.1f}  {name}")
            if close is not None:
                close()
            store.close()
            plain.dispose()
        finally:
            ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
