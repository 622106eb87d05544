"""``mdb move``, ``mdb reshard``, ``mdb moves status|resume`` and ``mdb where``.

Every command opens the map, imports the map's ``models:`` so the area's briefcase types are
known, and talks to the live system; errors mdb raises on purpose end as one ``error:`` line.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from mdb.cli.metrics import MetricsPortOpt, serve_metrics
from mdb.cli.app import EXIT_INTERRUPTED, EXIT_NOT_FOUND, EXIT_UNAVAILABLE, app, console, emit_json, fail, open_store, warn
from sqlalchemy.exc import SQLAlchemyError

from mdb.errors import MdbError
from mdb.cli.options import MapArg
from mdb.gdid import GDID
from mdb.moves.plan import PlannedMove
from mdb.moves.freeze import DEFAULT_FREEZE_LOCK_WAIT
from mdb.moves.move import DEFAULT_MAX_PAUSE, move_briefcase
from mdb.moves.reshard import DEFAULT_BATCH_PAUSE, ReshardCounts
from mdb.moves.resume import FAILED, HELD, resume_all
from mdb.moves.jobs import DEFAULT_PER_SERVER, WorkerRow, workers as job_workers
from mdb.moves.journal import Journal
from mdb.moves.lease import me
from mdb.fleet.where import where
from mdb.moves.status import MoveStatus, RateEta, RateWindow, move_status
from mdb.moves.throttle import DEFAULT_REPLICA_TIMEOUT, RATE_SYNTAX, ThrottleSettings
from mdb.store import Store

__all__ = ["moves_app"]

moves_app = typer.Typer(help="Status and crash recovery of briefcase moves and reshards.", no_args_is_help=True)
app.add_typer(moves_app, name="moves")

BIG_MOVE_ROWS = 10_000


def _gdid(text: str) -> GDID:
    return GDID.parse(text)


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@app.command("move")
def move_cmd(
    map_path: MapArg,
    area: Annotated[str, typer.Argument(help="area of the briefcase")],
    gdid: Annotated[str, typer.Argument(help="briefcase GDID (text or hex)")],
    to: Annotated[str, typer.Option("--to", metavar="SERVER", help="server to move the briefcase to")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would move; change nothing.")] = False,
    max_pause: Annotated[float, typer.Option("--max-pause", metavar="SECONDS", help="Abort a cutover that would block the briefcase's writes longer (PostgreSQL cancels it at the bound).", min=0.0)] = DEFAULT_MAX_PAUSE,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Move one briefcase (every table, or collection, of every briefcase type of AREA) to SERVER, online."""
    gid = _gdid(gdid)
    with open_store(map_path, tool=True) as store:
        progress: Progress | None = None
        task: Any = None

        def on_sizes(sizes: dict[str, tuple[int, int]]) -> None:
            """A bar for a big move, sized by the move's own count (taken after its schema check)."""
            nonlocal progress, task
            total = sum(r for r, _ in sizes.values())
            if dry_run or as_json or total < BIG_MOVE_ROWS:
                return
            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), console=console)
            task = progress.add_task(f"moving {area}/{gid} rows", total=total)
            progress.start()

        def on_table(name: str, rows: int) -> None:
            if progress is not None:
                progress.update(task, advance=rows, description=f"copied {name}")

        try:
            # A MoveAbortedError (verification, --max-pause) is retryable: main() ends it with
            # exit 4, "aborted safely, retry later" (docs/cli.md), not 2, the code for bad input.
            result = move_briefcase(store, area, gid, to, dry_run=dry_run, max_pause=max_pause, on_table=on_table, on_sizes=on_sizes)
        except KeyboardInterrupt:
            if progress is not None:
                progress.stop()
                progress = None
            _say_what_a_move_left(store, area, gid, map_path)
            raise
        finally:
            if progress is not None:
                progress.stop()
    if as_json:
        emit_json(result.to_json())
        return
    if result.status == "already-there":
        console.print(f"{area}/{gid} already lives on {result.target}; nothing to do", markup=False)
        return
    table = Table(title=f"{'would move' if dry_run else 'moved'} {area}/{gid}: {result.source} -> {result.target}")
    table.add_column("table")
    table.add_column("rows", justify="right")
    table.add_column("bytes", justify="right")
    for name, (rows, nbytes) in result.tables.items():
        table.add_row(escape(name), str(rows), _size(nbytes))
    table.add_row("total", str(result.rows), _size(result.bytes))
    console.print(table)
    if result.status == "done":
        console.print(f"done: move {result.move_id}, write pause {result.pause_seconds * 1000:.0f} ms", markup=False)


@app.command("where")
def where_cmd(
    map_path: MapArg,
    area: Annotated[str, typer.Argument(help="area of the briefcase")],
    gdid: Annotated[str, typer.Argument(help="briefcase GDID")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Ask the live system where a briefcase is and whether a move of it is in flight."""
    with open_store(map_path, tool=True) as store:
        found = where(store, area, _gdid(gdid))
    if as_json:
        emit_json(found.to_json())
        if not found.holders:
            raise typer.Exit(_absent(found.unreachable))
        return
    console.print(f"{area}/{found.gdid}: routed to {found.routed_to} (default {found.default_server}, relocation: {found.relocation or '-'})", markup=False)
    for server, rows in found.holders.items():
        console.print(f"  {server}: holds {rows} row(s)", markup=False)
    if not found.holders:
        unasked = f" (not asked: {', '.join(found.unreachable)} unreachable)" if found.unreachable else ""
        console.print(f"  no server holds any row of this briefcase{unasked}", markup=False)
    for server, state in found.states.items():
        console.print(f"  {server}: state {state['state']} peer {state['peer']} move {state['move_id']}", markup=False)
    for server, problem in found.unreachable.items():
        console.print(f"  {server}: unreachable: {problem}", markup=False)
    for move in found.moves_in_flight:
        console.print(f"  move in flight: {move['move_id']} {move['source']} -> {move['target']} at step {move['step']}, {move['driver']}", markup=False)
    if not found.moves_in_flight:
        console.print("  no move in flight", markup=False)
    if not found.consistent:  # a move in flight is resume's to settle; a copy no move made is fsck's
        fix = "mdb moves resume MAP" if found.moves_in_flight else f"mdb fsck MAP {area}"
        console.print(f"  WARNING: the holders disagree with routing; run `{fix}`", markup=False)
    if not found.holders:
        raise typer.Exit(_absent(found.unreachable))


def _absent(unreachable: dict[str, str]) -> int:
    """Exit code of a briefcase no server was seen holding (docs/cli.md): "not found" only when
    every server answered; with one unreachable the answer is unknown, so "unavailable"."""
    return EXIT_UNAVAILABLE if unreachable else EXIT_NOT_FOUND  # like `central lookup` of an absent key


def _ago(when: datetime | None) -> str:
    if when is None:
        return "-"
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return f"{(datetime.now(timezone.utc) - when).total_seconds():.0f}s ago"


@moves_app.command("status")
def status_cmd(
    map_path: MapArg,
    limit: Annotated[int, typer.Option("--limit", min=0, help="How many recently finished moves and reshards to show.")] = 10,
    watch: Annotated[float | None, typer.Option("--watch", metavar="SECONDS", min=0.5, help="Show it again every SECONDS until Ctrl-C.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """In-flight moves and reshards: phase, process (running or interrupted), briefcases and rows done, rate, ETA."""
    if watch is not None and as_json:
        fail("--watch and --json do not go together (run --json repeatedly instead)")
    with open_store(map_path, tool=True) as store:
        try:
            while True:
                running, finished = move_status(store, recent=limit)
                busy = job_workers(Journal(store))
                if as_json:
                    emit_json({"in_flight": [s.to_json() for s in running], "recent": [s.to_json() for s in finished],
                               "workers": [w.to_json() for w in busy]})
                    return
                if watch is not None:
                    console.clear()
                _print_status(running, finished)
                _print_workers(busy)
                if watch is None:
                    return
                time.sleep(watch)
        except KeyboardInterrupt:  # how a --watch ends: 130 like every Ctrl-C (docs/cli.md), without an error line
            if watch is None:
                raise
            raise typer.Exit(EXIT_INTERRUPTED) from None


def _print_workers(busy: list[WorkerRow]) -> None:
    """The work items of jobs in flight and who drives each (``mdb worker`` processes, the job's own command)."""
    if not busy:
        return
    table = Table(title="workers")
    for column in ("worker", "host", "last beat", "job", "item", "from -> to", "briefcases"):
        table.add_column(column)
    for w in busy:
        h = w.holder
        who = "-" if h is None else f"pid {h.pid}" + ("" if h.alive else " (gone)")
        table.add_row(escape(who), escape("-" if h is None else h.host), "-" if h is None else f"{h.beat_age:.0f}s ago",
                      escape(w.job_id), escape(w.item_id), escape(f"{w.source} -> {w.target}"), str(w.briefcases))
    console.print(table)


def _per_second(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.1f}" if rate < 10 else f"{rate:.0f}"


def format_eta(seconds: float | None) -> str:
    """An ETA as status and the bars show it: 45s, 12m05s, 3h20m; "-" when unknown."""
    if seconds is None:
        return "-"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _print_status(running: list[MoveStatus], finished: list[MoveStatus]) -> None:
    for title, items in (("in flight", running), ("recently finished", finished)):
        table = Table(title=title)
        for column in ("id", "kind", "briefcase / partition", "from -> to", "phase", "briefcases", "rows", "briefcases/s", "rows/s", "ETA", "last change"):
            table.add_column(column)
        for s in items:
            e = s.entry
            batch = len(e.briefcases)
            if e.gdid is None and "partition_start" not in e.params:  # a rebalance's or drain's job: its planned moves
                subject = f"{e.area}: {len(e.params.get('moves', []))} planned moves"
            elif e.gdid is None:
                subject = f"{e.area} partition {e.params.get('partition_start')}"
            else:  # a batch names its briefcases in params: how many, from the first
                subject = f"{e.area}/{e.gdid}" if batch <= 1 else f"{e.area}: {batch} briefcases from {min(e.briefcases)}"
            route = f"{e.source} -> {e.target}" if e.gdid is not None else (
                f"{','.join(e.params.get('old_shards', []))} -> {','.join(e.params.get('new_shards', []))}" if "old_shards" in e.params
                else ",".join(e.params.get("servers", [])))
            rows = f"{e.rows_done}/{e.rows_total}" if e.rows_total else str(e.rows_done)  # a batch plans no row total
            table.add_row(
                escape(e.move_id), e.kind, escape(subject), escape(route), escape(e.step),
                f"{e.briefcases_done}/{e.briefcases_total}", rows,
                _per_second(s.rate_briefcases), _per_second(s.rate_rows), format_eta(s.eta_seconds), _ago(e.updated_at),
            )
        console.print(table)
        for s in items:
            if s.driver is not None:
                console.print(f"  {s.entry.move_id}: {s.driver}", markup=False)
            if s.rate_window is not None and s.entry.status == "running":
                console.print(f"  {s.entry.move_id}: rate over the last {s.rate_window:.0f} s", markup=False)
            if s.entry.tables and s.entry.status == "running":
                per = ", ".join(f"{name} {done}/{planned}" for name, (planned, done) in s.entry.tables.items())
                console.print(f"  {s.entry.move_id} rows per table: {per}", markup=False)
            if s.entry.detail and s.entry.status != "done":
                console.print(f"  {s.entry.move_id}: {s.entry.detail}", markup=False)


@moves_app.command("resume")
def resume_cmd(
    map_path: MapArg,
    retry: Annotated[bool, typer.Option("--retry", help="After rolling an interrupted single move back, try it again.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Finish (commit point passed) or roll back (it did not) every interrupted move; continue reshards."""
    with serve_metrics(metrics_port), open_store(map_path, tool=True) as store:
        outcomes = resume_all(store, retry=retry)
    if as_json:
        emit_json([o.to_json() for o in outcomes])
    else:
        if not outcomes:
            console.print("nothing to resume", markup=False)
        for o in outcomes:
            console.print(f"{o.move_id} ({o.kind}): {o.action}: {o.detail}", markup=False)
    if outcomes and all(o.action == HELD for o in outcomes):
        raise typer.Exit(2)  # refused: every unfinished entry is driven by another live process
    if any(o.action in (FAILED, HELD) for o in outcomes):
        raise typer.Exit(1)  # like `schema apply`: the rest was done, the run is incomplete


@moves_app.command("cancel")
def cancel_cmd(
    map_path: MapArg,
    move_id: Annotated[str, typer.Argument(metavar="ID", help="id of a move or reshard (see `mdb moves status`)")],
    move_back: Annotated[bool, typer.Option("--move-back/--leave", help="Move the briefcases it already moved back to their old server, or leave them where they are (as relocations).")] = True,
    wait: Annotated[float, typer.Option("--wait", metavar="SECONDS", min=0.0, help="How long a running driver is given to stop.")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Cancel a move or a reshard before it applies its new map; the old map stays in force."""
    from mdb.moves.cancel import cancel

    with open_store(map_path, tool=True) as store:
        try:
            outcome = cancel(store, move_id, move_back=move_back, wait=wait)
        except KeyboardInterrupt:
            _say_what_a_cancel_left(store, move_id, map_path)
            raise
    if as_json:
        emit_json(outcome.to_json())
        return
    console.print(f"{outcome.move_id} ({outcome.kind}): {outcome.detail}", markup=False)


@app.command("reshard")
def reshard_cmd(
    map_path: MapArg,
    area: Annotated[str, typer.Argument(help="area to re-shard")],
    partition: Annotated[str, typer.Option("--partition", metavar="START", help="absolute start GDID of the partition")],
    shards: Annotated[str, typer.Option("--shards", metavar="A,B,C", help="the partition's new shard list")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")] = False,
    parallel: Annotated[int, typer.Option("--parallel", min=0, max=64, help="Batches this process moves at once (one's copy overlaps another's cutover, docs/moves.md); 0: only drive the job's phases, `mdb worker`s move.")] = 1,
    max_pause: Annotated[float, typer.Option("--max-pause", metavar="SECONDS", help="Per briefcase: abort a cutover that would block its writes longer.", min=0.0)] = DEFAULT_MAX_PAUSE,
    batch_pause: Annotated[float, typer.Option("--batch-pause", metavar="SECONDS", min=0.0,
                                               help="Write pause a batch of briefcases aims at (batches grow or shrink to keep it); 0: one briefcase at a time.")] = DEFAULT_BATCH_PAUSE,
    rate: Annotated[str | None, typer.Option("--rate", metavar="RATE", help=f"At most this fast: {RATE_SYNTAX}.")] = None,
    max_lag: Annotated[str | None, typer.Option("--max-lag", metavar="SECONDS", help="Pause while a replica (in the map) of a server the reshard writes lags more, e.g. 5 or 500ms.")] = None,
    replica_timeout: Annotated[float, typer.Option("--replica-timeout", metavar="SECONDS", help="With --max-lag: how long an unreachable replica is waited for before the reshard stops (resumable).")] = DEFAULT_REPLICA_TIMEOUT,
    freeze_wait: Annotated[float, typer.Option("--freeze-wait", metavar="SECONDS", min=0.001, help="How long the freeze waits for the partition's open write sessions; past it the reshard stops unfrozen (exit 4) naming them.")] = DEFAULT_FREEZE_LOCK_WAIT,
    workers: Annotated[int, typer.Option("--workers", min=0, max=64, help="Also start N `mdb worker` processes here for this reshard (stopped when it ends); workers on other hosts join by running `mdb worker MAP`.")] = 0,
    per_server: Annotated[int, typer.Option("--per-server", min=1, max=64, help="Work items in flight at once on one server, over every worker of every host.")] = DEFAULT_PER_SERVER,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Move every briefcase of a partition whose shard changes under SHARDS, then write the new map.

    The reshard is a job in CENTRAL: this command enqueues it and works on it (``--parallel``
    threads); any ``mdb worker MAP`` works on it too, and takes it over if this process dies.
    """
    from mdb.moves.reshard import parallel_for, reshard

    new_shards = [s.strip() for s in shards.split(",") if s.strip()]
    if not new_shards:
        fail("--shards needs at least one server name")
    try:
        settings = ThrottleSettings.parse(rate, max_lag, replica_timeout)
    except MdbError as exc:
        fail(str(exc))
    with serve_metrics(metrics_port), open_store(map_path, tool=True) as store:
        parallel, sqlite = parallel_for(store, area, _gdid(partition), new_shards, parallel)
        if sqlite:
            warn(f"--parallel runs as 1: SQLite lets one writer at a time into a file ({', '.join(sqlite)} are SQLite)")
            if workers:
                fail(f"--workers: SQLite lets one writer at a time into a file ({', '.join(sqlite)} are SQLite); run without it")
        if (workers or parallel == 0) and not dry_run and store.engines.sql_dialect(Journal(store).server).one_writer_per_file:
            fail("--workers and --parallel 0 need a PostgreSQL CENTRAL (a SQLite CENTRAL runs one worker: this command's own)")
        try:
            with _local_workers(map_path, 0 if dry_run else workers):
                if dry_run or as_json:
                    outcome = reshard(store, area, _gdid(partition), new_shards, dry_run=dry_run, parallel=parallel, max_pause=max_pause,
                                      map_path=map_path, batch_pause=batch_pause, throttle=settings, freeze_wait=freeze_wait,
                                      per_server=per_server)
                else:
                    if settings.limited:
                        console.print(f"throttle: {settings.describe()}", markup=False)
                    with _RichReshardProgress() as progress:
                        outcome = reshard(store, area, _gdid(partition), new_shards, parallel=parallel, max_pause=max_pause,
                                          map_path=map_path, progress=progress, batch_pause=batch_pause, throttle=settings,
                                          freeze_wait=freeze_wait, per_server=per_server)
        except KeyboardInterrupt:
            _say_how_to_resume(store, area, map_path)
            raise
    plan = outcome.plan
    if as_json:
        emit_json(outcome.to_json())
        return
    planned = "would move" if dry_run else "planned at the start"
    table = Table(title=f"reshard {area} partition {plan.partition_start}: {','.join(plan.old_shards)} -> {','.join(plan.new_shards)} ({planned})")
    for column in ("source", "target", "briefcases", "rows"):
        table.add_column(column, justify="right" if column in ("briefcases", "rows") else "left")
    for (src, dst), (n, rows) in sorted(plan.pairs().items()):
        table.add_row(escape(src), escape(dst), str(n), str(rows))
    console.print(table)
    if dry_run:
        console.print(f"{plan.briefcases_to_move} of {plan.briefcases_in_partition} briefcases would move; rows per table: "
                      + ", ".join(f"{k} {v}" for k, v in plan.rows_per_table().items()), markup=False)
        return
    # The table above is the plan made at the start; briefcases created meanwhile were planned
    # again and moved too, so the final figures come from the journal, like the bars and status.
    console.print(f"moved {outcome.moved} briefcases ({outcome.rows_moved} rows); "
                  f"done: reshard {outcome.reshard_id}, map version {outcome.map_version}", markup=False)
    if outcome.map_backup is not None:
        console.print(f"{map_path} was rewritten as YAML data (comments and layout are not kept); "
                      f"the previous file is at {outcome.map_backup}", markup=False, soft_wrap=True)  # a path to copy: unbroken


@contextmanager
def _local_workers(map_path: str, n: int) -> Iterator[None]:
    """``n`` ``mdb worker`` processes on this machine for the block; each is stopped (SIGTERM) and waited for after it."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "from mdb.cli import main; main()", "worker", map_path],
                                          stdout=subprocess.DEVNULL))
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(WORKER_STOP_WAIT)
            except subprocess.TimeoutExpired:
                warn(f"worker pid {proc.pid} did not stop within {WORKER_STOP_WAIT:.0f}s of SIGTERM; killed (its batch is resolved by the next worker)")
                proc.kill()
                proc.wait()


WORKER_STOP_WAIT = 120.0
"""Seconds a local worker gets to finish its batch in hand after SIGTERM."""


@app.command("worker")
def worker_cmd(map_path: MapArg) -> None:
    """Work on every job in CENTRAL (reshard, rebalance, drain, a cancel's move-back) until stopped: claim work items, drive jobs whose driver is gone.

    SIGTERM or Ctrl-C: the batch in hand stops before its next step (rolled back) and its item is given back (exit 130/143).
    Run it on as many hosts as you like; `mdb moves status` lists the workers and their items.
    """
    from mdb.moves.worker import run_worker

    with open_store(map_path, tool=True) as store:
        if store.engines.sql_dialect(Journal(store).server).one_writer_per_file:
            fail("mdb worker needs a PostgreSQL CENTRAL: a SQLite CENTRAL runs one worker, `mdb reshard` itself")
        stopping = threading.Event()
        errors: list[BaseException] = []

        def say(line: str) -> None:
            console.print(f"{datetime.now(timezone.utc):%H:%M:%S} {line}", markup=False, soft_wrap=True)

        crashed: list[BaseException] = []

        def work() -> None:
            try:
                run_worker(store, stopping, on_event=say, errors=errors)
            except BaseException as exc:  # raised again in the main thread: the worker exits with its error
                crashed.append(exc)

        thread = threading.Thread(target=work, name="mdb-worker")
        say(f"worker started: {me()}")
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.5)
        except KeyboardInterrupt:
            say("stopping: the batch in hand stops before its next step")
            stopping.set()
            thread.join()
            raise
        if crashed:
            raise crashed[0]


def _say_how_to_resume(store: Store, area: str, map_path: str) -> None:
    """After Ctrl-C, one stderr line naming the interrupted reshard and how to go on.

    A reshard refuses to start while its area has an unfinished one, so the area's unfinished
    reshard is this one; none means it was stopped before its journal row, with nothing to resume.
    """

    for entry in Journal(store).entries(unfinished=True):
        if entry.kind == "reshard" and entry.area == area:
            warn(f"reshard {entry.move_id} interrupted at step {entry.step}: run `mdb moves resume {map_path}` to finish it "
                 f"(or `mdb moves cancel {map_path} {entry.move_id}` to undo it)")
            return
    warn(f"reshard of area {area!r} interrupted before it began moving: nothing changed, nothing to resume")


def _journal_after_interrupt(store: Store, what: str) -> Any:
    """The journal, for the one line said after Ctrl-C; None (and a line saying so) when CENTRAL cannot be read now."""

    try:
        journal = Journal(store)
        journal.entries(unfinished=True, limit=1)
        return journal
    except (MdbError, SQLAlchemyError) as exc:
        warn(f"{what} interrupted; its state could not be read ({exc}): `mdb moves status` shows it, `mdb moves resume` finishes it")
        return None


def _say_what_a_move_left(store: Store, area: str, gid: GDID, map_path: str) -> None:
    """After Ctrl-C of `mdb move`: one stderr line saying what state the move was left in and what to run."""
    journal = _journal_after_interrupt(store, f"move of {area}/{gid}")
    if journal is None:
        return
    for entry in journal.entries(unfinished=True):
        if entry.kind != "reshard" and entry.area == area and entry.gdid == gid and entry.reshard_id is None:
            warn(f"move {entry.move_id} of {area}/{gid} ({entry.source} -> {entry.target}) interrupted at step {entry.step}: "
                 f"run `mdb moves resume {map_path}` to finish it (past its commit point) or roll it back (before it)")
            return
    warn(f"move of {area}/{gid} interrupted with no move of it unfinished: nothing to resume (`mdb where {map_path} {area} {gid}` says where it is)")


def _say_what_a_cancel_left(store: Store, move_id: str, map_path: str) -> None:
    """After Ctrl-C of `mdb moves cancel`: one stderr line with the entry's state and what to run."""
    journal = _journal_after_interrupt(store, f"cancel of {move_id}")
    if journal is None:
        return
    entry = journal.get(move_id)
    if entry is None:
        warn(f"cancel of {move_id} interrupted: no such move or reshard in the journal")
    elif entry.status != "running":
        warn(f"cancel of {move_id} interrupted: {move_id} is {entry.status}, nothing to resume")
    elif entry.step == "cancel":
        warn(f"cancel of {move_id} interrupted part-way (journaled): run `mdb moves cancel {map_path} {move_id}` again, "
             f"or `mdb moves resume {map_path}`, to finish undoing it")
    else:
        warn(f"cancel of {move_id} interrupted before it began: {move_id} is unchanged at step {entry.step}; run "
             f"`mdb moves cancel {map_path} {move_id}` again to cancel it, or `mdb moves resume {map_path}` to finish it")


class _RichReshardProgress:
    """Briefcases and rows bars with rate and ETA; the description shows the last change.

    The bars show the counts the reshard has just written to its journal row (never a count of
    their own), so they agree with `mdb moves status` and the final line; the rate and ETA come
    from :func:`mdb.moves.status.rate_and_eta` over the same window of those counts that the
    reshard journals, not from rich's own estimate (which averages since the bar started).
    """

    def __init__(self, window: RateWindow | None = None) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
            TextColumn("{task.fields[rate]}"), TextColumn("ETA {task.fields[eta]}"), TimeElapsedColumn(), console=console,
        )
        self._bc: Any = None
        self._rows: Any = None
        self._window = RateWindow() if window is None else window
        self._last = "briefcases"
        self.figures: RateEta | None = None
        """What the bars show now (tests compare it with `mdb moves status`)."""

    def __enter__(self) -> _RichReshardProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def phase(self, name: str) -> None:
        self._progress.console.print(f"phase: {name}", markup=False)

    def counts(self, counts: ReshardCounts, last: PlannedMove | None) -> None:
        if self._bc is None:
            self._bc = self._progress.add_task("briefcases", total=counts.briefcases_total, rate="", eta="-")
            self._rows = self._progress.add_task("rows", total=counts.rows_total, rate="", eta="-")
        self._window.add(counts.briefcases_done, counts.rows_done)
        self.figures = f = self._window.figures(counts.briefcases_done, counts.briefcases_total, counts.rows_done, counts.rows_total)
        eta = format_eta(f.eta_seconds)
        if last is not None:
            self._last = f"briefcases (last: {last.gdid} {last.source}->{last.target})"
        self._progress.update(self._bc, completed=counts.briefcases_done, total=counts.briefcases_total, description=self._last,
                              rate=f"{_per_second(f.briefcases_per_second)} briefcases/s", eta=eta)
        self._progress.update(self._rows, completed=counts.rows_done, total=counts.rows_total,
                              rate=f"{_per_second(f.rows_per_second)} rows/s", eta=eta)

    def waiting(self, reason: str, seconds: float) -> None:
        """The throttle's on_wait: why the reshard waits, until the next counts update replaces it."""
        if self._bc is not None:
            self._progress.update(self._bc, description=f"briefcases (waiting: {reason})")
