"""The end of every SQL cutover, written once: finalize, discard, and resume by the fence.

Every SQL cutover is a batch (:class:`mdb.moves.batch.BatchMove`, journal kind ``batch-move``):
of a reshard or job, or of one briefcase (``mdb move``). Rows of kind ``move``, single moves
journaled by an mdb before a move became a batch of one, leave the same things behind:
``incoming`` copies on the target whose state rows carry the cutover's id, and, past the commit
point, that id's fences on the source. So one set of functions finishes or undoes both,
whatever version of mdb journaled the row (docs/dev/0017):

- :func:`finalize`: relocation entries, then the target's state rows, then the journal ``done``;
- :func:`discard`: the copies deleted and the target's earlier state rows restored;
- :func:`resume`: under the briefcases' locks on the source (a commit in flight when the mover
  died has landed or is gone for good), all fences of this id there -> finalize; none ->
  discard (docs/design.md invariant 3). The journal step is never what decides.

A row's briefcases are :attr:`JournalEntry.briefcases` (a batch's ``params['gdids']``, a move's
``gdid``); the target's earlier states are ``params['previous_target_states']`` (a batch's, by
briefcase) or ``params['previous_target_state']`` (a move's, one or none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from sqlalchemy import delete, func, insert, update

from mdb.cluster import Cluster
from mdb.errors import MdbError
from mdb.faults import fault_point, register
from mdb.moves.copy import AreaTable, count_batch, delete_batch
from mdb.moves.journal import DONE, ROLLED_BACK, Journal, JournalEntry
from mdb.moves.move import DEFAULT_LOCK_WAIT, DEFAULT_MAX_PAUSE, ResumeOutcome, move_briefcase, register_resolver
from mdb.moves.sql_steps import area_tables, locked_briefcases, states
from mdb.relocations import set_relocations
from mdb.system_tables import STATE_GONE, STATE_INCOMING, STATE_RESIDENT, briefcase_state

__all__ = ["FAULT_POINTS", "EarlierMoveRows", "discard", "finalize", "resume"]

FAULT_POINTS = register(
    "batch.after_relocations",
    "batch.after_target_states",
    "batch.resume.after_discard",
)
"""Crash points of the shared end (named after the batch engine, whose they were first): passed
by a single move and a batch alike, forward or by resume."""


def _previous_states(entry: JournalEntry) -> dict[str, dict[str, Any]]:
    """The target's state rows this cutover replaced, by briefcase (its params, either row shape)."""
    if "previous_target_states" in entry.params:
        out: dict[str, dict[str, Any]] = entry.params["previous_target_states"]
        return out
    one = entry.params.get("previous_target_state")
    return {} if one is None or entry.gdid is None else {str(entry.gdid): one}


def discard(cluster: Cluster, entry: JournalEntry, tables: Sequence[AreaTable]) -> int:
    """Delete the cutover's copies on the target and restore the state rows they replaced; idempotent.

    Only briefcases whose target state is this cutover's ``incoming`` row are touched: the copy
    and those rows commit together, so anything else was never copied by it. Returns the rows deleted.
    """
    assert entry.target is not None
    gdids = entry.briefcases
    previous = _previous_states(entry)
    with cluster.transaction(entry.target) as conn:
        mine = [g for g, s in states(conn, entry.area, gdids).items()
                if s["state"] == STATE_INCOMING and s["move_id"] == entry.move_id]
        if not mine:
            return 0
        deleted = sum(delete_batch(conn, tables, mine).values())
        conn.execute(delete(briefcase_state).where(briefcase_state.c.area == entry.area, briefcase_state.c.gdid.in_(mine)))
        restore = [{"state": p["state"], "peer": p["peer"], "move_id": p["move_id"], "area": entry.area, "gdid": g}
                   for g in mine if (p := previous.get(str(g))) is not None]
        if restore:
            conn.execute(insert(briefcase_state), restore)
        return deleted


def finalize(cluster: Cluster, journal: Journal, entry: JournalEntry, rows: dict[str, int] | None = None, *,
             phases: bool = False) -> None:
    """After the commit point: relocations, then the target states, then ``done`` with the rows moved. Idempotent.

    ``rows`` (per table) are the verified counts; resume has none and counts what the
    briefcases hold on the target then (writers may have added rows since the commit point:
    the journal says so in its detail). ``phases``: journal the ``relocation`` and
    ``target_state`` steps (a single move's history shows them; a batch saves the two writes).
    """
    assert entry.target is not None
    area, target = entry.area, entry.target
    gdids = entry.briefcases
    router = cluster.router
    homes = {g: router.default_placement(area, g).server for g in gdids}
    if phases:
        journal.step(entry.move_id, "relocation")
    set_relocations(cluster, area, {g: None if target == home else target for g, home in homes.items()})
    fault_point("batch.after_relocations")
    if phases:
        journal.step(entry.move_id, "target_state")
    with cluster.transaction(target) as conn:
        mine = (briefcase_state.c.area == area) & (briefcase_state.c.move_id == entry.move_id) \
            & (briefcase_state.c.state == STATE_INCOMING) & briefcase_state.c.gdid.in_(gdids)
        at_home = [g for g, home in homes.items() if home == target]
        if at_home:
            conn.execute(delete(briefcase_state).where(mine, briefcase_state.c.gdid.in_(at_home)))
        conn.execute(update(briefcase_state).where(mine).values(state=STATE_RESIDENT, peer=entry.source, changed_at=func.current_timestamp()))
    fault_point("batch.after_target_states")
    detail = None
    if rows is None:
        with cluster.transaction(target) as conn:
            counted = count_batch(conn, area_tables(cluster, area), gdids)
        rows = {name: n for name, n in counted.items() if n}
        detail = "finished by resume: rows counted on the target then"
    journal.finish(entry.move_id, DONE, detail, briefcases_done=len(gdids), rows_done=sum(rows.values()),
                   tables={name: [n, n] for name, n in rows.items()})


def resume(cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome:
    """Finish (all of this cutover's fences on the source) or roll back (none) one unfinished SQL cutover.

    Under its briefcases' locks on the source, so a commit still in flight when the mover died
    has landed or is gone for good. Some but not all fences cannot come from one commit point
    (it is one transaction): refused with what to do, nothing touched. ``retry``: a single move
    of its own (no reshard's, one briefcase) that was rolled back is then taken again.
    """
    assert entry.source is not None and entry.target is not None
    gdids = entry.briefcases
    tables = area_tables(cluster, entry.area)
    with locked_briefcases(cluster, entry.source, entry.area, gdids, lock_wait=DEFAULT_LOCK_WAIT, max_pause=DEFAULT_MAX_PAUSE) as (src, _):
        fenced = [g for g, s in states(src, entry.area, gdids).items()
                  if s["state"] == STATE_GONE and s["move_id"] == entry.move_id]
        src.rollback()
    many = len(gdids) > 1
    if fenced and len(fenced) != len(gdids):
        raise MdbError(
            f"{entry.kind} {entry.move_id}: {len(fenced)} of its {len(gdids)} briefcases carry its fence on {entry.source!r} "
            "(its commit point is one transaction, so all or none should): inspect with `mdb where` before resuming"
        )
    if fenced:
        finalize(cluster, journal, entry, phases=len(gdids) == 1 and "gdids" not in entry.params)
        on = f"; {len(gdids)} briefcase(s) on {entry.target!r}" if many else ""
        return ResumeOutcome(entry.move_id, entry.kind, "finalized", f"commit point had passed (step {entry.step!r}){on}")
    deleted = discard(cluster, entry, tables)
    fault_point("batch.resume.after_discard")
    of = f" of {len(gdids)} briefcase(s)" if many else ""
    journal.finish(entry.move_id, ROLLED_BACK, f"interrupted at step {entry.step!r}; discarded {deleted} copied row(s){of} on {entry.target!r}")
    if retry and entry.reshard_id is None and not many:
        assert entry.gdid is not None
        cluster.refresh()
        again = move_briefcase(cluster, entry.area, entry.gdid, entry.target,
                               max_pause=float(entry.params.get("max_pause", DEFAULT_MAX_PAUSE)), refresh=False)
        return ResumeOutcome(entry.move_id, entry.kind, "retried", f"rolled back, then moved again as {again.move_id}")
    return ResumeOutcome(entry.move_id, entry.kind, "rolled back",
                         f"interrupted at step {entry.step!r}; source {entry.source!r} is authoritative" + (f" for {len(gdids)} briefcase(s)" if many else ""))


@register_resolver
class EarlierMoveRows:
    """Journal rows of kind ``move``: single SQL moves journaled by an mdb before a move became a
    batch of one (docs/dev/0017). Same end as every SQL cutover, so they resume here."""

    journal_kind: ClassVar[str] = "move"

    @classmethod
    def resume(cls, cluster: Cluster, journal: Journal, entry: JournalEntry, *, retry: bool = False) -> ResumeOutcome:
        return resume(cluster, journal, entry, retry=retry)
