"""Cancelling a move or a reshard (issue 11 item 12): the old map stays in force.

A reshard changes the map only at its ``map_apply`` step, so until then cancelling it is
possible and means: its moves that are not past their commit point are rolled back exactly as
``mdb moves resume`` rolls them back (:func:`mdb.moves.move.resolve_move`; one past it is
finalized forward, it already happened), the partition is unfrozen, and its finished moves are
either moved back (``move_back``: a reverse move of each through the same
:func:`mdb.moves.move.move_briefcase`, journaled under the reshard with ``reverse_of``) or
left where they are as ordinary relocations, which old-map processes follow. From
``map_apply`` on the new map may already be in force; such a reshard can only be finished.

A driver that is still running is asked to stop (:func:`mdb.moves.lease.request_stop`): it
stops before its next move and lets its lease go, and the cancel takes the lease over. The
reshard's journal row records step ``cancel`` and the choice before anything is undone, so a
cancel that is itself interrupted is finished by ``mdb moves resume`` (or another cancel).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Final

from mdb.cluster import Cluster
from mdb.errors import CancelError, MoveLeaseHeldError
from mdb.gdid import GDID
from mdb.moves.freeze import unfreeze_partition
from mdb.moves.journal import CANCEL_STEP, CANCELLED, DONE, FINISHED, MOVES_JOB_KINDS, RUNNING, Journal, JournalEntry
from mdb.moves.lease import Lease, fenced_servers, hold, me, request_stop
from mdb.moves.move import DEFAULT_MAX_PAUSE, move_briefcase, move_kinds, resolve_move
from mdb.moves import jobs
from mdb.moves.plan import PlannedMove
from mdb.moves.reshard import DEFAULT_BATCH_PAUSE, FIRST_MOVE_BACK, BatchSizer, JobRun, ReshardCounts, Workers, move_all, settle_item

__all__ = ["CANCEL_STEP", "CANCELLABLE_STEPS", "CancelOutcome", "cancel", "finish_cancel"]

log = logging.getLogger("mdb.moves.cancel")

CANCELLABLE_STEPS: Final = frozenset({"plan", "prechecks", "moves", "freeze", "final_moves", CANCEL_STEP})
"""Reshard steps before ``map_apply``: the old map is still the only one applied."""
STOP_POLL: Final = 0.5

FAULT_POINTS = (FIRST_MOVE_BACK,)
"""Registered in :mod:`mdb.moves.reshard`, where the item code that moves briefcases back passes it."""


@dataclass
class CancelOutcome:
    move_id: str
    kind: str
    rolled_back: int = 0
    """Moves that were not past their commit point."""
    finalized: int = 0
    """Moves that were past it (finished forward, then treated like the finished ones)."""
    moved_back: int = 0
    left: int = 0
    """Finished moves left on their new server (``--leave``)."""
    gone: int = 0
    """Briefcases to move back that the application deleted meanwhile: nothing to move."""
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"move_id": self.move_id, "kind": self.kind, "rolled_back": self.rolled_back, "finalized": self.finalized,
                "moved_back": self.moved_back, "left": self.left, "gone": self.gone, "detail": self.detail}


def _refuse(entry: JournalEntry) -> None:
    """A cancel of something that cannot be cancelled says why and what to do instead."""
    if entry.kind in move_kinds() and entry.reshard_id is not None:
        raise CancelError(f"{entry.move_id} is a move of reshard {entry.reshard_id}: cancel the reshard")
    if entry.status in FINISHED:
        what = f" (move it back with `mdb move MAP {entry.area} {entry.gdid} --to {entry.source}`)" if entry.kind in move_kinds() and entry.status == DONE else ""
        raise CancelError(f"{entry.move_id} is already finished ({entry.status}){what}")
    if entry.kind == "reshard" and entry.step not in CANCELLABLE_STEPS:
        raise CancelError(
            f"reshard {entry.move_id} is at step {entry.step!r}, past the point where the new map may be in force: "
            "it can only be finished (`mdb moves resume MAP`)"
        )


def cancel(store: Cluster, move_id: str, *, move_back: bool = True, wait: float = 60.0) -> CancelOutcome:
    """Cancel move or reshard ``move_id``; a running driver is asked to stop and given ``wait`` seconds."""
    store.refresh()
    journal = Journal(store)
    entry = journal.get(move_id)
    if entry is None:
        raise CancelError(f"there is no move or reshard {move_id!r} in the journal (see `mdb moves status MAP`)")
    _refuse(entry)
    with _take_over(journal, move_id, wait) as lease:
        # From here a driver paused past its lease can write nothing (mdb.moves.fencing), so the entry read next is final.
        fenced = lease.fenced(store, fenced_servers(store, journal, entry))
        journal = Journal(fenced)
        entry = journal.get(move_id)  # as the driver left it
        assert entry is not None
        if entry.status in FINISHED:
            return CancelOutcome(move_id, entry.kind, detail=f"it finished ({entry.status}) before it could be cancelled")
        _refuse(entry)
        if entry.kind in move_kinds():  # a single move of any server kind
            return _cancel_move(fenced, journal, entry, move_back)
        return finish_cancel(fenced, journal, entry, move_back=move_back)


class _take_over:
    """Hold ``move_id``'s lease; a live holder is asked to stop and waited for up to ``wait`` seconds."""

    def __init__(self, journal: Journal, move_id: str, wait: float) -> None:
        self._journal, self._move_id, self._wait = journal, move_id, wait
        self._held: Any = None

    def __enter__(self) -> Lease:
        deadline = time.monotonic() + self._wait
        asked = False
        while True:
            held = hold(self._journal, self._move_id)
            try:
                lease = held.__enter__()
            except MoveLeaseHeldError:
                if time.monotonic() >= deadline:
                    raise
                if not asked:
                    asked = request_stop(self._journal, self._move_id, me())
                time.sleep(STOP_POLL)
                continue
            self._held = held
            return lease

    def __exit__(self, *exc: Any) -> None:
        self._held.__exit__(*exc)


def _cancel_move(store: Cluster, journal: Journal, entry: JournalEntry, move_back: bool) -> CancelOutcome:
    """A single interrupted move: rolled back before its commit point, else finished and maybe moved back."""
    out = CancelOutcome(entry.move_id, entry.kind)
    resolved = resolve_move(store, journal, entry)
    if resolved.action != "finalized":
        out.rolled_back = 1
        out.detail = resolved.detail
        return out
    out.finalized = 1
    assert entry.gdid is not None and entry.source is not None
    if move_back:
        back = move_briefcase(store, entry.area, entry.gdid, entry.source, source=entry.target,
                              max_pause=float(entry.params.get("max_pause", DEFAULT_MAX_PAUSE)), reverse_of=entry.move_id)
        out.moved_back = 1
        out.detail = f"it had passed its commit point; moved back to {entry.source!r} by {back.move_id}"
    else:
        out.left = 1
        out.detail = f"it had passed its commit point; left on {entry.target!r}"
    return out


def _is_move_back(move: JournalEntry) -> bool:
    return bool(move.params.get("reverse_of") or move.params.get("move_back"))


def _move_back(store: Cluster, journal: Journal, entry: JournalEntry, pending: list[tuple[JournalEntry, GDID]],
               max_pause: float) -> None:
    """Move ``pending`` (forward move, briefcase) back to their sources as a pass of the reshard's job (issue 32).

    The same path as the reshard's own moves (:func:`mdb.moves.reshard.move_all`): work items per
    (source, target) pair moved in batched cutovers here and by any ``mdb worker``, where the
    servers' kind has one, else one at a time here. The job is at step ``cancel``, which makes
    every move of it a move back (journaled as such: :func:`_is_move_back`). A briefcase the
    application deleted since it moved is not moved (the caller counts it from the journal).
    """
    workers = Workers(store)
    run = JobRun(store, journal, entry, None, 1, max_pause, None, ReshardCounts(), BatchSizer(DEFAULT_BATCH_PAUSE))
    run.counts.pending = {g: PlannedMove(g, move.target or "", move.source or "", {}) for move, g in pending}
    run.workers = workers
    run.pass_no = jobs.last_pass(workers.journal, entry.move_id)
    move_all(run, list(run.counts.pending.values()))


def _resolve_left(store: Cluster, journal: Journal, entry: JournalEntry, out: CancelOutcome) -> None:
    """What the job's drivers and workers left: live workers stop after their batch in hand, interrupted moves are
    finished (commit point passed) or rolled back, each counted in ``out``."""
    interrupted = {m.move_id for m in journal.moves_of(entry.move_id) if m.status == RUNNING}
    jobs.settle(journal, entry.move_id, lambda item: settle_item(store, item))
    for move in journal.moves_of(entry.move_id):  # interrupted moves first, as resume resolves them
        if move.status == RUNNING:
            if resolve_move(store, journal, move).action == "finalized":
                out.finalized += 1
            else:
                out.rolled_back += 1
        elif move.move_id in interrupted:  # resolved by the settle of its work item: counted all the same
            if move.status == DONE:
                out.finalized += 1
            else:
                out.rolled_back += 1


def _stop_job(store: Cluster, journal: Journal, entry: JournalEntry) -> CancelOutcome:
    """Cancel a rebalance's or drain's job (:mod:`mdb.moves.movejob`): it stops; its finished moves stay.

    Neither changes a map, so there is no old state to restore: every finished move is a valid
    placement (a relocation, or one cleared), and the next rebalance or drain plans from it.
    """
    interrupted_at = entry.params.get("cancelled_at_step", entry.step)
    entry.params.update({"cancel": "stop", "cancelled_at_step": interrupted_at})
    journal.step(entry.move_id, CANCEL_STEP, params=entry.params)
    entry.step = CANCEL_STEP
    out = CancelOutcome(entry.move_id, entry.kind)
    _resolve_left(store, journal, entry, out)
    out.left = len({g for m in journal.moves_of(entry.move_id) if m.status == DONE and not _is_move_back(m) for g in m.briefcases})
    return _cancelled(store, journal, entry, out, f"stopped at step {interrupted_at!r}: {out.rolled_back} interrupted move(s) "
                      f"rolled back, {out.left} briefcase(s) moved stay where they are (a {entry.kind} changes no map; run it "
                      "again for the rest)")


def finish_cancel(store: Cluster, journal: Journal, entry: JournalEntry, *, move_back: bool | None = None) -> CancelOutcome:
    """Cancel a job whose lease the caller holds; re-run safely after a crash (resume calls it at step ``cancel``).

    A reshard is undone (see the module docstring); a rebalance or a drain stops (:func:`_stop_job`)."""
    if entry.kind in MOVES_JOB_KINDS:
        return _stop_job(store, journal, entry)
    if move_back is None:
        move_back = entry.params.get("cancel") == "move-back"
    interrupted_at = entry.params.get("cancelled_at_step", entry.step)
    entry.params.update({"cancel": "move-back" if move_back else "leave", "cancelled_at_step": interrupted_at})
    journal.step(entry.move_id, CANCEL_STEP, params=entry.params)
    entry.step = CANCEL_STEP  # what makes the job's moves from here moves back (mdb.moves.reshard.moving_back)
    out = CancelOutcome(entry.move_id, "reshard")
    # Workers' items first (mdb.moves.jobs): live workers stop after their batch in hand, what dead ones left is resolved.
    _resolve_left(store, journal, entry, out)
    start = GDID.parse(entry.params["partition_start"])
    unfreeze_partition(store, entry.area, start, entry.params["old_shards"])
    store.refresh()
    moves = journal.moves_of(entry.move_id)
    # What was moved back already (single moves carry reverse_of, batches move_back), per briefcase.
    undone = {g for m in moves if m.status == DONE and _is_move_back(m) for g in m.briefcases}
    forward = [(m, g) for m in moves if m.status == DONE and not _is_move_back(m) for g in m.briefcases]
    max_pause = float(entry.params.get("max_pause", DEFAULT_MAX_PAUSE))
    out.moved_back += sum(1 for _, g in forward if g in undone)
    pending = [(m, g) for m, g in forward if g not in undone]
    if move_back:
        if pending:
            _move_back(store, journal, entry, pending, max_pause)
            store.refresh()
            back = {g for m in journal.moves_of(entry.move_id) if m.status == DONE and _is_move_back(m) for g in m.briefcases}
            out.moved_back += sum(1 for _, g in pending if g in back)
            out.gone += sum(1 for _, g in pending if g not in back)  # not moved back, no error: the application deleted it
    else:
        out.left += len(pending)
    verb = f"{out.moved_back} moved back" if move_back else f"{out.left} left on their new shards as relocations"
    if out.gone:
        verb += f", {out.gone} deleted by the application meanwhile"
    return _cancelled(store, journal, entry, out, f"cancelled at step {interrupted_at!r}: {out.rolled_back} interrupted move(s) "
                      f"rolled back, {len(forward)} finished ({verb}); the map is unchanged")


def _cancelled(store: Cluster, journal: Journal, entry: JournalEntry, out: CancelOutcome, detail: str) -> CancelOutcome:
    """The job's journal row ends ``cancelled`` with ``detail``; its work items are forgotten."""
    out.detail = detail
    journal.finish(entry.move_id, CANCELLED, detail)
    jobs.forget(journal, entry.move_id)
    store.refresh()
    return out

