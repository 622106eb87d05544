"""Finishing or rolling back every interrupted move, whatever step it died at.

The journal says which moves are unfinished; the source shard says what happened. Under the
briefcase's exclusive lock on the source (so a commit that was still in flight when the mover
died has landed or is gone for good), the fence of this move id on the source means the commit
point passed: the move is finalized forward. No fence means it did not: the target copy and
its ``incoming`` row are discarded, the target's earlier state row restored, and the source
stays authoritative (optionally the move is then tried again). Interrupted reshards are then
continued from their journal row (:mod:`mdb.moves.reshard`).
"""

from __future__ import annotations

from contextlib import ExitStack

from mdb.cluster import Cluster
from mdb.errors import MoveLeaseHeldError, ServerUnavailableError
from mdb.moves.journal import JOB_KINDS, Journal
from mdb.moves.fencing import FencedCluster
from mdb.moves.lease import fenced_servers, hold, lease_owner_id
from mdb.moves.cancel import CANCEL_STEP, finish_cancel
from mdb.moves.move import ResumeOutcome, move_kinds, resolve_move
from mdb.moves.movejob import continue_job
from mdb.moves.reshard import ReshardProgress, continue_reshard

__all__ = ["FAILED", "HELD", "ResumeOutcome", "resolve_move", "resume_all"]

FAILED = "failed"
"""The action of an entry resume could not resolve because a server it needs is unavailable."""
HELD = "held"
"""The action of an entry another live process drives (its lease); resume leaves it alone."""


def resume_all(store: Cluster, *, retry: bool = False, progress: ReshardProgress | None = None) -> list[ResumeOutcome]:
    """Resolve every unfinished move, then continue every unfinished reshard.

    Each entry is taken with its lease first (a reshard's moves under the reshard's): one that
    a live process drives is left to it and reported as ``held`` with that process named, so
    two resumes started at once never act on the same entry. Each lease taken claims its new
    epoch on the servers the entry touches (:mod:`mdb.moves.fencing`) and the journal is read
    again after that: a driver paused past its lease can no longer write, so what is read is
    what there is, and every write of this resume goes through the entry's fenced cluster.
    """
    store.refresh()
    journal = Journal(store)
    outcomes: list[ResumeOutcome] = []
    kinds = move_kinds()  # move, mongo-move: every kind of single move, resolved by its implementation
    stuck: set[str] = set()  # reshards with a move that could not be resolved
    held: set[str] = set()  # entries (reshards or single moves) another live process drives
    fenced: dict[str, FencedCluster] = {}  # lease id -> this resume's writes for the entries under it
    with ExitStack() as leases:
        for entry in journal.entries(unfinished=True):
            if (entry.kind not in kinds and entry.kind not in JOB_KINDS) or lease_owner_id(entry) != entry.move_id:
                continue  # a reshard's move is taken with its reshard; other kinds are not resumed here
            try:
                lease = leases.enter_context(hold(journal, entry.move_id))
            except MoveLeaseHeldError as exc:
                held.add(entry.move_id)
                outcomes.append(ResumeOutcome(entry.move_id, entry.kind, HELD, str(exc)))
                continue
            try:
                fenced[entry.move_id] = lease.fenced(store, fenced_servers(store, journal, entry))
            except ServerUnavailableError as exc:
                outcomes.append(ResumeOutcome(entry.move_id, entry.kind, FAILED, f"{exc}; left as it was, run resume again once it is back"))
        # Read again now that no earlier driver of these entries can write: a paused one may have
        # journaled a step (or a new batch) after the first read, before the claims.
        unfinished = [e for e in journal.entries(unfinished=True) if lease_owner_id(e) in fenced]
        for entry in unfinished:
            if entry.kind in kinds:
                cluster = fenced[lease_owner_id(entry)]
                try:
                    outcomes.append(resolve_move(cluster, Journal(cluster), entry, retry=retry))
                except ServerUnavailableError as exc:
                    # One server down must not hold up the moves that do not need it; this one is
                    # left exactly as it was, and resolved by the next resume.
                    outcomes.append(ResumeOutcome(entry.move_id, entry.kind, FAILED, f"{exc}; left as it was, run resume again once it is back"))
                    if entry.reshard_id is not None:
                        stuck.add(entry.reshard_id)
        store.refresh()
        for entry in unfinished:
            if entry.kind in JOB_KINDS:
                if entry.move_id in stuck:
                    outcomes.append(ResumeOutcome(entry.move_id, entry.kind, FAILED, "one of its moves could not be resolved (above); left as it was"))
                    continue
                cluster = fenced[entry.move_id]
                interrupted_at = entry.step  # continue_reshard moves the entry on as it goes
                try:
                    if entry.step == CANCEL_STEP:  # an interrupted `mdb moves cancel`: finish cancelling
                        done = finish_cancel(cluster, Journal(cluster), entry)
                        outcomes.append(ResumeOutcome(entry.move_id, entry.kind, "cancel completed", done.detail))
                        continue
                    if entry.kind != "reshard":  # a rebalance's or drain's job: its remaining moves (mdb.moves.movejob)
                        job = continue_job(cluster, Journal(cluster), entry)
                        outcomes.append(ResumeOutcome(entry.move_id, entry.kind, f"{entry.kind} completed",
                                                      f"{job.moved} of {job.planned} planned briefcase(s) moved over all its runs"))
                        continue
                    continue_reshard(cluster, Journal(cluster), entry, progress=progress)
                except ServerUnavailableError as exc:
                    outcomes.append(ResumeOutcome(entry.move_id, entry.kind, FAILED, f"{exc}; was at step {interrupted_at!r}, run resume again once it is back"))
                    continue
                backup = entry.params.get("map_backup")  # continue_reshard updates the params it was given
                kept = "" if backup is None else f"; the map file's previous version is at {backup}"
                outcomes.append(ResumeOutcome(entry.move_id, "reshard", "reshard completed", f"was at step {interrupted_at!r}{kept}"))
    return outcomes
