"""GDID and key routing: pure functions of a partition map (and a relocation directory).

The router never does I/O. It answers "which shard, which server" for a GDID in an area
(range set -> partition -> ``v mod shard count``, docs/design.md "Routing") and for a CENTRAL key
(FNV-1a-64 of the key bytes). Lookups bisect precomputed start lists, so an area with tens of
thousands of partitions routes in O(log n). The same router serves the application, the
schema tool and the move tools: there is no second copy of these rules.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from mdb.errors import RoutingError
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap

__all__ = ["CentralPlacement", "Placement", "Router", "ShardLayout", "fnv1a_64"]

FNV_OFFSET_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK64 = 2**64 - 1


def fnv1a_64(data: bytes) -> int:
    """FNV-1a, 64-bit: the CENTRAL sharding hash fixed by docs/design.md."""
    h = FNV_OFFSET_BASIS
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & _MASK64
    return h


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one shard owns in one area: stamped on the shard and checked by every session."""

    area: str
    partition_start: GDID
    partition_end: GDID | None  # exclusive; None = open-ended
    shard_index: int
    shard_count: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a briefcase lives and why."""

    area: str
    gdid: GDID
    range_set: GDID
    partition_start: GDID
    partition_end: GDID | None
    shard_index: int
    shard_count: int
    server: str
    default_server: str
    relocated: bool

    @property
    def layout(self) -> ShardLayout:
        """The layout the default shard must carry for this routing to be valid."""
        return ShardLayout(self.area, self.partition_start, self.partition_end, self.shard_index, self.shard_count)


@dataclass(frozen=True, slots=True)
class CentralPlacement:
    area: str
    key: bytes
    hash: int
    shard_index: int
    shard_count: int
    server: str


@dataclass(frozen=True, slots=True)
class _Partition:
    start: GDID  # absolute
    end: GDID | None  # absolute, exclusive; None = open-ended
    shards: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _RangeSet:
    breakpoint: GDID
    starts: tuple[int, ...]  # absolute sharding values, strictly increasing
    partitions: tuple[_Partition, ...]


class Router:
    """Immutable routing table built from one map version and one relocation snapshot."""

    __slots__ = ("_map", "_areas", "_central", "_relocations")

    def __init__(self, pmap: PartitionMap, relocations: Mapping[tuple[str, GDID], str] | None = None) -> None:
        self._map = pmap
        self._relocations: Mapping[tuple[str, GDID], str] = dict(relocations or {})
        self._areas: dict[str, tuple[tuple[int, ...], tuple[_RangeSet, ...]]] = {}
        self._central: tuple[str, ...] = ()
        for name, area in pmap.areas.items():
            if area.kind == "central":
                self._central = tuple(area.shards or ())
                continue
            sets = []
            specs = area.effective_range_sets()
            for r, rs in enumerate(specs):
                base = rs.breakpoint.sharding_value
                starts = [base + p.start.sharding_value for p in rs.partitions]
                set_end = specs[r + 1].breakpoint.sharding_value if r + 1 < len(specs) else None
                ends = [*starts[1:], set_end]
                parts = tuple(
                    _Partition(
                        GDID.from_sharding_value(start),
                        None if end is None else GDID.from_sharding_value(end),
                        p.shards,
                    )
                    for p, start, end in zip(rs.partitions, starts, ends)
                )
                sets.append(_RangeSet(rs.breakpoint, tuple(starts), parts))
            self._areas[name] = (tuple(s.breakpoint.sharding_value for s in sets), tuple(sets))

    @property
    def map(self) -> PartitionMap:
        return self._map

    @property
    def version(self) -> int:
        return self._map.version

    @property
    def relocations(self) -> Mapping[tuple[str, GDID], str]:
        return self._relocations

    def with_relocations(self, relocations: Mapping[tuple[str, GDID], str]) -> Router:
        return Router(self._map, relocations)

    def area_names(self) -> list[str]:
        """Partitioned areas (CENTRAL excluded), in map order."""
        return list(self._areas)

    def _area(self, area: str) -> tuple[tuple[int, ...], tuple[_RangeSet, ...]]:
        try:
            return self._areas[area]
        except KeyError:
            if area == self._map.central_area:
                raise RoutingError(f"area {area!r} is the CENTRAL area: route its keys by key (`mdb central-shard MAP KEY`, Router.locate_central)") from None
            known = ", ".join(self._areas) or "none"
            raise RoutingError(f"unknown area {area!r} (map version {self.version} in {self._map.source} has: {known})") from None

    def default_placement(self, area: str, gdid: GDID) -> Placement:
        """Where the map puts ``gdid``, ignoring relocations."""
        if gdid.is_zero:
            raise RoutingError(f"cannot route GDID {gdid} in area {area!r}: the zero GDID means 'none'")
        breakpoints, sets = self._area(area)
        v = gdid.sharding_value
        r = bisect.bisect_right(breakpoints, v) - 1
        if r < 0:
            raise RoutingError(f"GDID {gdid} is below the first range set of area {area!r} (breakpoint {sets[0].breakpoint})")
        rs = sets[r]
        p = bisect.bisect_right(rs.starts, v) - 1
        if p < 0:
            raise RoutingError(f"GDID {gdid} is below the first partition start {rs.partitions[0].start} of area {area!r}")
        part = rs.partitions[p]
        index = v % len(part.shards)
        server = part.shards[index]
        return Placement(area, gdid, rs.breakpoint, part.start, part.end, index, len(part.shards), server, server, False)

    def locate(self, area: str, gdid: GDID) -> Placement:
        """Where ``gdid`` lives: the default shard, or its relocation where one exists."""
        placement = self.default_placement(area, gdid)
        moved_to = self._relocations.get((area, gdid))
        if moved_to is None or moved_to == placement.server:
            return placement
        return Placement(
            area, gdid, placement.range_set, placement.partition_start, placement.partition_end,
            placement.shard_index, placement.shard_count, moved_to, placement.server, True,
        )

    def locate_central(self, key: str | bytes | GDID) -> CentralPlacement:
        """CENTRAL shard of a key. A ``str`` is UTF-8 encoded as given: normalize it first."""
        if isinstance(key, GDID):
            data = bytes(key)
        elif isinstance(key, str):
            data = key.encode("utf-8")
        elif isinstance(key, (bytes, bytearray, memoryview)):
            data = bytes(key)
        else:
            raise RoutingError(f"a CENTRAL key must be str, bytes or GDID, got {type(key).__name__}")
        h = fnv1a_64(data)
        index = h % len(self._central)
        return CentralPlacement(self._map.central_area, data, h, index, len(self._central), self._central[index])

    def central_servers(self) -> tuple[str, ...]:
        return self._central

    def area_servers(self, area: str) -> list[str]:
        """Every server of the area's map layout, in map order (relocation targets not included)."""
        _, sets = self._area(area)
        return [s for rs in sets for p in rs.partitions for s in p.shards]

    def partitions(self, area: str) -> Iterator[tuple[GDID, GDID | None, tuple[str, ...]]]:
        """(absolute start, exclusive end or None, shard list) of every partition, in order."""
        _, sets = self._area(area)
        for rs in sets:
            for part in rs.partitions:
                yield part.start, part.end, part.shards

    def layouts(self) -> Iterator[tuple[str, ShardLayout]]:
        """(server, layout) for every shard of every area, CENTRAL included: what to stamp."""
        for index, server in enumerate(self._central):
            yield server, ShardLayout(self._map.central_area, GDID.ZERO, None, index, len(self._central))
        for area in self._areas:
            for start, end, shards in self.partitions(area):
                for index, server in enumerate(shards):
                    yield server, ShardLayout(area, start, end, index, len(shards))
