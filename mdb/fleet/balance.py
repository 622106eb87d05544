"""``mdb balance``: how evenly an area's briefcases, rows and bytes are spread over its servers.

Every server of the area's layout plus every relocation target is scanned through its
backend (:meth:`mdb.backends.base.AreaScan.sizes`, streamed, bounded memory), SQL and MongoDB
alike. Per server: briefcases, rows (documents on MongoDB), bytes (the rows' own sizes or the
documents' BSON sizes: what moves carry) and disk bytes (PostgreSQL relation sizes incl.
indexes and TOAST; SQLite pages of the area's tables from ``dbstat``; MongoDB ``$collStats``
storage and index sizes, unknown on the in-process fake). Disk bytes are shown, not balanced
on: they keep dead rows until VACUUM (compaction), so a move does not lower them at once. Skew
of a server = (its value - mean) / mean; the area's skew is the largest absolute one.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Literal

from mdb.cluster import Cluster
from mdb.fleet.scan import AreaData, BriefcaseSize, area_data, scan_of

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


def measure_server(store: Cluster, server: str, data: AreaData, top: int) -> ServerBalance:
    """One server's totals, its ``top`` largest briefcases (a bounded heap) and its disk bytes."""
    scan = scan_of(store, server, data)
    out = ServerBalance(server)
    heap: list[tuple[int, int, bytes, BriefcaseSize]] = []
    for b in scan.sizes():
        out.briefcases += 1
        out.rows += b.rows
        out.bytes += b.bytes
        item = (b.bytes, b.rows, bytes(b.gdid), b)
        if len(heap) < top:
            heapq.heappush(heap, item)
        elif top:
            heapq.heappushpop(heap, item)
    out.disk_bytes = scan.storage_bytes()
    out.largest = [item[3] for item in sorted(heap, reverse=True)]
    return out


def balance(store: Cluster, area: str, *, top: int = 5) -> AreaBalance:
    """Measure every server of ``area`` (fresh map and relocations first), whatever its kind."""
    store.refresh()
    data = area_data(store, area)
    return AreaBalance(area, [measure_server(store, s, data, top) for s in area_servers(store, area)], top)
