"""A rebalance or a drain as a job in CENTRAL: a fixed list of planned moves that any worker works on.

``mdb rebalance --apply`` and ``mdb drain`` used to run their moves one at a time in their own
process. Now the command journals a job (kind ``rebalance`` or ``drain``; its ``params['moves']``
are the planned ``[gdid, source, target]`` triples) and runs it as a reshard runs a pass: the
moves are queued as work items per (source, target) pair (:mod:`mdb.moves.jobs`) and moved in
batched cutovers by :func:`mdb.moves.reshard.work_item`, here in the command's own thread and
by any ``mdb worker MAP`` on any host. Document areas move one briefcase at a time in the
holder's process, journaled under the job, as a reshard of a document area does (no batched
cutover exists for them).

Whoever holds the job's lease drives it: the command, or once it is gone a ``mdb worker`` that
adopts it, or ``mdb moves resume``. A new holder first settles the items earlier holders left
(:func:`mdb.moves.jobs.settle`: what a dead worker left is finished or rolled back from the
journal), then plans again from the live routing: every planned move whose briefcase is still
routed to its source is queued again, the others are done (or were moved by someone else), so
nothing is moved twice. A job has one pass per run: a briefcase the application deleted is
counted as gone, not retried.

Cancelling one (``mdb moves cancel``) stops it: live workers stop after their batch in hand, what
dead ones left is resolved, and the moves already finished stay where they are (a rebalance
or a drain changes no map: each finished move is an ordinary relocation, or a relocation
cleared). ``--move-back`` has nothing to restore there and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from mdb.backends import servers_where
from mdb.cluster import Cluster
from mdb.errors import MdbError
from mdb.faults import fault_point, register
from mdb.gdid import GDID
from mdb.moves import jobs
from mdb.moves.cancel import finish_cancel
from mdb.moves.journal import CANCEL_STEP, DONE, MOVES_JOB_KINDS, RUNNING, Journal, JournalEntry, new_move_id
from mdb.moves.lease import fenced_servers, hold, refuse_if_busy
from mdb.moves.move import DEFAULT_MAX_PAUSE, check_max_pause
from mdb.moves.params import JobParams
from mdb.moves.plan import PlannedMove
from mdb.moves.reshard import (
    DEFAULT_BATCH_PAUSE, BatchSizer, JobRun, ReshardCounts, ReshardProgress, Workers, continue_reshard, move_all, settle_item,
)
from mdb.moves.sql_steps import area_tables, check_schemas

__all__ = ["JobOutcome", "MoveJobParams", "continue_job", "drive", "remaining", "start_job"]

FAULT_POINTS = register("job.after_journal_start")
"""A rebalance's or drain's job journaled, nothing queued yet."""


class MoveJobParams(JobParams):
    """A rebalance's or drain's own keys of its journal row's ``params``.

    Version 1 is the first (rows of jobs journaled before the version was written read the same).
    """

    KIND: ClassVar[str] = "job"
    VERSION: ClassVar[int] = 1

    moves: list[tuple[GDID, str, str]]
    """The planned moves, ``[gdid, source, target]``, in the order planned."""
    servers: list[str]
    max_pause: float = DEFAULT_MAX_PAUSE
    batch_pause: float = DEFAULT_BATCH_PAUSE
    per_server: int = jobs.DEFAULT_PER_SERVER


@dataclass
class JobOutcome:
    """What a rebalance's or drain's job moved over all its runs (from the journal, like a reshard's counts)."""

    job_id: str | None
    kind: str
    moved: int
    rows_moved: int = 0
    planned: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "kind": self.kind, "moved": self.moved, "rows_moved": self.rows_moved, "planned": self.planned}


def start_job(
    store: Cluster, kind: str, area: str, moves: Sequence[PlannedMove], *, max_pause: float = DEFAULT_MAX_PAUSE,
    batch_pause: float = DEFAULT_BATCH_PAUSE, per_server: int = jobs.DEFAULT_PER_SERVER, progress: ReshardProgress | None = None,
) -> JobOutcome:
    """Journal ``moves`` of ``area`` as a job of ``kind`` and drive it to the end here (see the module docstring).

    Refused while the area has an unfinished move, reshard or job (as a reshard is): resume or
    let it finish first. SQL servers' schemas are compared before anything moves.
    """
    if kind not in MOVES_JOB_KINDS:
        raise MdbError(f"unknown job kind {kind!r} (expected one of {', '.join(MOVES_JOB_KINDS)})")
    check_max_pause(max_pause)
    if per_server < 1:
        raise MdbError(f"--per-server must be at least 1, got {per_server!r}")
    if not 0 <= batch_pause <= max_pause:
        raise MdbError(f"batch pause must be between 0 and the max pause ({max_pause}s), got {batch_pause!r}")
    if not moves:
        return JobOutcome(None, kind, 0)
    journal = Journal(store)
    refuse_if_busy(journal, area)
    servers = sorted({m.source for m in moves} | {m.target for m in moves})
    sql = servers_where(store.map, lambda b: b.checks_drift, servers)  # the servers whose tables a move compares
    if sql:
        check_schemas(store, area, sql, area_tables(store, area), f"{kind} of area {area!r}")
    job_id = new_move_id(kind)
    with hold(journal, job_id) as lease:  # the lease before the row: no worker can adopt the job from this command
        journal.start(JournalEntry(
            move_id=job_id, kind=kind, area=area, step="moves", status=RUNNING,
            params=MoveJobParams(moves=[(m.gdid, m.source, m.target) for m in moves], servers=servers, max_pause=max_pause,
                                 batch_pause=batch_pause, per_server=per_server).to_params(),
            briefcases_total=len(moves),
        ))
        fault_point("job.after_journal_start")
        entry = journal.get(job_id)
        assert entry is not None
        fenced = lease.fenced(store, fenced_servers(store, journal, entry))
        return continue_job(fenced, Journal(fenced), entry, progress=progress)


def remaining(store: Cluster, entry: JournalEntry) -> list[PlannedMove]:
    """The job's planned moves whose briefcase routing still sends to its source (the map and relocations read now)."""
    out = []
    for gdid, source, target in MoveJobParams.of(entry.move_id, entry.params).moves:
        if store.router.locate(entry.area, gdid).server == source:
            out.append(PlannedMove(gdid, source, target, {}))
    return out


def continue_job(store: Cluster, journal: Journal, entry: JournalEntry, *, progress: ReshardProgress | None = None,
                 stopping: threading.Event | None = None) -> JobOutcome:
    """Run (or resume) a rebalance's or drain's job under its lease (held by the caller): settle, re-plan, one pass, done.

    ``stopping``: the process's own stop flag (an ``mdb worker`` driving the job).
    """
    params = MoveJobParams.of(entry.move_id, entry.params)
    workers = Workers(store, None, stopping)
    # What earlier holders' workers left is settled first: the counts and the plan below include what it finishes.
    jobs.settle(workers.journal, entry.move_id, lambda item: settle_item(store, item))
    store.refresh()
    counts = ReshardCounts.from_journal(journal, entry.move_id)
    left = remaining(store, entry)
    counts.pending = {m.gdid: m for m in left}
    own_stop = threading.Event()
    run = JobRun(store, journal, entry, None, 1, params.max_pause, progress, counts, BatchSizer(params.batch_pause), None, own_stop)
    workers.stopping = own_stop
    run.workers = workers
    run.pass_no = jobs.last_pass(workers.journal, entry.move_id)
    journal.update(entry.move_id, **counts.journal_values())
    if progress is not None:
        progress.phase("moves")
        progress.counts(counts, None)
    if left:
        move_all(run, left)
    journal.finish(entry.move_id, DONE, **counts.journal_values())
    jobs.forget(journal, entry.move_id)
    store.refresh()
    return JobOutcome(entry.move_id, entry.kind, counts.briefcases_done, counts.rows_done, len(params.moves))


def drive(store: Cluster, journal: Journal, entry: JournalEntry, *, progress: ReshardProgress | None = None,
          stopping: threading.Event | None = None) -> str:
    """Drive any job whose lease the caller holds from its journaled step to the end; what it did, in words.

    A job at step ``cancel`` finishes its cancel (the operator asked for it); a reshard continues
    (:func:`mdb.moves.reshard.continue_reshard`); a rebalance or a drain runs its remaining moves.
    """
    if entry.step == CANCEL_STEP:
        return f"cancel completed: {finish_cancel(store, journal, entry).detail}"
    if entry.kind == "reshard":
        continue_reshard(store, journal, entry, progress=progress, stopping=stopping)
        return "reshard completed"
    done = continue_job(store, journal, entry, progress=progress, stopping=stopping)
    return f"{entry.kind} completed: {done.moved} of {done.planned} planned briefcase(s) moved over all its runs"
