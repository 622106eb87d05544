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
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sqlalchemy import func, inspect as sa_inspect, select, union_all

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

    def stream(self, server: str, in_partition: Callable[[GDID], bool]) -> Iterator[tuple[GDID, dict[str, int]]]:
        """:meth:`holdings` one briefcase at a time, in GDID byte order (what the plan's merge needs).

        A kind that can read its briefcases in key order without holding them overrides this;
        the default holds one server's holdings at a time.
        """
        held = self.holdings(server, in_partition)
        for g in sorted(held.briefcases, key=bytes):
            yield g, held.rows.get(g, {})


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

    def stream(self, server: str, in_partition: Callable[[GDID], bool]) -> Iterator[tuple[GDID, dict[str, int]]]:
        """One statement: the root keys with each table's row count, in key order, read in blocks.

        The server joins the counts; this process holds one block of rows at a time, so a
        partition of a million briefcases is planned in bounded memory.
        """
        with self.cluster.transaction(server) as conn:
            present = set(sa_inspect(conn).get_table_names())
            tables = [at for at in self.tables if at.name in present]
            roots = [at for at in tables if at.pk == [at.key]]
            if not roots:
                return
            keys = union_all(*(select(at.table.c[at.key].label("k")) for at in roots)).subquery("keys")
            incoming = select(briefcase_state.c.gdid).where(briefcase_state.c.area == self.area, briefcase_state.c.state == STATE_INCOMING)
            query = select(keys.c.k).where(keys.c.k.not_in(incoming))
            for i, at in enumerate(tables):
                col = at.table.c[at.key]
                counts = select(col.label("k"), func.count().label("n")).group_by(col).subquery(f"c{i}")
                query = query.outerjoin(counts, counts.c.k == keys.c.k).add_columns(func.coalesce(counts.c.n, 0))
            names = [at.name for at in tables]
            result = conn.execution_options(stream_results=True, yield_per=2_000).execute(query.order_by(keys.c.k))
            for row in result:
                g = row[0]
                if in_partition(g):
                    yield g, {name: int(n) for name, n in zip(names, row[1:], strict=True)}


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
    """Which briefcases of a partition change shard: totals always, the moves themselves when kept.

    A dry run keeps only the totals (a partition of a million briefcases is planned in bounded
    memory); a reshard keeps the moves it is about to make.
    """

    area: str
    partition_start: GDID
    partition_end: GDID | None
    old_shards: list[str]
    new_shards: list[str]
    moves: list[PlannedMove] = field(default_factory=list)
    briefcases_in_partition: int = 0
    briefcases_to_move: int = 0
    _pairs: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    _rows: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, move: PlannedMove, *, keep: bool = True) -> None:
        self.briefcases_to_move += 1
        pair = self._pairs[(move.source, move.target)]
        pair[0] += 1
        pair[1] += move.total_rows
        for name, n in move.rows.items():
            self._rows[name] += n
        if keep:
            self.moves.append(move)

    def pairs(self) -> dict[tuple[str, str], tuple[int, int]]:
        return {k: (v[0], v[1]) for k, v in self._pairs.items()}

    def rows_per_table(self) -> dict[str, int]:
        return dict(self._rows)

    @property
    def total_rows(self) -> int:
        return sum(self._rows.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area, "partition_start": str(self.partition_start),
            "partition_end": None if self.partition_end is None else str(self.partition_end),
            "old_shards": self.old_shards, "new_shards": self.new_shards,
            "briefcases_in_partition": self.briefcases_in_partition, "briefcases_to_move": self.briefcases_to_move,
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


def plan_reshard(store: Cluster, scan: PartitionScan, area: str, start: GDID, new_shards: list[str], *, keep_moves: bool = True) -> ReshardPlan:
    """Enumerate the partition's briefcases where they live now and pick those whose shard changes.

    Every server's briefcases arrive in key order (:meth:`PartitionScan.stream`) and are merged,
    so a briefcase held by two servers is caught as two equal keys in a row, without a set of
    every key seen. ``keep_moves=False`` (a dry run) keeps the totals only: bounded memory.
    """
    router = store.router
    pstart, pend, old_shards = find_partition(router, area, start)
    plan = ReshardPlan(area, pstart, pend, old_shards, list(new_shards))

    def in_partition(gdid: GDID) -> bool:
        return router.default_placement(area, gdid).partition_start == pstart

    relocated_to = {srv for (a, g), srv in router.relocations.items() if a == area and in_partition(g)}
    servers = list(dict.fromkeys([*old_shards, *sorted(relocated_to), *new_shards]))
    def keyed(server: str) -> Iterator[tuple[bytes, str, GDID, dict[str, int]]]:
        for g, rows in scan.stream(server, in_partition):
            yield bytes(g), server, g, rows

    streams = [keyed(server) for server in servers]
    last: tuple[bytes, str] | None = None
    for key, server, g, rows in heapq.merge(*streams, key=lambda item: item[0]):
        if last is not None and last[0] == key:
            raise RoutingError(f"briefcase {area}/{g} has rows on both {last[1]!r} and {server!r}: run `mdb where` and `mdb moves resume` first")
        last = (key, server)
        plan.briefcases_in_partition += 1
        target = new_shards[g.sharding_value % len(new_shards)]
        if target != server:
            plan.add(PlannedMove(g, server, target, {name: rows.get(name, 0) for name in scan.units}), keep=keep_moves)
    plan.moves.sort(key=lambda m: (m.source, m.gdid))
    return plan
