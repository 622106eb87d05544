"""Re-sharding one partition online: every briefcase whose shard changes is moved, then the map.

Order, chosen so that no moment exists where a session is routed to a server that does not
hold the data:

1. plan and precheck everything (every target's schema, the new map through
   :func:`mdb.maps.apply.apply_map` in dry-run) before the first briefcase moves;
2. move each briefcase to its shard under the NEW list (``v mod len(new)``) with the ordinary
   move protocol: until the new map exists the target is a relocation ('resident' row +
   relocation entry), so old-map and new-map processes alike find it; the old shard keeps a
   fence that redirects anyone who still goes there. Then sweep again for briefcases created
   meanwhile, up to MAX_SWEEPS passes or until a pass finds none;
3. freeze the partition's writes on its old shards (:mod:`mdb.moves.freeze`): no briefcase of
   it can be created or written there any more, so one final sweep moves every straggler;
4. apply the new map version (``apply_map`` re-stamps every shard under a lock and records
   the map in CENTRAL; a process meeting a new stamp refreshes), write it to the map file,
   then unfreeze: writers that waited retry and are routed by the new map;
5. only now clear the partition's relocations (they point at what is now the default shard)
   and delete the 'resident' rows that default routing has made redundant. A process with the
   old map and a stale relocation cache meets a missing 'resident' row or a new stamp,
   refreshes, and gets the new map.

Every step is journaled (kind 'reshard'); :func:`continue_reshard` picks an interrupted
reshard up at its step, re-planning from the live system, so it can crash anywhere.

One driver for every server kind: what differs is behind the partition's kind, chosen by the
kind of its shards, never by a branch here: the plan's scan (:func:`mdb.moves.plan.scan_for`),
each briefcase's move (:func:`mdb.moves.move.move_briefcase` picks :class:`SingleMove`, a batch of
one, or :class:`DocumentMove`), the freeze marker, the layout stamps and the 'resident' records (the
server's backend, :mod:`mdb.backends`). A document area reshards with the same command.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol
from collections.abc import Callable, Sequence

from mdb.backends import backend_of
from mdb.cluster import Cluster
from sqlalchemy.exc import DBAPIError

from mdb.dberrors import describe, translate
from mdb.errors import (
    BatchAbortedError, BriefcaseGoneError, MdbError, MoveAbortedError, MoveLeaseHeldError, ReshardStoppedError, RoutingError,
    ServerUnavailableError,
)
from mdb.faults import fault_point, register
from mdb.gdid import GDID
from mdb.maps.apply import apply_map
from mdb.maps.history import applied_maps, newest_applied
from mdb.maps.text import new_map_text, rewrite_map_file
from mdb.moves.freeze import DEFAULT_FREEZE_LOCK_WAIT, freeze_partition, unfreeze_partition
from mdb.moves.journal import ABORTED, CANCEL_STEP, DONE, RUNNING, Journal, JournalEntry, new_move_id
from mdb.moves import jobs
from mdb.moves.fencing import unchecked
from mdb.moves.jobs import Item, ItemResult
from mdb.moves.lease import check_stop, fenced_servers, hold, refuse_if_busy
from mdb.moves.status import RateWindow
from mdb.moves.throttle import Throttle, ThrottleSettings
from mdb.moves.reshard_state import FROZEN_STEPS, PARAMS_VERSION, ReshardParams, ReshardStep
from mdb.moves.plan import PartitionScan, PlannedMove, ReshardPlan, plan_reshard, scan_for
from mdb.moves.batch import BatchMove, hold_schemas
from mdb.moves.gate import CutoverGate
from mdb.moves.collector import long_lived_frozen
from mdb.moves.move import DEFAULT_MAX_PAUSE, GONE, MoveResult, check_max_pause, move_briefcase, resolve_move
from mdb.moves.copy import AreaTable
from mdb.moves.sql_steps import area_tables
from mdb.partition_map import PartitionMap, parse_map
from mdb.relocations import set_relocations

__all__ = ["JobRun", "ReshardCounts", "ReshardOutcome", "ReshardProgress", "Workers", "continue_reshard", "move_all", "moving_back",
           "reshard", "settle_item", "work_item"]

log = logging.getLogger("mdb.moves.reshard")

FAULT_POINTS = register(
    "reshard.after_journal_start",
    "reshard.after_plan",
    "reshard.after_prechecks",
    "reshard.after_first_move",
    "reshard.between_passes",
    "reshard.after_moves",
    "reshard.after_freeze",
    "reshard.after_final_moves",
    "reshard.before_map_apply",
    "reshard.after_map_apply",
    "reshard.after_map_file",
    "reshard.after_unfreeze",
    "reshard.after_clear_relocations",
    "reshard.after_resident_cleanup",
)
"""The reshard's crash points (the freeze's own is in mdb.moves.freeze)."""
FIRST_MOVE_BACK: Final = register("cancel.after_first_move_back")[0]
"""A cancel's first briefcase moved back (registered here: the item code that moves it back passes it, in any worker)."""

MOVE_ATTEMPTS = 3
MAX_SWEEPS = 5
DEFAULT_BATCH_PAUSE = 0.025
"""The write pause a batch of briefcases aims at (seconds); 0 moves one briefcase at a time.

Set below the 50 ms p99 aim by the spread of the pauses, not at it: the same statement now and
then costs its server 1.5-2x the CPU (measured: docs/dev/measured-moves.md, "The aims"), and one such batch
in a hundred sets the p99. 0.025 against 0.03, six runs each at ``--parallel`` 4: p99 34-41
against 42-47 ms, throughput the same within the runs' spread."""
BATCH_START = 8
BATCH_LARGEST = 500
RECENT_BATCHES = 4
"""How many of the latest batches bound the next size by their pause per briefcase (:class:`BatchSizer`)."""


@dataclass
class ReshardCounts:
    """What a reshard has moved and what its latest plan still has to move.

    The one source of every count shown (the CLI's bars, ``mdb moves status``, the final line):
    each change is written to the reshard's journal row and handed to the progress display as
    the same numbers. "Done" starts from the reshard's finished moves in the journal, so a
    resumed reshard neither counts a move twice nor misses one finished by resume, and an
    aborted attempt that was retried is not a finished move. The totals are done + what the
    latest plan still has to move, so a re-plan that finds briefcases created meanwhile raises
    the total instead of pushing done past it (the bar showed 459/178).
    """

    briefcases_done: int = 0
    rows_done: int = 0
    tables_done: dict[str, int] = field(default_factory=dict)
    pending: dict[GDID, PlannedMove] = field(default_factory=dict)
    window: RateWindow = field(default_factory=RateWindow)
    """Recent (time, done) samples: the rate and ETA that the bars and `mdb moves status` show."""

    @classmethod
    def from_journal(cls, journal: Journal, reshard_id: str) -> ReshardCounts:
        counts = cls()
        for move in journal.moves_of(reshard_id):
            if move.status == DONE and not move.params.get("reverse_of"):
                counts.briefcases_done += len(move.briefcases)
                counts.rows_done += move.rows_done
                for name, (_, done) in move.tables.items():
                    counts.tables_done[name] = counts.tables_done.get(name, 0) + done
        return counts

    pending_tables: dict[str, int] = field(default_factory=dict)
    """Rows per table of the pending moves, kept as they change: the counts are written after every
    batch, and summing a plan of a million moves each time would cost more than the batch."""

    def plan(self, plan: ReshardPlan) -> None:
        self.pending = {m.gdid: m for m in plan.moves}
        self.pending_tables = {}
        for m in plan.moves:
            for name, n in m.rows.items():
                self.pending_tables[name] = self.pending_tables.get(name, 0) + n

    def moved(self, move: PlannedMove, rows: dict[str, int] | None) -> None:
        """``move`` finished, carrying ``rows`` (the verified counts, which a live writer may have changed);
        None: the application deleted the briefcase before it moved (no longer pending, not moved)."""
        planned = self.pending.pop(move.gdid, None)
        if planned is not None:
            for name, n in planned.rows.items():
                self.pending_tables[name] -= n
        if rows is None:
            return
        self.briefcases_done += 1
        self.rows_done += sum(rows.values())
        for name, n in rows.items():
            self.tables_done[name] = self.tables_done.get(name, 0) + n

    def moved_result(self, result: ItemResult) -> None:
        """A work item finished (:mod:`mdb.moves.jobs`): its briefcases are no longer pending; its rows are done."""
        for gdid in [*result.moved, *result.gone]:
            planned = self.pending.pop(gdid, None)
            if planned is not None:
                for name, n in planned.rows.items():
                    self.pending_tables[name] -= n
        self.briefcases_done += len(result.moved)
        self.rows_done += sum(result.tables.values())
        for name, n in result.tables.items():
            self.tables_done[name] = self.tables_done.get(name, 0) + n

    @property
    def briefcases_total(self) -> int:
        return self.briefcases_done + len(self.pending)

    @property
    def rows_total(self) -> int:
        return self.rows_done + sum(self.pending_tables.values())

    def tables(self) -> dict[str, list[int]]:
        """table -> [rows total, rows done], the journal's ``tables`` column."""
        out = {name: [n, n] for name, n in self.tables_done.items()}
        if self.pending:
            for name, n in self.pending_tables.items():
                out.setdefault(name, [0, 0])[0] += n
        return out

    def journal_values(self) -> dict[str, Any]:
        return {"briefcases_done": self.briefcases_done, "briefcases_total": self.briefcases_total,
                "rows_done": self.rows_done, "rows_total": self.rows_total, "tables": self.tables()}


class ReshardProgress(Protocol):
    def phase(self, name: str) -> None: ...
    def counts(self, counts: ReshardCounts, last: PlannedMove | None) -> None:
        """The counts just written to the journal (``last``: the move that changed them, if any)."""
    def waiting(self, reason: str, seconds: float) -> None:
        """The throttle holds the next cutover back for up to ``seconds`` (:mod:`mdb.moves.throttle`)."""


@dataclass
class ReshardOutcome:
    reshard_id: str | None
    plan: ReshardPlan
    """The first plan of this run (what the dry run shows)."""
    map_version: int | None
    moved: int
    """Briefcases this reshard moved, over all its runs (from the journal, like every count)."""
    rows_moved: int = 0
    map_backup: str | None = None
    """Where the map file was kept as it was before the new version replaced it (its comments and layout)."""

    def to_json(self) -> dict[str, Any]:
        return {"reshard_id": self.reshard_id, "map_version": self.map_version, "moved": self.moved,
                "rows_moved": self.rows_moved, "map_backup": self.map_backup, "plan": self.plan.to_json()}


def _validate(store: Cluster, area: str, start: GDID, new_shards: list[str]) -> None:
    unknown = [s for s in new_shards if s not in store.map.servers]
    if unknown:
        raise RoutingError(f"--shards names unknown server(s) {unknown} (known: {', '.join(store.map.servers)})")
    if len(set(new_shards)) != len(new_shards):
        raise RoutingError(f"--shards lists a server twice: {new_shards}")


def _same_kind(store: Cluster, area: str, old: Sequence[str], new_shards: Sequence[str]) -> None:
    """A partition's shards are of one kind: a reshard never moves briefcases between kinds."""
    kind = store.map.kind_of(old[0])
    other = [s for s in new_shards if store.map.kind_of(s) != kind]
    if other:
        raise RoutingError(
            f"reshard of area {area!r}: its partition lives on {kind} servers and --shards names {other} of another kind "
            "(a reshard between server kinds is not supported)"
        )


def parallel_for(store: Cluster, area: str, start: GDID, new_shards: list[str], parallel: int) -> tuple[int, list[str]]:
    """How many moves a reshard runs at once, and the SQLite servers that made it 1.

    SQLite lets one writer at a time into a file, and a move holds its source's write lock
    while it writes the target: two moves in parallel wait on each other's files until the
    busy timeout ends one with "database is locked". One at a time is as fast on SQLite.
    """
    if parallel <= 1:
        return parallel, []
    store.refresh()
    _, _, old = store.router.partition(area, start)
    known = [s for s in dict.fromkeys([*old, *new_shards]) if s in store.map.servers]
    sqlite = [s for s in known if store.engines.sql_dialect(s).one_writer_per_file]
    return (1, sqlite) if sqlite else (parallel, [])


def reshard(
    store: Cluster,
    area: str,
    start: GDID,
    new_shards: list[str],
    *,
    dry_run: bool = False,
    parallel: int = 1,
    max_pause: float = DEFAULT_MAX_PAUSE,
    map_path: str | Path | None = None,
    progress: ReshardProgress | None = None,
    batch_pause: float = DEFAULT_BATCH_PAUSE,
    throttle: ThrottleSettings | None = None,
    freeze_wait: float = DEFAULT_FREEZE_LOCK_WAIT,
    per_server: int = jobs.DEFAULT_PER_SERVER,
) -> ReshardOutcome:
    """Re-shard partition ``start`` of ``area`` onto ``new_shards``; see the module docstring.

    ``per_server``: work items in flight at once on one server, over every worker (:mod:`mdb.moves.jobs`).

    ``batch_pause``: the write pause (seconds) a batch of briefcases aims at; batches grow or
    shrink to keep it (:class:`BatchSizer`), and never exceed ``max_pause``. 0: one at a time.
    ``throttle``: a rate and a replica lag not to exceed (journaled: a resume keeps them).
    ``freeze_wait``: how long the freeze waits for the partition's writers already inside
    (journaled); past it the reshard stops unfrozen with a retryable error naming who held on.
    """
    check_max_pause(max_pause)
    if per_server < 1:
        raise MdbError(f"--per-server must be at least 1, got {per_server!r}")
    if not freeze_wait > 0:
        raise MdbError(f"freeze wait must be more than 0 seconds, got {freeze_wait!r}")
    if not 0 <= batch_pause <= max_pause:
        raise MdbError(f"batch pause must be between 0 and the max pause ({max_pause}s), got {batch_pause!r}")
    store.refresh()
    _validate(store, area, start, new_shards)
    _, _, old = store.router.partition(area, start)
    scan = scan_for(store, area, old[0])
    _same_kind(store, area, old, new_shards)
    if list(old) == list(new_shards):
        raise RoutingError(f"partition {start} of area {area!r} already has shards {list(old)}")
    journal = Journal(store)
    refuse_if_busy(journal, area)
    plan = plan_reshard(store, scan, area, start, new_shards, keep_moves=not dry_run)  # a dry run: totals only
    parallel, _ = parallel_for(store, area, start, new_shards, parallel)
    if dry_run:
        _check_plan(store, plan, scan, map_path, dry_run=True)
        return ReshardOutcome(None, plan, None, 0)
    reshard_id = new_move_id("reshard")
    # The lease first, then the journal row: a worker that sees the row finds it driven (it adopts only
    # a job whose lease nobody live holds), never a moment where it could take it from this command.
    with hold(journal, reshard_id) as lease:
        journal.start(JournalEntry(
            move_id=reshard_id, kind="reshard", area=area, step="plan", status=RUNNING,
            params={**ReshardParams(params_version=PARAMS_VERSION, partition_start=start, old_shards=list(old), new_shards=list(new_shards),
                                    parallel=parallel, max_pause=max_pause, batch_pause=batch_pause, freeze_wait=freeze_wait,
                                    per_server=per_server, map_path=None if map_path is None else str(Path(map_path).resolve()),
                                    ).to_params(),
                    **(throttle or ThrottleSettings()).to_params()},
            tables={name: [rows, 0] for name, rows in plan.rows_per_table().items()},
            briefcases_total=len(plan.moves), rows_total=plan.total_rows,
        ))
        fault_point("reshard.after_journal_start")
        entry = journal.get(reshard_id)
        assert entry is not None
        fenced = lease.fenced(store, fenced_servers(store, journal, entry))
        return continue_reshard(fenced, Journal(fenced), entry, progress=progress, first_plan=plan)


def _store_map_text(store: Cluster, map_path: str | None) -> str:
    """The text the new map version is written from: the map the system runs.

    The map file when it is that version (so its comments and layout carry over); when an
    applied map in CENTRAL is newer than the file (``mdb map apply`` does not rewrite the file),
    that map's recorded text, so the reshard never sees the file's older partitions as removed.
    """
    applied = newest_applied(store)
    if map_path is not None and Path(map_path).is_file():
        text = Path(map_path).read_text(encoding="utf-8")
        if applied is None or parse_map(text, map_path).version >= applied.version:
            return text
    if applied is not None:
        return applied.yaml
    return store.map.to_yaml()


def _next_version(store: Cluster) -> int:
    versions = [v for v, _ in applied_maps(store)]
    return max([store.map.version, *versions]) + 1


def _check_plan(store: Cluster, plan: ReshardPlan, scan: PartitionScan, map_path: str | Path | None, *, dry_run: bool) -> tuple[PartitionMap, str]:
    """Every target's schema and the new map (through apply_map's dry run), before anything moves."""
    pairs = plan.pairs()
    targets = [*plan.new_shards, *(target for _, target in pairs)]
    sources = [source for source, _ in pairs]  # reachable, and matching the models
    scan.check_servers([*targets, *sources], f"reshard of {plan.area} partition {plan.partition_start}")
    text = new_map_text(_store_map_text(store, None if map_path is None else str(map_path)), plan.area, plan.partition_start, plan.new_shards, _next_version(store))
    new_map = parse_map(text, "<new map>")
    apply_map(store, new_map, yaml_text=text, allow_reshard_of=(plan.area, plan.partition_start), dry_run=True)
    return new_map, text


def _record(journal: Journal, entry: JournalEntry, counts: ReshardCounts, progress: ReshardProgress | None, last: PlannedMove | None = None) -> None:
    """Write the counts (and the rate window) to the reshard's journal row, then show exactly those numbers."""
    counts.window.add(counts.briefcases_done, counts.rows_done)
    entry.params.update(counts.window.to_params())
    journal.update(entry.move_id, params=entry.params, **counts.journal_values())
    if progress is not None:
        progress.counts(counts, last)


@dataclass
class JobRun:
    """One run of a job (a reshard's start or resume, a rebalance, a drain, a cancel's move-back): what its passes need."""

    store: Cluster
    journal: Journal
    entry: JournalEntry
    scan: PartitionScan | None
    """The partition's scan (a reshard's re-plans); None for a job of a fixed list of moves."""
    parallel: int
    max_pause: float
    progress: ReshardProgress | None
    counts: ReshardCounts
    sizer: BatchSizer
    pace: Callable[[int, int], None] | None = None
    """Called with (briefcases, rows) before each batch is cut over; may wait (throttling)."""
    stopping: threading.Event = field(default_factory=threading.Event)
    """Set when the driving thread was interrupted (Ctrl-C, SIGTERM): every worker stops after its batch."""
    pass_no: int = 0
    """The last pass queued as work items (:mod:`mdb.moves.jobs`)."""
    workers: Workers | None = None
    """This process's workers, when the moves are queued as a job's items (SQL batched cutovers)."""


def moving_back(job: JournalEntry) -> bool:
    """The job is a reshard being cancelled: its moves now bring briefcases back (journaled as such, :mod:`mdb.moves.cancel`)."""
    return job.kind == "reshard" and job.step == CANCEL_STEP


def _forward_moves(journal: Journal, job: JournalEntry) -> dict[GDID, str]:
    """briefcase -> the job's finished forward move of it: what a move back names as ``reverse_of``."""
    return {g: m.move_id for m in journal.moves_of(job.move_id)
            if m.status == DONE and not (m.params.get("reverse_of") or m.params.get("move_back")) for g in m.briefcases}


def _move_one(store: Cluster, journal: Journal, entry: JournalEntry, m: PlannedMove, max_pause: float,
              item: str | None = None, reverse_of: str | None = None) -> MoveResult:
    """One briefcase by the single-move protocol, tried MOVE_ATTEMPTS times (an abort leaves the source intact).

    Journaled under the job (``reshard_id``), and under a work item's lease when ``item`` is given."""
    last: Exception | None = None
    for _ in range(MOVE_ATTEMPTS):
        try:
            return move_briefcase(store, entry.area, m.gdid, m.target, source=m.source, max_pause=max_pause,
                                  reshard_id=entry.move_id, journal=journal, refresh=False, item=item, reverse_of=reverse_of)
        except BriefcaseGoneError:  # deleted by the application since the plan: nothing left to move
            log.info("%s %s: briefcase %s/%s was deleted since it was planned; nothing to move", entry.kind, entry.move_id, entry.area, m.gdid)
            return MoveResult(None, entry.area, m.gdid, m.source, m.target, GONE)
        except MoveAbortedError as exc:  # e.g. --max-pause: the source is intact, try again
            last = exc
    raise MdbError(f"{entry.kind} {entry.move_id}: briefcase {entry.area}/{m.gdid} could not be moved: {last}")


def _moved_rows(result: MoveResult) -> dict[str, int] | None:
    """Rows per table a single move of the reshard moved; None for a briefcase deleted before it moved."""
    return None if result.status == GONE else {name: rows for name, (rows, _) in result.tables.items()}


class BatchSizer:
    """How many briefcases the next batch takes, so that its write pause stays near ``target`` seconds.

    A batch's pause is a fixed part (its round trips under the lock) plus a part per briefcase
    (its rows). Both are fitted by least squares over the latest batches, and the size is what
    the fit says fits in ``target``, at most doubling from one batch to the next and at most
    what the latest few batches' pause per briefcase says fits (the pause taken as all per
    briefcase). The fit alone overshot: once the batches are all of about one size, the slope
    of a fit through pauses that vary by a few milliseconds can come out near zero, the fit
    then says hundreds fit, and one batch of four times the size paused four times as long
    (measured: batches of 164 and 328 among batches of 80, 90-100 ms pauses, the p99 of a
    parallel reshard). The second bound never overshoots (for a pause below the target it
    lies between the size taken and the size that fits) and reaches what fits within a few
    batches. Where the fixed part alone exceeds the target (a loaded server), the size falls to
    ``smallest``: the pause is then the fixed part's, the least any cutover can take, and
    batching still pays it once per batch. An aborted batch halves the size. Shared by the
    parallel workers.
    """

    def __init__(self, target: float, *, start: int = BATCH_START, largest: int = BATCH_LARGEST, smallest: int = 1) -> None:
        self.target = target
        self.largest = largest
        self.smallest = max(1, min(smallest, largest))
        self.size = max(self.smallest, min(start, largest))
        self._samples: deque[tuple[int, float]] = deque(maxlen=12)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            return self.size

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per briefcase) of the latest batches' pauses."""
        points = list(self._samples)
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        var = sum((x - mean_x) ** 2 for x, _ in points)
        if var == 0:  # one size only: assume half of the pause is fixed
            return mean_y / 2, mean_y / 2 / max(mean_x, 1)
        per = max(sum((x - mean_x) * (y - mean_y) for x, y in points) / var, 1e-6)
        return max(mean_y - per * mean_x, 0.0), per

    def observed(self, briefcases: int, pause: float) -> None:
        with self._lock:
            self._samples.append((briefcases, pause))
            fixed, per = self.fit()
            fits = int((self.target - fixed) / per + 1e-6) if self.target > fixed else self.smallest
            recent = list(self._samples)[-RECENT_BATCHES:]
            paused = sum(p for _, p in recent)
            proportional = int(self.target * sum(n for n, _ in recent) / paused + 1e-6) if paused > 0 else self.largest
            self.size = max(self.smallest, min(self.largest, 2 * self.size, fits, proportional))

    def aborted(self) -> None:
        with self._lock:
            self.size = max(1, self.size // 2)


class _Feeder:
    """Hands out the next move to whichever worker is free: (source, target) pairs in turn."""

    def __init__(self, moves: list[PlannedMove]) -> None:
        groups: dict[tuple[str, str], list[PlannedMove]] = {}
        for m in moves:
            groups.setdefault((m.source, m.target), []).append(m)
        self._groups = [g[::-1] for g in groups.values()]  # popped from the end, in plan order
        self._turn = 0
        self._lock = threading.Lock()
        self.stopped = False

    def next(self) -> PlannedMove | None:
        with self._lock:
            self._groups = [g for g in self._groups if g]
            if self.stopped or not self._groups:
                return None
            self._turn = (self._turn + 1) % len(self._groups)
            return self._groups[self._turn].pop()


def move_all(run: JobRun, moves: list[PlannedMove]) -> None:
    """Move ``moves``: as work items in batches where the servers' kind has a batched cutover
    (:func:`_move_queued`), else one at a time.

    One at a time is the document kinds' way, `--batch-pause 0`'s, and a reshard journaled by
    an older mdb without a batch pause; ``parallel`` threads each take the next move. Counts are recorded per move.
    """
    store, journal, entry, counts, sizer, max_pause = run.store, run.journal, run.entry, run.counts, run.sizer, run.max_pause
    if moves and sizer.target > 0 and backend_of(store.map, moves[0].source).batches_cutovers:
        if run.workers is None:
            raise RuntimeError(f"reshard {entry.move_id}: batched moves without work items (no Workers at step {entry.step!r})")
        _move_queued(run, moves)
        return
    lock = threading.Lock()
    feeder = _Feeder(moves)
    back = moving_back(entry)
    forward = _forward_moves(journal, entry) if back else {}

    def work() -> None:
        try:
            while m := feeder.next():
                check_stop(entry.move_id)  # `mdb moves cancel` from another process: stop between two moves
                if run.stopping.is_set():
                    return
                if run.pace is not None:
                    run.pace(1, m.total_rows)
                try:
                    rows = _moved_rows(_move_one(store, journal, entry, m, max_pause, reverse_of=forward.get(m.gdid, entry.move_id) if back else None))
                except DBAPIError as exc:
                    raise _named(store, [m.source, m.target], exc) from exc
                with lock:
                    first = counts.briefcases_done == 0
                    counts.moved(m, rows)
                    _record(journal, entry, counts, run.progress, m)
                    if first and counts.briefcases_done:
                        fault_point(FIRST_MOVE_BACK if back else "reshard.after_first_move")
        except BaseException:
            feeder.stopped = True  # the other workers finish their move and stop
            raise

    servers = sorted({m.source for m in moves} | {m.target for m in moves})
    try:
        _run_workers(run, work)
    except DBAPIError as exc:
        raise _named(store, servers, exc) from exc


class Workers:
    """This process's share of the reshard jobs' work (:mod:`mdb.moves.jobs`): what its worker threads share.

    The per-server cutover gates (a cutover here waits only for steps on its own two servers),
    a batch sizer and a throttle per job, and the stop flag (Ctrl-C, SIGTERM): a worker that
    sees it finishes the batch in hand and gives its item back.
    """

    def __init__(self, store: Cluster, stopping: threading.Event | None = None, parent: threading.Event | None = None) -> None:
        self.store = unchecked(store)
        self.journal = Journal(self.store)
        self.stopping = stopping or threading.Event()
        self.parent = parent
        """The stop flag of the process (``mdb worker``'s SIGTERM) when this is one job's run inside it."""
        self.gates = CutoverGate(stopped=self.stopped)
        """A stop (Ctrl-C, SIGTERM) is seen there between two steps of a batch: the batch rolls back (:mod:`mdb.moves.gate`)."""
        self._held = ExitStack()
        self._held_key: tuple[str, int] | None = None
        self._hashed: dict[str, frozenset[str]] = {}
        self._revisions: dict[str, str | None] = {}
        self._last_job: str | None = None
        self._moved: set[str] = set()
        self._sizers: dict[str, BatchSizer] = {}
        self._paces: dict[str, Callable[[int, int], None] | None] = {}
        self._lock = threading.Lock()

    def schemas(self, job: JournalEntry, pass_no: int, servers: list[str], tables: list[AreaTable]) -> frozenset[str]:
        """The area's schemas held on ``servers`` for the pass (:func:`hold_schemas`), the tables both sum by row hash.

        Held for every item of one pass that this process works on, not per item: checking a
        server's tables costs more than a batch. Let go when the pass changes (:meth:`let_go`).
        """
        with self._lock:
            key = (job.move_id, pass_no)
            if self._held_key != key:
                self._held.close()
                self._held, self._held_key, self._hashed, self._revisions = ExitStack(), key, {}, {}
            missing = [s for s in dict.fromkeys(servers) if s not in self._hashed]
            if missing:
                hashed = self._held.enter_context(hold_schemas(self.store, job.area, missing, tables, self._revisions))
                for server in missing:
                    self._hashed[server] = hashed
            return frozenset.intersection(*(self._hashed[s] for s in servers))

    def let_go(self) -> None:
        """Release the held schemas (the pass ended, or this worker is idle): migrations may run."""
        with self._lock:
            self._held.close()
            self._held, self._held_key, self._hashed, self._revisions = ExitStack(), None, {}, {}

    def moved(self, job: JournalEntry) -> None:
        """A batch or move of ``job`` committed here: the first one in this process is the crash point
        ``reshard.after_first_move`` (where the batch was moved, as when one process moved them all),
        or a cancel's ``cancel.after_first_move_back``."""
        key = f"{job.move_id}:{job.step == CANCEL_STEP}"
        with self._lock:
            first = key not in self._moved
            self._moved.add(key)
        if first:
            fault_point(FIRST_MOVE_BACK if moving_back(job) else "reshard.after_first_move")

    def fresh_for(self, job_id: str) -> bool:
        """True the first time this process works on ``job_id`` since it worked on another one."""
        with self._lock:
            new, self._last_job = self._last_job != job_id, job_id
            return new

    def stopped(self) -> bool:
        return self.stopping.is_set() or (self.parent is not None and self.parent.is_set())

    def sizer(self, job: JournalEntry) -> BatchSizer:
        with self._lock:
            if job.move_id not in self._sizers:
                self._sizers[job.move_id] = BatchSizer(float(job.params.get("batch_pause", DEFAULT_BATCH_PAUSE)))
            return self._sizers[job.move_id]

    def pace(self, job: JournalEntry) -> Callable[[int, int], None] | None:
        """The job's throttle (a reshard's ``--rate``/``--max-lag``) over the servers it writes; None when unthrottled."""
        with self._lock:
            if job.move_id not in self._paces:
                self._paces[job.move_id] = _pace(self.store, job, job_servers(job), [], None, self.stopping)
            return self._paces[job.move_id]


def job_servers(job: JournalEntry) -> list[str]:
    """The servers a job moves briefcases between: a reshard's old and new shards, another job's ``servers`` param."""
    return list(dict.fromkeys([*job.params.get("old_shards", []), *job.params.get("new_shards", []), *job.params.get("servers", [])]))


def _resolve_item(fenced: Cluster, journal: Journal, item: Item) -> ItemResult:
    """Under the item's lease: finish or roll back what its earlier claimers left; what the item has moved so far."""
    mine = [e for e in journal.moves_of(item.job_id) if e.params.get("item") == item.item_id]
    for e in mine:
        if e.status == RUNNING:
            outcome = resolve_move(fenced, Journal(fenced), e)
            log.warning("%s of job %s: its earlier worker left %s %s: %s", item.item_id, item.job_id, e.kind, e.move_id, outcome.action)
    result = ItemResult()
    for e in journal.moves_of(item.job_id):
        if e.params.get("item") == item.item_id and e.status == DONE:
            result.add(e.briefcases, {name: done for name, (_, done) in e.tables.items()})
    return result


def settle_item(store: Cluster, item: Item) -> None:
    """An item nobody drives any more: take its lease, resolve what it left, drop it (:func:`mdb.moves.jobs.settle`)."""
    store = unchecked(store)
    journal = Journal(store)
    try:
        with hold(journal, item.item_id) as lease:
            fenced = lease.fenced(store, jobs.item_servers(store, journal, item))
            _resolve_item(fenced, journal, item)
            jobs.drop(fenced, journal.server, item.item_id)
    except MoveLeaseHeldError:
        pass  # claimed and taken meanwhile by a live worker: settle waits for it


def work_item(workers: Workers, item: Item, after_batch: Callable[[], None] | None = None) -> bool:
    """Move the briefcases of a claimed item under its own lease; True when it is done.

    Every write goes through the item's fenced cluster (epoch claimed on CENTRAL, its source and
    its target at the take): a worker that lost the lease cannot write anywhere. Taken over from
    an earlier claimer (``attempts`` > 1), what that one left is resolved first and only the
    rest is moved. Between batches the worker checks its stop flag, the item's state (its job
    stopped: dropped) and its lease; stopping gives the item back (claimable again). Stopped
    inside a batch (an error, Ctrl-C in the calling thread, a stop seen by the gate) the item is
    given back too, for whoever claims it next to resolve what the batch left.
    ``after_batch``: called after each batch's commit (the job's holder records its counts there).
    """
    store, journal = workers.store, workers.journal
    if workers.fresh_for(item.job_id):
        store.refresh()  # a long-running worker on a new job: the map may have a newer version since its last one
    with ExitStack() as stack:
        try:
            lease = stack.enter_context(hold(journal, item.item_id))
        except MoveLeaseHeldError:
            return False  # another worker won the take
        fenced = lease.fenced(store, jobs.item_servers(store, journal, item))
        fj = Journal(fenced)
        job = journal.get(item.job_id)
        if job is None or job.status != RUNNING:
            jobs.drop(fenced, journal.server, item.item_id)
            return False
        result = _resolve_item(fenced, journal, item) if item.attempts > 1 else ItemResult()
        back = moving_back(job)  # a cancel's move-back: journaled as such, so the cancel counts (and never re-moves) them
        forward = _forward_moves(journal, job) if back else {}
        settled = set(result.moved)
        remaining = [g for g in item.gdids if g not in settled]
        max_pause = float(job.params.get("max_pause", DEFAULT_MAX_PAUSE))
        sizer, pace = workers.sizer(job), workers.pace(job)
        tables = area_tables(store, job.area)
        gate = workers.gates.pair(item.source, item.target)
        hashed = workers.schemas(job, item.pass_no, [item.source, item.target], tables)

        def single(g: GDID) -> None:
            m = PlannedMove(g, item.source, item.target, {})
            moved = _move_one(fenced, fj, job, m, max_pause, item=item.item_id,
                              reverse_of=forward.get(g, job.move_id) if back else None)
            if moved.status == GONE:
                result.gone.append(g)
            else:
                result.add([g], _moved_rows(moved) or {})

        def cut_over(batch: list[GDID]) -> None:
            try:
                moved = BatchMove(fenced, fj, job.area, batch, item.source, item.target, reshard_id=job.move_id, tables=tables,
                                  max_pause=max_pause, hashed=hashed, gate=gate, item=item.item_id, move_back=back).run()
            except BatchAbortedError as exc:
                log.info("%s %s: %s", job.kind, job.move_id, exc)
                sizer.aborted()
                alone = [g for g in batch if g in set(exc.refused)] if len(batch) > 1 else batch
                rest = [g for g in batch if g not in alone]
                for g in alone:
                    single(g)
                half = (len(rest) + 1) // 2
                for part in (rest[:half], rest[half:]):
                    if part:
                        cut_over(part)
                return
            sizer.observed(len(batch), moved.pause_seconds)
            result.add(batch, moved.rows_per_table)

        per_briefcase = item.rows_planned // max(1, len(item.gdids))
        try:
            while remaining:
                if workers.stopped() or jobs.item_state(journal, item.item_id) != jobs.PENDING:
                    jobs.release_item(fenced, journal.server, item.item_id)
                    return False
                lease.check()
                n = sizer.next()
                batch, remaining = remaining[:n], remaining[n:]
                if pace is not None:
                    pace(len(batch), len(batch) * per_briefcase)
                try:
                    cut_over(batch)
                except DBAPIError as exc:
                    raise _named(store, [item.source, item.target], exc) from exc
                jobs.progress_item(fenced, journal.server, item.item_id, result)  # the job's counts follow each batch
                if after_batch is not None:
                    after_batch()
                workers.moved(job)
        except BaseException:
            try:
                jobs.give_back(fenced, journal.server, item.item_id)
            except Exception as again:  # lease lost, CENTRAL gone: the item's claim lapses with its lease (CLAIM_SETTLE)
                log.warning("%s of job %s: could not give the item back: %s", item.item_id, item.job_id, again)
            raise
        jobs.finish_item(fenced, journal.server, item.item_id, result)
        return True


def _move_queued(run: JobRun, moves: list[PlannedMove]) -> None:
    """Queue ``moves`` as this pass's work items; work on them here (``run.parallel`` threads) until every item is done.

    Workers elsewhere (``mdb worker``) claim items of the pass too. With ``parallel`` 1 the
    items are worked in the calling thread, as the moves were before jobs: Ctrl-C and SIGTERM
    (raised in the main thread only) interrupt it wherever it is. With more, the calling thread
    records the counts as items progress and waits interruptibly; told to stop, it sets the
    workers' stop flag, which they see between two steps of a batch (:mod:`mdb.moves.gate`),
    and waits for them (a second Ctrl-C stops waiting). Either way the pass's items are then
    stopped: given back or left for the next holder to settle, resumable.
    """
    assert run.workers is not None
    workers, entry, counts = run.workers, run.entry, run.counts
    journal = workers.journal
    run.pass_no += 1
    pass_no = run.pass_no
    jobs.enqueue(run.journal, entry.move_id, pass_no, moves)  # fenced by the job's lease: a stale holder queues nothing
    over = threading.Event()
    errors: list[BaseException] = []
    # Per item, what was already counted: its briefcases as 12-byte keys and its rows per table. Not
    # the parsed results: a GDID object per moved briefcase, kept to the end, is a heap that every
    # full collection of the mover walks while batches wait for their finalize (bytes are not
    # tracked by the collector), and it grew those collections to 0.75 s at a million briefcases.
    seen: dict[str, tuple[frozenset[bytes], dict[str, int]]] = {}
    known: dict[str, str] = {}  # the result texts already folded in (jobs.results_of parses only what changed)

    def collect() -> bool:
        """Fold what the items moved since the last look into the counts (and the journal); True if anything."""
        fresh = False
        last: PlannedMove | None = None
        for item_id, result in jobs.results_of(journal, entry.move_id, pass_no, known).items():
            had, tables = seen.get(item_id, (frozenset(), {}))
            delta = ItemResult([g for g in result.moved if bytes(g) not in had], [g for g in result.gone if bytes(g) not in had],
                               {name: n - tables.get(name, 0) for name, n in result.tables.items()})
            if delta.moved or delta.gone:
                last = counts.pending.get(delta.moved[-1]) if delta.moved else last  # read before the counts pop it
                counts.moved_result(delta)
                seen[item_id] = (frozenset(bytes(g) for g in (*result.moved, *result.gone)), dict(result.tables))
                fresh = True
        if fresh:
            _record(run.journal, entry, counts, run.progress, last)  # the progress shows a move just done
        return fresh

    def look() -> None:
        """Between two batches or items, in the calling thread: counts recorded, a cancel or a stop noticed."""
        collect()
        check_stop(entry.move_id)
        if workers.stopped():
            raise ReshardStoppedError(f"reshard {entry.move_id} stopped by an interrupt; its work items are given back")

    def local() -> None:
        try:
            while not over.is_set() and not workers.stopped():
                item = jobs.claim(journal, [entry.move_id])
                if item is None:
                    over.wait(0.1)
                    continue
                work_item(workers, item)
        except BaseException as exc:
            errors.append(exc)
            over.set()

    threads = [] if run.parallel == 1 else [  # 0: workers elsewhere do it
        threading.Thread(target=local, name=f"mdb-worker-{i}", daemon=True) for i in range(run.parallel)]
    for t in threads:
        t.start()
    try:
        while True:
            look()
            if errors:
                raise errors[0]
            if run.parallel == 1:
                item = jobs.claim(journal, [entry.move_id])
                if item is not None:
                    work_item(workers, item, after_batch=look)
                    continue
            if not jobs.count_open(journal, entry.move_id, pass_no):
                if collect():
                    continue  # finished between the two reads: recorded now
                break
            over.wait(0.1)  # items in other workers' hands (or claimable again soon)
    except BaseException:
        run.stopping.set()
        over.set()
        try:
            for t in threads:
                while t.is_alive():  # each stops before its batch's next step
                    t.join(0.1)
        except BaseException:  # a second Ctrl-C: stop waiting; their leases lapse with this process
            log.warning("reshard %s: stopped without waiting for its worker threads", entry.move_id)
        else:
            try:
                workers.let_go()
            except (MdbError, DBAPIError) as again:
                # Letting the held schemas go on a server that just died fails too; that driver error must not
                # replace the one naming the server (exit 3). The server ended those sessions anyway.
                log.warning("reshard %s: could not let the held schemas go: %s", entry.move_id, describe(again) if isinstance(again, DBAPIError) else again)
        try:
            jobs.stop_items(journal, entry.move_id)
        except Exception as again:  # the holder's error is what is raised; the next holder settles the items
            log.warning("reshard %s: could not stop its work items: %s", entry.move_id, again)
        raise
    over.set()
    for t in threads:
        t.join()
    workers.let_go()
    if errors:
        raise errors[0]


def _run_workers(run: JobRun, work: Callable[[], None]) -> None:
    """``work`` in ``run.parallel`` threads (the calling thread when 1)."""
    if run.parallel <= 1:
        work()
        return
    with ThreadPoolExecutor(max_workers=run.parallel, thread_name_prefix="mdb-reshard") as pool:
        try:
            for future in [pool.submit(work) for _ in range(run.parallel)]:
                future.result()
        except BaseException:
            # Ctrl-C and SIGTERM reach this (main) thread only: tell the workers, which finish the
            # move in hand (its commit point is journaled, resume picks up after it) and take no
            # other; the pool's exit waits for them (they used to move everything).
            run.stopping.set()
            raise


def _named(store: Cluster, servers: list[str], exc: DBAPIError) -> Exception:
    """A driver error that reached the reshard untranslated, as the error naming its server.

    A connection cut mid-batch ("terminating connection due to administrator command") can
    surface from a connection no ``translated`` block wraps; it used to end the CLI with exit 2
    and no server named. Which of the batch's servers went away is asked of them.
    """
    mapped = translate(servers[0], exc)
    if not isinstance(mapped, ServerUnavailableError):
        return exc if mapped is None else mapped
    for server in servers:
        try:
            with store.transaction(server) as conn:
                conn.exec_driver_sql("SELECT 1")
        except ServerUnavailableError as down:
            return down
        except (MdbError, DBAPIError):
            return ServerUnavailableError(server, describe(exc))
    return ServerUnavailableError(" or ".join(servers), f"{describe(exc)} (both answer again now)")


def _sweep(run: JobRun, plan: ReshardPlan, sweeps: int) -> ReshardPlan:
    """Move the plan's briefcases and re-plan (briefcases created meanwhile), up to ``sweeps`` passes.

    Stops early when a pass finds no fewer briefcases than the one before: the application
    creates them as fast as they move, so more online passes would not shrink what the frozen
    final pass has to move, only make the reshard longer. Every plan becomes the counts' pending part.
    """
    for _ in range(sweeps):
        if not plan.moves:
            break
        move_all(run, plan.moves)
        fault_point("reshard.between_passes")  # the pass's schema locks are let go: a migration may run here
        run.store.refresh()
        before = len(plan.moves)
        assert run.scan is not None, "a reshard's run has its partition's scan"
        plan = plan_reshard(run.store, run.scan, run.entry.area, plan.partition_start, plan.new_shards)
        run.counts.plan(plan)
        _record(run.journal, run.entry, run.counts, run.progress)
        if len(plan.moves) >= before:
            break
    return plan


def journaled_map_path(entry: JournalEntry, given: Path | None) -> str | None:
    """The map file a resumed reshard rewrites: the absolute path it recorded when it started.

    Resume may run from any folder, so a relative path would name a file in the wrong place
    (it used to write a new map there and leave the real file at the old version). Entries
    journaled by older versions hold the path as typed: resolved against the map given to
    resume when the file names match, refused otherwise, before anything changes.
    """
    recorded: str | None = entry.params.get("map_path")
    if recorded is None or Path(recorded).is_absolute():
        return recorded
    if given is not None and Path(given).name == Path(recorded).name:
        return str(Path(given).resolve())
    raise MdbError(
        f"reshard {entry.move_id} recorded its map file as the relative path {recorded!r} (an older mdb) and the map given "
        f"here is {'not a file' if given is None else str(given)!r}: run `mdb moves resume` with that map file ({Path(recorded).name})"
    )


def continue_reshard(
    store: Cluster,
    journal: Journal,
    entry: JournalEntry,
    *,
    progress: ReshardProgress | None = None,
    first_plan: ReshardPlan | None = None,
    pace: Callable[[int, int], None] | None = None,
    stopping: threading.Event | None = None,
) -> ReshardOutcome:
    """Run (or resume) a journaled reshard from its recorded step to the end.

    A state machine over :class:`~mdb.moves.reshard_state.ReshardStep`: each step's function
    (:data:`_STEPS`) runs and names the next step, which :func:`_enter` journals before it runs,
    so a resume runs the recorded step again. Resumed anywhere from ``freeze`` to ``map_apply``
    it freezes again (idempotent), sweeps, applies the map unless it already is, and unfreezes:
    it always finishes forward. A step of :data:`FROZEN_STEPS` runs with the partition frozen
    (the driver freezes first), and an error in one unfreezes it.

    SQL batched moves are queued as the job's work items (:mod:`mdb.moves.jobs`), worked on by
    ``parallel`` threads here and by any ``mdb worker``; first the items earlier holders left
    are settled. ``stopping``: the process's own stop flag (an ``mdb worker`` driving the job).
    """
    params = ReshardParams.of(entry.move_id, entry.params)
    step = ReshardStep(entry.step)
    area, start = entry.area, params.partition_start
    parallel, _ = parallel_for(store, area, start, params.new_shards, params.parallel)
    scan = scan_for(store, area, params.old_shards[0])
    store.refresh()
    workers = None
    if step not in (ReshardStep.UNFREEZE, ReshardStep.CLEANUP):
        # What earlier holders' workers left is settled first: the counts below include what it finishes.
        workers = Workers(store, None, stopping)
        jobs.settle(workers.journal, entry.move_id, lambda item: settle_item(store, item))
    counts = ReshardCounts.from_journal(journal, entry.move_id)
    own_stop = threading.Event()
    if pace is None:
        pace = _pace(store, entry, params.old_shards, params.new_shards, progress, own_stop)
    run = JobRun(store, journal, entry, scan, parallel, params.max_pause, progress, counts, BatchSizer(params.batch_pause),
               pace, own_stop)
    if workers is not None:
        workers.stopping = own_stop
        run.workers = workers
        run.pass_no = jobs.last_pass(workers.journal, entry.move_id)
    state = _Driving(run, params, journaled_map_path(entry, store.map_path), step, first_plan)
    current: ReshardStep | None = step
    while current is not None:
        try:
            if current in FROZEN_STEPS and not state.frozen:
                _freeze(state)  # the first frozen step freezes; one a resume starts at freezes again (idempotent)
            current = _STEPS[current](state)
            if current is not None:
                _enter(state, current)
        except BaseException as exc:
            if state.frozen:  # an error or Ctrl-C with the partition frozen: let the application write again, then report
                _unfreeze_after(state, exc)
            raise
    journal.finish(entry.move_id, DONE, **counts.journal_values())
    jobs.forget(journal, entry.move_id)
    store.refresh()
    report = state.report or ReshardPlan(area, start, None, params.old_shards, params.new_shards)
    return ReshardOutcome(entry.move_id, report, params.map_version, counts.briefcases_done, counts.rows_done,
                          params.map_backup)


@dataclass
class _Driving:
    """What the steps of one run of a reshard share (its start, or a resume)."""

    run: JobRun
    params: ReshardParams
    map_path: str | None
    resumed_at: ReshardStep
    plan: ReshardPlan | None = None
    """The latest plan (the first, then what each sweep left)."""
    report: ReshardPlan | None = None
    """The first plan of this run: what the outcome reports."""
    frozen: bool = False
    """The partition was frozen by this run (an error in a frozen step unfreezes it)."""

    @property
    def scan(self) -> PartitionScan:
        assert self.run.scan is not None, "a reshard's run has its partition's scan"
        return self.run.scan

    def phase(self, name: str) -> None:
        if self.run.progress is not None:
            self.run.progress.phase(name)


def _enter(state: _Driving, step: ReshardStep) -> None:
    """Journal ``step`` (with the params and counts) before it runs: the one place a reshard's step is written."""
    entry = state.run.entry
    entry.params.update(state.params.to_params())
    state.run.journal.step(entry.move_id, step, params=entry.params, **state.run.counts.journal_values())
    entry.step = step


def _plan(state: _Driving) -> ReshardStep:
    if state.plan is None:
        state.plan = plan_reshard(state.run.store, state.scan, state.run.entry.area, state.params.partition_start,
                                  state.params.new_shards)
    state.report = state.report or state.plan
    state.run.counts.plan(state.plan)
    fault_point("reshard.after_plan")
    return ReshardStep.PRECHECKS


def _prechecks(state: _Driving) -> ReshardStep:
    """Every target's schema and the new map in dry run; a refusal now aborts the reshard (nothing moved)."""
    state.phase("prechecks")
    plan = state.plan
    if plan is None:  # resumed at this step: plan again (what the plan step would have done)
        _plan(state)
        plan = state.plan
        assert plan is not None
    run = state.run
    _refused_leaves_nothing(run.journal, run.entry, lambda: _check_plan(run.store, plan, state.scan, state.map_path, dry_run=True))
    fault_point("reshard.after_prechecks")
    return ReshardStep.MOVES


def _moves(state: _Driving) -> ReshardStep:
    """Online sweeps: the application keeps writing; briefcases created meanwhile are picked up by
    the next pass. Whatever is left after MAX_SWEEPS is moved under the freeze."""
    run = state.run
    if state.resumed_at == ReshardStep.MOVES:
        # Resumed after moves began: plan again; a refusal now must stay resumable (the moved briefcases are relocations).
        state.phase("prechecks")
        _plan(state)
        assert state.plan is not None
        run.journal.update(run.entry.move_id, **run.counts.journal_values())
        _check_plan(run.store, state.plan, state.scan, state.map_path, dry_run=True)
        fault_point("reshard.after_prechecks")
    assert state.plan is not None
    state.phase("moves")
    if run.progress is not None:
        run.progress.counts(run.counts, None)
    with long_lived_frozen():  # the plan out of full collections while the application waits on finalizes
        state.plan = _sweep(run, state.plan, MAX_SWEEPS)
    fault_point("reshard.after_moves")
    check_stop(run.entry.move_id)
    return ReshardStep.FREEZE


def _freeze(state: _Driving) -> None:
    """Freeze the partition on its old shards (idempotent): only writes of briefcases that still
    have to move wait, those that stay go on. ``frozen`` first: a freeze that fails
    (or is interrupted) on the second old shard has frozen the first, and all are unfrozen."""
    state.phase("freeze")
    state.frozen = True
    run, params = state.run, state.params
    freeze_partition(run.store, run.entry.area, params.partition_start, params.old_shards, run.entry.move_id,
                     lock_wait=params.freeze_wait, new_shards=params.new_shards)
    fault_point("reshard.after_freeze")


def _freeze_step(state: _Driving) -> ReshardStep:
    return ReshardStep.FINAL_MOVES  # the driver froze the partition before this step (it is in FROZEN_STEPS)


def _final_moves(state: _Driving) -> ReshardStep:
    """With the freeze in place no briefcase of the partition can be created or written on an old
    shard, so one sweep finds every straggler and the next one must find none."""
    run, params = state.run, state.params
    state.phase("final moves")
    run.store.refresh()
    plan = plan_reshard(run.store, state.scan, run.entry.area, params.partition_start, params.new_shards)
    run.counts.plan(plan)
    _record(run.journal, run.entry, run.counts, run.progress)
    state.plan = plan = _sweep(run, plan, 1)
    if plan.moves:
        raise MdbError(
            f"reshard {run.entry.move_id}: {len(plan.moves)} briefcase(s) of the frozen partition appeared after the "
            f"final sweep (e.g. {plan.moves[0].gdid} on {plan.moves[0].source!r}): something writes without the "
            "ownership check; nothing was applied"
        )
    fault_point("reshard.after_final_moves")
    check_stop(run.entry.move_id)  # the last moment a cancel can keep the old map
    return ReshardStep.MAP_APPLY


def _map_apply(state: _Driving) -> ReshardStep:
    state.phase("map apply")
    state.params.map_version = _apply_new_map(state)
    return ReshardStep.UNFREEZE


def _unfreeze(state: _Driving) -> ReshardStep:
    state.phase("unfreeze")
    run = state.run
    state.frozen = False  # an error unfreezing is raised as it is (the journal stays at unfreeze: resume does it)
    unfreeze_partition(run.store, run.entry.area, state.params.partition_start, state.params.old_shards)
    fault_point("reshard.after_unfreeze")
    return ReshardStep.CLEANUP


def _cleanup_step(state: _Driving) -> None:
    state.phase("cleanup")
    _cleanup(state.run.store, state.run.entry.area, state.params.partition_start)


_STEPS: Final[dict[ReshardStep, Callable[[_Driving], ReshardStep | None]]] = {
    ReshardStep.PLAN: _plan,
    ReshardStep.PRECHECKS: _prechecks,
    ReshardStep.MOVES: _moves,
    ReshardStep.FREEZE: _freeze_step,
    ReshardStep.FINAL_MOVES: _final_moves,
    ReshardStep.MAP_APPLY: _map_apply,
    ReshardStep.UNFREEZE: _unfreeze,
    ReshardStep.CLEANUP: _cleanup_step,
}
"""Each step's function; it returns the step to journal and run next (None: the reshard is done)."""


def _unfreeze_after(state: _Driving, exc: BaseException) -> None:
    """After an error in a frozen step: unfreeze (the old map is still authoritative, or the new
    map is fully in place); the journal stays at the step, so resume freezes again."""
    run = state.run
    try:
        unfreeze_partition(run.store, run.entry.area, state.params.partition_start, state.params.old_shards)
    except Exception as again:
        raise MdbError(
            f"reshard {run.entry.move_id} failed ({exc!r}) and unfreezing partition {state.params.partition_start} also "
            f"failed ({again}): writes of that partition wait until `mdb moves resume MAP` finishes the reshard"
        ) from exc


def _refused_leaves_nothing(journal: Journal, entry: JournalEntry, prechecks: Callable[[], object]) -> None:
    """Run ``prechecks``; when they refuse, journal the reshard aborted before raising.

    Nothing has moved yet, and the command says so: an entry left running would block every
    later move of the area and be "resumed" into the whole reshard the operator saw refused.
    A failure to record that is logged; the refusal is what is raised.
    """
    try:
        prechecks()
    except Exception as exc:
        try:
            journal.finish(entry.move_id, ABORTED, detail=f"refused by its prechecks, nothing moved: {exc}")
        except Exception as again:  # CENTRAL itself failing: the entry stays resumable, the refusal is still raised
            log.warning("reshard %s: refused by its prechecks, and journaling that failed too: %s", entry.move_id, again)
        raise


def _pace(store: Cluster, entry: JournalEntry, old_shards: list[str], new_shards: list[str],
          progress: ReshardProgress | None, stopping: threading.Event | None = None) -> Callable[[int, int], None] | None:
    """The throttle of the journaled settings (None when unthrottled); a cancel or Ctrl-C is noticed while it waits."""
    settings = ThrottleSettings.from_params(entry.params)
    if not settings.limited:
        return None

    def on_wait(reason: str, seconds: float) -> None:
        check_stop(entry.move_id)
        if stopping is not None and stopping.is_set():
            raise ReshardStoppedError(f"reshard {entry.move_id} stopped by an interrupt while throttled")
        if progress is not None:
            progress.waiting(reason, seconds)

    return Throttle(store, settings, list(dict.fromkeys([*old_shards, *new_shards])), on_wait=on_wait).wait


def _apply_new_map(state: _Driving) -> int:
    """Apply the journaled new map (once), then write it to the map file; idempotent."""
    run, params = state.run, state.params
    entry, store, map_path = run.entry, run.store, state.map_path
    text = params.new_map_yaml
    if text is None:
        text = new_map_text(_store_map_text(store, map_path), entry.area, params.partition_start, params.new_shards,
                            _next_version(store))
        params.new_map_yaml = text
        entry.params.update(params.to_params())
        run.journal.update(entry.move_id, params=entry.params)
    new_map = parse_map(text, "<new map>")
    fault_point("reshard.before_map_apply")
    if new_map.version not in {v for v, _ in applied_maps(store)}:
        apply_map(store, new_map, yaml_text=text, allow_reshard_of=(entry.area, params.partition_start))
    fault_point("reshard.after_map_apply")
    if map_path is not None:
        def journal_backup(backup: Path) -> None:
            params.map_backup = str(backup)
            entry.params.update(params.to_params())
            run.journal.update(entry.move_id, params=entry.params)

        rewrite_map_file(Path(map_path), text, new_map.version, tag=entry.move_id, on_backup=journal_backup)
    fault_point("reshard.after_map_file")
    store.refresh()
    return new_map.version


def _cleanup(store: Cluster, area: str, start: GDID) -> None:
    """Drop relocations that now equal default routing, then the redundant 'resident' rows."""
    router = store.router
    in_partition = [
        (g, srv) for (a, g), srv in router.relocations.items()
        if a == area and router.default_placement(area, g).partition_start == start
    ]
    set_relocations(store, area, {gdid: None for gdid, server in in_partition if router.default_placement(area, gdid).server == server})
    fault_point("reshard.after_clear_relocations")
    store.refresh()
    router = store.router
    _, _, shards = router.partition(area, start)

    for server in shards:
        def redundant(g: GDID, server: str = server) -> bool:
            """Default routing now finds ``g`` on ``server``: its 'resident' record there says nothing more."""
            home = router.default_placement(area, g)
            return home.partition_start == start and home.server == server and (area, g) not in router.relocations

        backend_of(store.map, server).drop_residents(store, server, area, redundant)
    fault_point("reshard.after_resident_cleanup")
