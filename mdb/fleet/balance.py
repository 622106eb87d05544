"""``mdb balance``: how evenly an area's briefcases, rows and bytes are spread over its servers.

Every server of the area's layout plus every relocation target, and every other server of the
map that has the area's tables (a spare, one a reshard took out of the layout) is scanned through its
backend (:meth:`mdb.backends.base.AreaScan.sizes`, streamed, bounded memory), SQL and MongoDB
alike. Per server: briefcases, rows (documents on MongoDB), bytes (the rows' own sizes or the
documents' BSON sizes: what moves carry) and disk bytes (PostgreSQL relation sizes incl.
indexes and TOAST; SQLite pages of the area's tables from ``dbstat``; MongoDB ``$collStats``
storage and index sizes, unknown on the in-process fake). Disk bytes are shown, not balanced
on: they keep dead rows until VACUUM (compaction), so a move does not lower them at once. Skew
of a server = (its value - mean) / mean; the area's skew is the largest absolute one, over the
layout and the relocation targets (a spare is shown, not counted in the mean).

A server's briefcases, rows and bytes are those of the briefcases routed to it; data of a
briefcase routed elsewhere (a leftover copy, a duplicate, a move in flight: ``mdb fsck``) is
counted apart as *stray*, so a duplicated briefcase is counted once, where it is routed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Literal

from mdb.cluster import Cluster
from mdb.fleet.scan import AreaData, BriefcaseSize, area_data, area_servers, scan_of

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
    spare: bool = False
    """In neither the area's layout nor its relocation targets: shown, not part of the skew."""
    stray_briefcases: int = 0
    """Briefcases with data here that are routed elsewhere (fsck's findings): not in the figures above."""
    stray_rows: int = 0
    stray_bytes: int = 0
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
        return [s for s in self.servers if s.measured and not s.spare]

    @property
    def briefcases(self) -> int:
        """The area's briefcases, each counted once (on the server it is routed to)."""
        return sum(s.briefcases for s in self.servers if s.measured)

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
                {"server": s.server, "measured": s.measured, "spare": s.spare, "briefcases": s.briefcases, "rows": s.rows,
                 "bytes": s.bytes, "disk_bytes": s.disk_bytes,
                 "stray": {"briefcases": s.stray_briefcases, "rows": s.stray_rows, "bytes": s.stray_bytes},
                 "skew": {m: self.skew(m).get(s.server) for m in MEASURES} if s.measured and not s.spare else None}
                for s in self.servers
            ],
            "briefcases": self.briefcases,
            "max_skew": {m: max((abs(v) for v in self.skew(m).values()), default=0.0) for m in MEASURES},
            "largest": [{"server": srv, "gdid": str(b.gdid), "rows": b.rows, "bytes": b.bytes} for srv, b in self.largest()],
        }


def skew_of(values: dict[str, int | float]) -> dict[str, float]:
    """key -> (value - mean) / mean; all 0 when the mean is 0 (nothing to be uneven about)."""
    if not values:
        return {}
    mean = sum(values.values()) / len(values)
    return {k: (v - mean) / mean if mean else 0.0 for k, v in values.items()}


def measure_server(store: Cluster, area: str, server: str, data: AreaData, top: int, *, spare: bool = False) -> ServerBalance:
    """One server's totals (briefcases routed to it; the others as stray), its ``top`` largest
    briefcases (a bounded heap) and its disk bytes."""
    scan = scan_of(store, server, data)
    out = ServerBalance(server, spare=spare)
    heap: list[tuple[int, int, bytes, BriefcaseSize]] = []
    for b in scan.sizes():
        if store.router.locate(area, b.gdid).server != server:
            out.stray_briefcases += 1
            out.stray_rows += b.rows
            out.stray_bytes += b.bytes
            continue
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
    """Measure every server of ``area`` and every spare holding its tables (fresh map and relocations first), whatever its kind."""
    store.refresh()
    data = area_data(store, area)
    placed = set(area_servers(store, area))
    return AreaBalance(area, [measure_server(store, area, s, data, top, spare=s not in placed)
                              for s in area_servers(store, area, data)], top)
