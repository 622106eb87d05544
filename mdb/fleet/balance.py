"""``mdb balance``: how evenly an area's briefcases, rows and bytes are spread over its servers.

Every server of the area's layout plus every relocation target is scanned with
:func:`mdb.fleet.scan.briefcase_sizes` (streamed, bounded memory). Per server: briefcases,
rows, bytes (the rows' own sizes, what moves carry) and disk bytes (PostgreSQL relation sizes
incl. indexes and TOAST; SQLite pages of the area's tables from ``dbstat``). Disk bytes are
shown, not balanced on: they keep dead rows until VACUUM, so a move does not lower them at
once. Skew of a server = (its value - mean) / mean; the area's skew is the largest absolute one.
MongoDB servers are listed as not measured.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.engine import Connection

from mdb.cluster import Cluster
from mdb.fleet.scan import BriefcaseSize, briefcase_sizes
from mdb.moves.copy import AreaTable, is_postgres
from mdb.moves.move import area_tables
from mdb.urls import MONGO

__all__ = ["MEASURES", "AreaBalance", "Measure", "ServerBalance", "area_servers", "balance", "skew_of"]

Measure = Literal["bytes", "rows", "briefcases"]
MEASURES: tuple[Measure, ...] = ("bytes", "rows", "briefcases")


@dataclass
class ServerBalance:
    server: str
    measured: bool = True
    briefcases: int = 0
    rows: int = 0
    bytes: int = 0
    disk_bytes: int | None = None
    largest: list[BriefcaseSize] = field(default_factory=list)

    def value(self, measure: Measure) -> int:
        return int(getattr(self, measure))


@dataclass
class AreaBalance:
    area: str
    servers: list[ServerBalance]
    top: int

    def measured(self) -> list[ServerBalance]:
        return [s for s in self.servers if s.measured]

    def skew(self, measure: Measure) -> dict[str, float]:
        """server -> (value - mean) / mean over the measured servers (0 when the mean is 0)."""
        return skew_of({s.server: s.value(measure) for s in self.measured()})

    def largest(self) -> list[tuple[str, BriefcaseSize]]:
        """The ``top`` largest briefcases of the area by bytes, with their server."""
        every = [(s.server, b) for s in self.measured() for b in s.largest]
        return heapq.nlargest(self.top, every, key=lambda item: (item[1].bytes, item[1].rows))

    def to_json(self) -> dict[str, Any]:
        return {
            "area": self.area,
            "servers": [
                {"server": s.server, "measured": s.measured, "briefcases": s.briefcases, "rows": s.rows, "bytes": s.bytes,
                 "disk_bytes": s.disk_bytes,
                 "skew": {m: self.skew(m).get(s.server) for m in MEASURES} if s.measured else None}
                for s in self.servers
            ],
            "max_skew": {m: max((abs(v) for v in self.skew(m).values()), default=0.0) for m in MEASURES},
            "largest": [{"server": srv, "gdid": str(b.gdid), "rows": b.rows, "bytes": b.bytes} for srv, b in self.largest()],
        }


def skew_of(values: dict[str, int | float]) -> dict[str, float]:
    """key -> (value - mean) / mean; all 0 when the mean is 0 (nothing to be uneven about)."""
    if not values:
        return {}
    mean = sum(values.values()) / len(values)
    return {k: (v - mean) / mean if mean else 0.0 for k, v in values.items()}


def area_servers(store: Cluster, area: str) -> list[str]:
    """The area's servers in map order, then relocation targets outside the layout (they hold briefcases too)."""
    out = list(dict.fromkeys(store.router.area_servers(area)))
    for (a, _), server in sorted(store.router.relocations.items(), key=lambda item: item[1]):
        if a == area and server not in out:
            out.append(server)
    return out


def disk_bytes(conn: Connection, tables: Sequence[AreaTable]) -> int | None:
    """On-disk size of the area's tables on this server (None where the server cannot say)."""
    names = [at.name for at in tables]
    if is_postgres(conn):
        query = text("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                     "WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace AND c.relname = ANY(:names)")
        return int(conn.execute(query, {"names": names}).scalar_one())
    if conn.dialect.name == "sqlite":
        if conn.execute(text("SELECT count(*) FROM pragma_module_list WHERE name = 'dbstat'")).scalar_one() == 0:
            return None  # a SQLite built without the dbstat table: disk size unknown
        marks = ", ".join(f":n{i}" for i in range(len(names)))
        query = text(f"SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name IN "
                     f"(SELECT name FROM sqlite_master WHERE tbl_name IN ({marks}))")  # tables and their indexes
        return int(conn.execute(query.bindparams(**{f"n{i}": n for i, n in enumerate(names)})).scalar_one())
    return None


def measure_server(store: Cluster, server: str, tables: Sequence[AreaTable], top: int) -> ServerBalance:
    """One server's totals, its ``top`` largest briefcases (a bounded heap) and its disk bytes."""
    if store.map.kind_of(server) == MONGO:  # document servers: no SQL tables to scan
        return ServerBalance(server, measured=False)
    out = ServerBalance(server)
    heap: list[tuple[int, int, bytes, BriefcaseSize]] = []
    with store.transaction(server) as conn:
        for b in briefcase_sizes(conn, tables):
            out.briefcases += 1
            out.rows += b.rows
            out.bytes += b.bytes
            item = (b.bytes, b.rows, bytes(b.gdid), b)
            if len(heap) < top:
                heapq.heappush(heap, item)
            elif top:
                heapq.heappushpop(heap, item)
        out.disk_bytes = disk_bytes(conn, tables)
    out.largest = [item[3] for item in sorted(heap, reverse=True)]
    return out


def balance(store: Cluster, area: str, *, top: int = 5) -> AreaBalance:
    """Measure every server of ``area`` (fresh map and relocations first)."""
    store.refresh()
    servers = area_servers(store, area)
    if all(store.map.kind_of(s) == MONGO for s in servers):  # document areas: no SQL tables to scan
        return AreaBalance(area, [ServerBalance(s, measured=False) for s in servers], top)
    tables = area_tables(store, area)
    return AreaBalance(area, [measure_server(store, s, tables, top) for s in servers], top)
