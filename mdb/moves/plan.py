"""Planning a reshard: which briefcases of a partition change shard, and how many rows each carries.

The plan is exact: briefcases are enumerated where they live (the partition's shards, its
relocation targets and the new shards) and their rows or documents counted per table or
collection, never estimated from statistics. What a server of each kind holds is read by a
:class:`PartitionScan` of that kind (:func:`scan_for`): :class:`SqlPartitionScan` here (root
tables, GROUP BY counts), the document one beside :class:`~mdb.moves.document_move.DocumentMove`
(keys streamed from each type's root collection). The reshard itself is one driver for every
kind (:mod:`mdb.moves.reshard`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sqlalchemy import func, inspect as sa_inspect, select

from mdb.cluster import Cluster
from mdb.errors import MdbError, RoutingError
from mdb.gdid import GDID
from mdb.moves.sql_steps import area_tables, check_schemas
from mdb.system_tables import STATE_INCOMING, briefcase_state
from mdb.urls import SQL

__all__ = [
    "PartitionScan", "PlannedMove", "ReshardPlan", "ServerHoldings", "SqlPartitionScan", "find_partition", "plan_reshard",
    "register_scan", "scan_for",
]


@dataclass
class ServerHoldings:
    """What one server holds of a partition: its authoritative briefcases and their rows per table/collection."""

    briefcases: list[GDID] = field(default_factory=list)
    rows: dict[GDID, dict[str, int]] = field(default_factory=dict)


class PartitionScan(ABC):
    """The per-kind part of a reshard: reading what a server of the kind holds of an area.

    Made once per reshard run (:func:`scan_for`), for the area; every server it is asked about
    is of its kind (a partition's shards are of one kind, as a move's source and target are).
    """

    server_kind: ClassVar[str]

    def __init__(self, cluster: Cluster, area: str) -> None:
        self.cluster = cluster
        self.area = area

    @property
    @abstractmethod
    def units(self) -> list[str]:
        """The tables or collections a briefcase of the area has rows in (the plan's columns)."""

    @abstractmethod
    def holdings(self, server: str, in_partition: Callable[[GDID], bool]) -> ServerHoldings:
        """The briefcases ``server`` holds authoritatively (no incoming copy) that ``in_partition`` accepts."""

    @abstractmethod
    def check_servers(self, servers: Iterable[str], what: str) -> None:
        """Refuse (before anything moves) servers that are unreachable or cannot take the area's briefcases."""


_SCANS: dict[str, type[PartitionScan]] = {}


def register_scan(cls: type[PartitionScan]) -> type[PartitionScan]:
    """Class decorator: ``cls`` reads partitions on servers of ``cls.server_kind``."""
    if cls.server_kind in _SCANS:
        raise MdbError(f"two partition scans for {cls.server_kind!r}: {_SCANS[cls.server_kind].__name__} and {cls.__name__}")
    _SCANS[cls.server_kind] = cls
    return cls


def scan_for(cluster: Cluster, area: str, server: str) -> PartitionScan:
    """The scan of ``area`` for the kind of ``server`` (one of the partition's shards)."""
    kind = cluster.map.kind_of(server)
    try:
        cls = _SCANS[kind]
    except KeyError:
        raise RoutingError(f"partitions on {kind} servers cannot be resharded (no partition scan for the kind)") from None
    return cls(cluster, area)


@register_scan
class SqlPartitionScan(PartitionScan):
    """SQL servers: briefcases from the area's root tables, rows counted per table with GROUP BY."""

    server_kind: ClassVar[str] = SQL

    def __init__(self, cluster: Cluster, area: str) -> None:
        super().__init__(cluster, area)
        self.tables = area_tables(cluster, area)  # no type of the area: RoutingError first

    @property
    def units(self) -> list[str]:
        return [at.name for at in self.tables]

    def holdings(self, server: str, in_partition: Callable[[GDID], bool]) -> ServerHoldings:
        roots = [at for at in self.tables if at.pk == [at.key]]
        with self.cluster.transaction(server) as conn:
            present = set(sa_inspect(conn).get_table_names())
            incoming = {
                g for g, in conn.execute(
                    select(briefcase_state.c.gdid).where(briefcase_state.c.area == self.area, briefcase_state.c.state == STATE_INCOMING)
                )
            }
            found = [
                g for at in roots if at.name in present
                for (g,) in conn.execute(select(at.table.c[at.key]))
                if in_partition(g) and g not in incoming
            ]
            counts: dict[GDID, dict[str, int]] = defaultdict(dict)
            for at in self.tables:
                if at.name not in present:
                    continue
                for g, n in conn.execute(select(at.table.c[at.key], func.count()).group_by(at.table.c[at.key])):
                    counts[g][at.name] = int(n)
        return ServerHoldings(found, dict(counts))

    def check_servers(self, servers: Iterable[str], what: str) -> None:
        check_schemas(self.cluster, self.area, servers, self.tables, what)


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


def plan_reshard(store: Cluster, scan: PartitionScan, area: str, start: GDID, new_shards: list[str]) -> ReshardPlan:
    """Enumerate the partition's briefcases where they live now and pick those whose shard changes."""
    router = store.router
    pstart, pend, old_shards = find_partition(router, area, start)
    plan = ReshardPlan(area, pstart, pend, old_shards, list(new_shards))

    def in_partition(gdid: GDID) -> bool:
        return router.default_placement(area, gdid).partition_start == pstart

    relocated_to = {srv for (a, g), srv in router.relocations.items() if a == area and in_partition(g)}
    servers = list(dict.fromkeys([*old_shards, *sorted(relocated_to), *new_shards]))
    seen: dict[GDID, str] = {}
    for server in servers:
        held = scan.holdings(server, in_partition)
        for g in held.briefcases:
            if g in seen:
                raise RoutingError(f"briefcase {area}/{g} has rows on both {seen[g]!r} and {server!r}: run `mdb where` and `mdb moves resume` first")
            seen[g] = server
            target = new_shards[g.sharding_value % len(new_shards)]
            if target != server:
                rows = held.rows.get(g, {})
                plan.moves.append(PlannedMove(g, server, target, {name: rows.get(name, 0) for name in scan.units}))
    plan.briefcases_in_partition = len(seen)
    plan.moves.sort(key=lambda m: (m.source, m.gdid))
    return plan
