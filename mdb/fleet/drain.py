"""``mdb drain``: empty a server of every area's briefcases before it is decommissioned.

What MongoDB's ``removeShard`` and Citus's ``citus_drain_node`` do, for a server that no
partition uses any more (a spare, one a reshard took out of the layout, a relocation target):

- :func:`check_drain` answers, per area, whether the server still holds data (briefcases,
  rows; those routed to it as relocations, and those routed elsewhere: stray copies).
- :func:`drain` moves every briefcase routed to it (a relocation) home, to the server its
  partition's layout sends it to, as a job per area in CENTRAL (kind ``drain``,
  :mod:`mdb.moves.movejob`): work items per (source, target) pair moved in batched cutovers
  (journal, lock, copy, verify, fence, relocations cleared) by this process and any ``mdb
  worker``; an interrupted drain is finished by ``mdb moves resume`` or a worker, and a drain
  run again carries on with what is left.
- A server still in a partition's shard list (or a CENTRAL shard) is refused, with the reason:
  the layout keeps routing new and existing briefcases to it, so no drain could leave it
  empty. Reshard it out of the shard list first (``mdb reshard``), then drain.
- Stray data (a briefcase routed elsewhere with rows here) is never moved: it is not the
  briefcase's copy of record. Drain reports it; ``mdb fsck`` tells a leftover from a misplaced
  copy and removes what is provably safe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mdb.cluster import Cluster
from mdb.errors import MdbError, RoutingError
from mdb.fleet.inflight import in_flight
from mdb.fleet.scan import area_data, holds_area, scan_of
from mdb.gdid import GDID
from mdb.moves import jobs
from mdb.moves.move import DEFAULT_MAX_PAUSE
from mdb.moves.movejob import JobOutcome, start_job
from mdb.moves.plan import PlannedMove
from mdb.moves.reshard import DEFAULT_BATCH_PAUSE, ReshardProgress

__all__ = ["AreaHoldings", "DrainCheck", "DrainMove", "check_drain", "drain", "drain_refusal"]


@dataclass
class AreaHoldings:
    """What one area has on the server: briefcases routed to it and stray ones (routed elsewhere)."""

    area: str
    routed: list[GDID] = field(default_factory=list)
    """Briefcases routed to the server (relocations: what drain moves home)."""
    stray: list[GDID] = field(default_factory=list)
    """Briefcases with data here that are routed elsewhere (fsck's findings)."""
    rows: int = 0
    checked: bool = True
    """False when the area has no registered type (its data cannot be read)."""

    @property
    def holds_data(self) -> bool:
        return bool(self.routed or self.stray)

    def to_json(self) -> dict[str, Any]:
        return {"area": self.area, "checked": self.checked, "holds_data": self.holds_data, "briefcases": len(self.routed),
                "stray": len(self.stray), "rows": self.rows}


@dataclass
class DrainCheck:
    server: str
    roles: list[str]
    """Why the layout still uses the server (a shard of a partition, a CENTRAL shard); empty: drainable."""
    areas: list[AreaHoldings]

    @property
    def holds_data(self) -> bool:
        return any(a.holds_data for a in self.areas)

    def to_json(self) -> dict[str, Any]:
        return {"server": self.server, "roles": self.roles, "holds_data": self.holds_data,
                "areas": [a.to_json() for a in self.areas]}


@dataclass(frozen=True)
class DrainMove:
    area: str
    gdid: GDID
    target: str


def _roles(store: Cluster, server: str) -> list[str]:
    router = store.router
    roles = [f"CENTRAL shard {i}" for i, s in enumerate(router.central_servers()) if s == server]
    for area in router.area_names():
        for start, _, shards in router.partitions(area):
            roles += [f"shard {i} of area {area!r} partition {start}" for i, s in enumerate(shards) if s == server]
    return roles


def drain_refusal(store: Cluster, server: str) -> str | None:
    """Why ``server`` cannot be drained (still in a layout), or None."""
    roles = _roles(store, server)
    if not roles:
        return None
    return (f"server {server!r} is still {'; '.join(roles)}: the layout keeps routing briefcases to it, so a drain "
            "cannot empty it; reshard it out of the shard list first (`mdb reshard MAP AREA --partition START --shards ...`)")


def check_drain(store: Cluster, server: str) -> DrainCheck:
    """Per area of the map, what ``server`` still holds (fresh map and relocations first). Streams each area's keys."""
    if server not in store.map.servers:
        raise RoutingError(f"unknown server {server!r} (the map names {', '.join(store.map.servers)})")
    store.refresh()
    out = DrainCheck(server, _roles(store, server), [])
    for area in store.router.area_names():
        try:
            data = area_data(store, area)
        except RoutingError:  # no type of the area registered: its tables are unknown, say so
            out.areas.append(AreaHoldings(area, checked=False))
            continue
        if not holds_area(store, server, data):
            continue
        held = AreaHoldings(area)
        for b in scan_of(store, server, data).sizes():
            held.rows += b.rows
            (held.routed if store.router.locate(area, b.gdid).server == server else held.stray).append(b.gdid)
        out.areas.append(held)
    return out


def drain(
    store: Cluster, server: str, *, max_pause: float = DEFAULT_MAX_PAUSE, batch_pause: float = DEFAULT_BATCH_PAUSE,
    per_server: int = jobs.DEFAULT_PER_SERVER, on_plan: Callable[[list[DrainMove]], None] | None = None,
    progress: Callable[[str], ReshardProgress | None] | None = None,
) -> tuple[DrainCheck, list[JobOutcome]]:
    """Move every briefcase routed to ``server`` home, as one ``drain`` job per area; the check after and the jobs.

    Refused (:class:`~mdb.errors.MdbError`) for a server still in a layout, and while a running
    or interrupted move or job names a briefcase on it or its area (``mdb moves resume`` first).
    Stops at the first job that fails (it propagates, the job stays resumable); the areas
    before it are drained, and running drain again carries on. ``progress``: area -> its job's display.
    """
    refusal = drain_refusal(store, server)
    if refusal is not None:
        raise MdbError(refusal)
    before = check_drain(store, server)
    plan: list[DrainMove] = []
    for held in before.areas:
        busy = sorted(in_flight(store, held.area).briefcases & set(held.routed + held.stray))
        if busy:
            raise MdbError(f"server {server!r}: {len(busy)} briefcase(s) of area {held.area!r} on it are named by an "
                           f"unfinished move (e.g. {busy[0]}): run `mdb moves resume MAP` first")
        plan += [DrainMove(held.area, g, store.router.default_placement(held.area, g).server) for g in held.routed]
    if on_plan is not None:
        on_plan(plan)
    outcomes: list[JobOutcome] = []
    for area in dict.fromkeys(m.area for m in plan):
        moves = [PlannedMove(m.gdid, server, m.target, {}) for m in plan if m.area == area]
        outcomes.append(start_job(store, "drain", area, moves, max_pause=max_pause, batch_pause=batch_pause,
                                  per_server=per_server, progress=None if progress is None else progress(area)))
    return check_drain(store, server), outcomes
