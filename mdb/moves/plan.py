"""Planning a reshard: which briefcases of a partition change shard, and how many rows each carries.

The plan is exact: briefcases are enumerated from the root tables of the servers that can
hold the partition's briefcases (its shards and relocation targets), rows are counted per
briefcase and table with GROUP BY queries, never estimated from table statistics.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, inspect as sa_inspect, select

from mdb.cluster import Cluster
from mdb.errors import RoutingError
from mdb.gdid import GDID
from mdb.moves.copy import AreaTable
from mdb.system_tables import STATE_INCOMING, briefcase_state

__all__ = ["PlannedMove", "ReshardPlan", "find_partition", "plan_reshard"]


@dataclass(frozen=True)
class PlannedMove:
    gdid: GDID
    source: str
    target: str
    rows: dict[str, int]

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


@dataclass
class ReshardPlan:
    area: str
    partition_start: GDID
    partition_end: GDID | None
    old_shards: list[str]
    new_shards: list[str]
    moves: list[PlannedMove] = field(default_factory=list)
    briefcases_in_partition: int = 0

    def pairs(self) -> dict[tuple[str, str], tuple[int, int]]:
        out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for m in self.moves:
            out[(m.source, m.target)][0] += 1
            out[(m.source, m.target)][1] += m.total_rows
        return {k: (v[0], v[1]) for k, v in out.items()}

    def rows_per_table(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for m in self.moves:
            for name, n in m.rows.items():
                out[name] += n
        return dict(out)

    @property
    def total_rows(self) -> int:
        return sum(m.total_rows for m in self.moves)

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area, "partition_start": str(self.partition_start),
            "partition_end": None if self.partition_end is None else str(self.partition_end),
            "old_shards": self.old_shards, "new_shards": self.new_shards,
            "briefcases_in_partition": self.briefcases_in_partition, "briefcases_to_move": len(self.moves),
            "rows_to_move": self.total_rows, "rows_per_table": self.rows_per_table(),
            "pairs": [{"source": s, "target": t, "briefcases": n, "rows": r} for (s, t), (n, r) in sorted(self.pairs().items())],
        }


def find_partition(router: Any, area: str, start: GDID) -> tuple[GDID, GDID | None, list[str]]:
    starts = []
    for s, e, shards in router.partitions(area):
        if s == start:
            return s, e, list(shards)
        starts.append(str(s))
    raise RoutingError(f"area {area!r} has no partition starting at {start} (starts: {', '.join(starts)})")


def plan_reshard(store: Cluster, tables: list[AreaTable], area: str, start: GDID, new_shards: list[str]) -> ReshardPlan:
    """Enumerate the partition's briefcases where they live now and pick those whose shard changes."""
    router = store.router
    pstart, pend, old_shards = find_partition(router, area, start)
    plan = ReshardPlan(area, pstart, pend, old_shards, list(new_shards))

    def in_partition(gdid: GDID) -> bool:
        return router.default_placement(area, gdid).partition_start == pstart

    relocated_to = {srv for (a, g), srv in router.relocations.items() if a == area and in_partition(g)}
    servers = list(dict.fromkeys([*old_shards, *sorted(relocated_to), *new_shards]))
    roots = [at for at in tables if at.pk == [at.key]]
    seen: dict[GDID, str] = {}
    for server in servers:
        with store.transaction(server) as conn:
            present = set(sa_inspect(conn).get_table_names())
            incoming = {
                g for g, in conn.execute(
                    select(briefcase_state.c.gdid).where(briefcase_state.c.area == area, briefcase_state.c.state == STATE_INCOMING)
                )
            }
            found = [
                g for at in roots if at.name in present
                for (g,) in conn.execute(select(at.table.c[at.key]))
                if in_partition(g) and g not in incoming
            ]
            counts: dict[GDID, dict[str, int]] = defaultdict(dict)
            for at in tables:
                if at.name not in present:
                    continue
                for g, n in conn.execute(select(at.table.c[at.key], func.count()).group_by(at.table.c[at.key])):
                    counts[g][at.name] = int(n)
        for g in found:
            if g in seen:
                raise RoutingError(f"briefcase {area}/{g} has rows on both {seen[g]!r} and {server!r}: run `mdb where` and `mdb moves resume` first")
            seen[g] = server
            target = new_shards[g.sharding_value % len(new_shards)]
            if target != server:
                plan.moves.append(PlannedMove(g, server, target, {at.name: counts[g].get(at.name, 0) for at in tables}))
    plan.briefcases_in_partition = len(seen)
    plan.moves.sort(key=lambda m: (m.source, m.gdid))
    return plan
