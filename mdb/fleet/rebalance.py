"""``mdb rebalance``: a plan of single-briefcase moves that evens an area's bytes, rows or briefcases.

Planning reads each server once through its backend (:meth:`mdb.backends.base.AreaScan.sizes`,
streamed; SQL and MongoDB servers alike) and keeps
its totals and, as move candidates, its :data:`CANDIDATES` largest briefcases by the chosen
measure (a bounded heap: memory does not grow with the shard). Then, greedily, up to
``max_moves`` times: from the most loaded server to the least loaded one, move the candidate
whose size is closest to what would bring one of them to the mean, among those smaller than
the gap between them (each such move lowers the spread; none left: the plan ends). Moves land
as ordinary relocations. Applying journals the plan as a job in CENTRAL (kind ``rebalance``,
:mod:`mdb.moves.movejob`): its moves are queued as work items per (source, target) pair and
moved in batched cutovers by this process and any ``mdb worker``, through the reshard's item
code; an interrupted rebalance is finished by ``mdb moves resume`` or a worker.

A plan must pay for itself: when all its moves together lower the area's largest skew by less
than ``min_improvement`` (default :data:`MIN_IMPROVEMENT`, 5 percentage points) it is dropped
and the plan says why (100 moves that take 233.6% to 229.3% are churn, not balance). A move
whose target is not in the shard list of the briefcase's partition is marked
(``cross_partition``): the briefcase then lives as a relocation on another partition's server.

Not built: a reshard proposal (a new shard list for a partition) when single moves cannot
even it out; the plan then says how far it got.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from mdb.cluster import Cluster
from mdb.fleet.balance import Measure, area_servers, skew_of
from mdb.fleet.scan import BriefcaseSize, area_data, scan_of
from mdb.gdid import GDID
from mdb.moves import jobs
from mdb.moves import plan as move_plan
from mdb.moves.move import DEFAULT_MAX_PAUSE
from mdb.moves.movejob import JobOutcome, start_job
from mdb.moves.reshard import DEFAULT_BATCH_PAUSE, ReshardProgress

__all__ = ["MIN_IMPROVEMENT", "PlannedMove", "RebalancePlan", "apply_plan", "plan_rebalance"]

CANDIDATES = 1000
"""Largest briefcases of each server kept as move candidates while planning."""

MIN_IMPROVEMENT = 0.05
"""Default: a plan must lower the largest skew by at least 5 percentage points, or it is dropped."""


@dataclass(frozen=True)
class PlannedMove:
    gdid: GDID
    source: str
    target: str
    size: int
    """The briefcase's value of the plan's measure (bytes, rows or 1)."""
    cross_partition: bool = False
    """The target is not a shard of the briefcase's partition (it lands there as a relocation)."""

    def to_json(self) -> dict[str, Any]:
        return {"gdid": str(self.gdid), "source": self.source, "target": self.target, "size": self.size,
                "cross_partition": self.cross_partition}


@dataclass
class RebalancePlan:
    area: str
    by: Measure
    before: dict[str, int]
    after: dict[str, int]
    moves: list[PlannedMove] = field(default_factory=list)
    dropped: str | None = None
    """Why the plan found moves but keeps none (under the minimum improvement); None otherwise."""

    @property
    def cross_partition(self) -> list[PlannedMove]:
        return [m for m in self.moves if m.cross_partition]

    def max_skew(self, loads: dict[str, int]) -> float:
        return max((abs(v) for v in skew_of(dict(loads)).values()), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area, "by": self.by, "before": self.before, "after": self.after,
            "skew_before": self.max_skew(self.before), "skew_after": self.max_skew(self.after),
            "moves": [m.to_json() for m in self.moves], "dropped": self.dropped,
            "cross_partition": len(self.cross_partition),
        }


def _value(b: BriefcaseSize, by: Measure) -> int:
    return b.bytes if by == "bytes" else b.rows if by == "rows" else 1


def _survey(store: Cluster, area: str, by: Measure) -> tuple[dict[str, int], dict[str, list[tuple[int, GDID]]]]:
    """server -> total, and server -> its CANDIDATES largest (size, gdid) briefcases routed to it."""
    data = area_data(store, area)
    totals: dict[str, int] = {}
    candidates: dict[str, list[tuple[int, GDID]]] = {}
    for server in area_servers(store, area):
        total = 0
        heap: list[tuple[int, bytes, GDID]] = []
        for b in scan_of(store, server, data).sizes():
            if store.router.locate(area, b.gdid).server != server:
                continue  # a leftover or a move in flight (mdb fsck): not this server's load
            size = _value(b, by)
            total += size
            item = (size, bytes(b.gdid), b.gdid)
            if len(heap) < CANDIDATES:
                heapq.heappush(heap, item)
            else:
                heapq.heappushpop(heap, item)
        totals[server] = total
        candidates[server] = [(size, gdid) for size, _, gdid in heap]
    return totals, candidates


def _best(candidates: list[tuple[int, GDID]], gap: int, ideal: float) -> int | None:
    """Index of the candidate smaller than ``gap`` whose size is closest to ``ideal`` (None: no such one)."""
    fitting = [(abs(size - ideal), i) for i, (size, _) in enumerate(candidates) if 0 < size < gap]
    return min(fitting)[1] if fitting else None


def plan_rebalance(
    store: Cluster, area: str, *, by: Measure = "bytes", max_moves: int = 100, min_improvement: float = MIN_IMPROVEMENT,
) -> RebalancePlan:
    """Greedy single-briefcase moves from the most to the least loaded server (see the module doc);
    none when they would lower the largest skew by less than ``min_improvement`` (a fraction)."""
    store.refresh()
    before, candidates = _survey(store, area, by)
    loads = dict(before)
    plan = RebalancePlan(area, by, before, loads)
    if len(loads) < 2:
        return plan
    mean = sum(loads.values()) / len(loads)
    while len(plan.moves) < max_moves:
        hi = max(loads, key=lambda s: loads[s])
        lo = min(loads, key=lambda s: loads[s])
        pick = _best(candidates[hi], loads[hi] - loads[lo], min(loads[hi] - mean, mean - loads[lo]))
        if pick is None:
            break
        size, gdid = candidates[hi].pop(pick)
        candidates[lo].append((size, gdid))
        loads[hi] -= size
        loads[lo] += size
        plan.moves.append(PlannedMove(gdid, hi, lo, size))
    plan.moves = _mark_partitions(store, area, _collapse(plan.moves))
    gain = plan.max_skew(before) - plan.max_skew(loads)
    if plan.moves and gain < min_improvement:
        plan.dropped = (f"{len(plan.moves)} move(s) would lower the largest skew by {gain * 100:.1f} percentage points only "
                        f"({plan.max_skew(before):.1%} -> {plan.max_skew(loads):.1%}), under the minimum improvement "
                        f"of {min_improvement * 100:.1f} (--min-improvement): nothing planned")
        plan.moves = []
        plan.after = dict(before)
    return plan


def _mark_partitions(store: Cluster, area: str, moves: list[PlannedMove]) -> list[PlannedMove]:
    """Mark each move whose target is not in the shard list of its briefcase's partition."""
    shards = {start: set(servers) for start, _, servers in store.router.partitions(area)}
    return [PlannedMove(m.gdid, m.source, m.target, m.size,
                        m.target not in shards[store.router.default_placement(area, m.gdid).partition_start])
            for m in moves]


def _collapse(moves: list[PlannedMove]) -> list[PlannedMove]:
    """One move per briefcase: a briefcase planned twice goes straight to its last target (none if back home)."""
    first: dict[GDID, PlannedMove] = {}
    last: dict[GDID, PlannedMove] = {}
    for m in moves:
        first.setdefault(m.gdid, m)
        last[m.gdid] = m
    return [PlannedMove(g, m.source, last[g].target, m.size) for g, m in first.items() if m.source != last[g].target]


def apply_plan(
    store: Cluster, plan: RebalancePlan, *, max_pause: float = DEFAULT_MAX_PAUSE, batch_pause: float = DEFAULT_BATCH_PAUSE,
    per_server: int = jobs.DEFAULT_PER_SERVER, progress: ReshardProgress | None = None,
) -> JobOutcome:
    """Run the plan's moves as a ``rebalance`` job (:mod:`mdb.moves.movejob`); an error propagates, the job stays resumable.

    Document briefcases move one at a time through the same job (:func:`~mdb.moves.move.move_briefcase` picks the kind).
    """
    moves = [move_plan.PlannedMove(m.gdid, m.source, m.target, {}) for m in plan.moves]
    return start_job(store, "rebalance", plan.area, moves, max_pause=max_pause, batch_pause=batch_pause, per_server=per_server,
                     progress=progress)
