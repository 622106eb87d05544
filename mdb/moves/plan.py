"""Planning a reshard: which briefcases of a partition change shard, and how many rows each carries.

The plan is exact: briefcases are enumerated where they live (the partition's shards, its
relocation targets and the new shards) and the rows or documents of those that move counted
per table or collection, never estimated from statistics. Only movers are counted: a reshard
plans again after every online sweep and once inside the freeze, where almost nothing moves,
and counting every row of the partition there would hold the partition's writes for nothing.
What a server of each kind holds is read by a :class:`PartitionScan` of that kind
(:func:`scan_for`): :class:`SqlPartitionScan` here (root table keys; per-key GROUP BY counts
of the movers), the document one beside :class:`~mdb.moves.document_move.DocumentMove` (keys
streamed from each type's root collection, movers' documents counted per collection). The
reshard itself is one driver for every kind (:mod:`mdb.moves.reshard`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from psycopg import sql
from sqlalchemy import LargeBinary, func, inspect as sa_inspect, literal_column, select, type_coerce, union_all
from sqlalchemy.engine import Connection

from mdb.cluster import Cluster
from mdb.errors import MdbError, RoutingError
from mdb.gdid import GDID
from mdb.router import shard_in
from mdb.moves.copy import AreaTable, is_postgres
from mdb.moves.sql_steps import area_tables, check_schemas
from mdb.system_tables import STATE_INCOMING, briefcase_state
from mdb.urls import SQL

__all__ = [
    "COUNT_BLOCK", "PartitionScan", "PlannedMove", "ReshardPlan", "ServerScan", "SqlPartitionScan", "plan_reshard",
    "register_scan", "scan_for",
]


COUNT_BLOCK = 2_000
"""Movers of one server whose rows :func:`plan_reshard` counts with one request (bounds its memory)."""

KEY_FETCH = 2_000
"""Keys a SQL server sends per fetch of the plan's server-side cursor."""


class ServerScan(ABC):
    """What one server holds of a partition, read as a plan needs it: every key, then the movers' rows.

    Most briefcases of a partition do not move (a reshard plans again after every online sweep
    and once inside the freeze, finding almost nothing), so the keys come without their rows
    and only the briefcases that move are counted. Both reads go through one transaction where
    the kind has them (one snapshot, one connection: a SQLite file would not even begin a
    second transaction beside the one streaming its keys).
    """

    def __init__(self, server: str) -> None:
        self.server = server

    @abstractmethod
    def keys(self, in_partition: Callable[[GDID], bool]) -> Iterator[GDID]:
        """The briefcases the server holds authoritatively (no incoming copy) that ``in_partition`` accepts.

        In GDID byte order (the plan merges the servers' streams), without holding them all:
        a partition of a million briefcases is planned in bounded memory.
        """

    @abstractmethod
    def rows(self, gdids: Sequence[GDID]) -> list[dict[str, int]]:
        """Rows (documents) per table (collection) of each of ``gdids`` here, in the order of ``gdids``.

        A unit without rows here may be left out. Asked for at most :data:`COUNT_BLOCK`
        briefcases at a time, possibly while :meth:`keys` is being read.
        """


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
    def reading(self, server: str) -> AbstractContextManager[ServerScan]:
        """``server``'s side of a plan, open for the plan's length."""

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
    """SQL servers: briefcases from the area's root tables; the movers' rows counted per table and key with GROUP BY."""

    server_kind: ClassVar[str] = SQL

    def __init__(self, cluster: Cluster, area: str) -> None:
        super().__init__(cluster, area)
        self.tables = area_tables(cluster, area)  # no type of the area: RoutingError first

    @property
    def units(self) -> list[str]:
        return [at.name for at in self.tables]

    def check_servers(self, servers: Iterable[str], what: str) -> None:
        check_schemas(self.cluster, self.area, servers, self.tables, what)

    @contextmanager
    def reading(self, server: str) -> Iterator[ServerScan]:
        with self.cluster.transaction(server) as conn:
            present = set(sa_inspect(conn).get_table_names())
            yield _SqlServerScan(server, conn, self.area, [at for at in self.tables if at.name in present])


class _SqlServerScan(ServerScan):
    """A SQL server's side of a plan: keys and the movers' counts through one transaction."""

    def __init__(self, server: str, conn: Connection, area: str, tables: list[AreaTable]) -> None:
        super().__init__(server)
        self.conn = conn
        self.area = area
        self.tables = tables  # those the server has

    def keys(self, in_partition: Callable[[GDID], bool]) -> Iterator[GDID]:
        """One statement: the root tables' keys less the incoming ones, in key order, read in blocks.

        No table is aggregated here: the plan counts rows only for the briefcases that move.
        """
        roots = [at for at in self.tables if at.pk == [at.key]]
        if not roots:
            return
        keys = union_all(*(select(at.table.c[at.key].label("k")) for at in roots)).subquery("keys")
        incoming = select(briefcase_state.c.gdid).where(briefcase_state.c.area == self.area, briefcase_state.c.state == STATE_INCOMING)
        query = select(keys.c.k).where(keys.c.k.not_in(incoming)).order_by(keys.c.k)
        for (g,) in self.conn.execution_options(stream_results=True, yield_per=KEY_FETCH).execute(query):
            if in_partition(g):
                yield g

    def rows(self, gdids: Sequence[GDID]) -> list[dict[str, int]]:
        """One statement: per table, the rows of ``gdids`` grouped by key (through the key's index), UNION ALL."""
        out: list[dict[str, int]] = [{} for _ in gdids]
        if not self.tables or not gdids:
            return out
        position = {bytes(g): i for i, g in enumerate(gdids)}
        for t, key, n in self._counts(gdids):
            out[position[bytes(key)]][self.tables[t].name] = int(n)
        return out

    def _counts(self, gdids: Sequence[GDID]) -> list[tuple[int, bytes, int]]:
        """(table index, briefcase key as bytes, rows) for every table and briefcase of ``gdids`` with rows here.

        PostgreSQL gets the keys as one array parameter, dumped binary (``%b``): psycopg's text
        form of a bytea array costs more than the counting (0.76 s against 0.02 s for 66,667
        keys), so the statement is sent on the driver's cursor, in the plan's transaction.
        """
        if not is_postgres(self.conn):
            selects: list[Any] = [
                select(literal_column(str(i)), type_coerce(at.table.c[at.key], LargeBinary), func.count())
                .where(at.table.c[at.key].in_(list(gdids))).group_by(at.table.c[at.key])
                for i, at in enumerate(self.tables)
            ]
            return [(int(i), k, n) for i, k, n in self.conn.execute(union_all(*selects))]
        query = sql.SQL(" UNION ALL ").join(
            sql.SQL("SELECT {i}, {key}, count(*) FROM {table} WHERE {key} = ANY(%(keys)b) GROUP BY {key}").format(
                i=sql.Literal(i), key=sql.Identifier(at.key), table=sql.Identifier(at.name))
            for i, at in enumerate(self.tables)
        )
        raw: Any = self.conn.connection.driver_connection
        with raw.cursor(binary=True) as cur:
            cur.execute(query, {"keys": [bytes(g) for g in gdids]}, prepare=False)
            return cur.fetchall()


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


def plan_reshard(store: Cluster, scan: PartitionScan, area: str, start: GDID, new_shards: list[str], *, keep_moves: bool = True) -> ReshardPlan:
    """Enumerate the partition's briefcases where they live now, pick those whose shard changes, count their rows.

    Every server's keys arrive in key order (:meth:`ServerScan.keys`) and are merged, so a
    briefcase held by two servers is caught as two equal keys in a row, without a set of every
    key seen. A briefcase that moves waits in its server's block until :data:`COUNT_BLOCK` of
    them are there (or the keys end); then one :meth:`ServerScan.rows` request counts the
    block's rows. A plan where nothing moves counts nothing. ``keep_moves=False`` (a dry run)
    keeps the totals only: bounded memory (one block per server).
    """
    router = store.router
    pstart, pend, old = router.partition(area, start)
    plan = ReshardPlan(area, pstart, pend, list(old), list(new_shards))

    in_partition = router.partition_member(area, start)

    low, high = pstart.sharding_value, None if pend is None else pend.sharding_value
    # the directory's summary per target server, not its entries: a plan between two sweeps of a
    # reshard would otherwise hold one entry per briefcase the sweeps moved
    relocated_to = {srv for (a, srv), reach in router.relocation_reach.items() if a == area and reach.overlaps(low, high)}
    servers = list(dict.fromkeys([*old, *sorted(relocated_to), *new_shards]))
    movers: dict[str, list[tuple[GDID, str]]] = {server: [] for server in servers}  # (briefcase, target), awaiting counts

    units = scan.units

    def count(read: ServerScan) -> None:
        block = movers[read.server]
        for (g, target), held in zip(block, read.rows([g for g, _ in block]), strict=True):
            plan.add(PlannedMove(g, read.server, target, {name: held.get(name, 0) for name in units}), keep=keep_moves)
        block.clear()

    def keyed(read: ServerScan) -> Iterator[tuple[bytes, ServerScan, GDID]]:
        for g in read.keys(in_partition):
            yield bytes(g), read, g

    with ExitStack() as stack:
        reads = [stack.enter_context(scan.reading(server)) for server in servers]
        last: tuple[bytes, str] | None = None
        for key, read, g in heapq.merge(*(keyed(read) for read in reads), key=lambda item: item[0]):
            if last is not None and last[0] == key:
                raise RoutingError(f"briefcase {area}/{g} has rows on both {last[1]!r} and {read.server!r}: run `mdb where` and `mdb moves resume` first")
            last = (key, read.server)
            plan.briefcases_in_partition += 1
            target = shard_in(new_shards, g.sharding_value)
            if target != read.server:
                movers[read.server].append((g, target))
                if len(movers[read.server]) >= COUNT_BLOCK:
                    count(read)
        for read in reads:
            if movers[read.server]:
                count(read)
    plan.moves.sort(key=lambda m: (m.source, m.gdid))
    return plan
