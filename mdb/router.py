"""GDID and key routing: pure functions of a partition map (and a relocation directory).

The router never does I/O. It answers "which shard, which server" for a GDID in an area
(range set -> partition -> ``v mod shard count``, docs/design.md "Routing") and for a CENTRAL key
(FNV-1a-64 of the key bytes). Lookups bisect precomputed start lists, so an area with tens of
thousands of partitions routes in O(log n). The same router serves the application, the
schema tool and the move tools: there is no second copy of these rules.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import FrozenInstanceError, dataclass, field
from typing import ClassVar, TypeVar

from mdb.errors import RoutingError
from mdb.fnv import fnv1a_64, fnv1a_64_many
from mdb.gdid import GDID
from mdb.partition_map import PartitionMap

__all__ = ["CentralPlacement", "Placement", "Reach", "Router", "ShardLayout", "fnv1a_64", "fnv1a_64_many", "shard_in"]  # the hash: mdb.fnv


_T = TypeVar("_T")


def shard_in(shards: Sequence[_T], value: int) -> _T:
    """The server of ``shards`` (one partition's ordered list) that owns the GDID of sharding
    value ``value`` (:attr:`GDID.sharding_value`): ``value mod shard count``. The rule every
    layout uses, the map's and a reshard's new one alike. It takes the value, which the router's
    lookup has already computed, rather than the GDID: ``locate`` is on every session's path."""
    return shards[value % len(shards)]


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one shard owns in one area: stamped on the shard and checked by every session."""

    area: str
    partition_start: GDID
    partition_end: GDID | None  # exclusive; None = open-ended
    shard_index: int
    shard_count: int


@dataclass(frozen=True, slots=True)
class Reach:
    """What the relocation directory holds for one (area, target server), without naming the briefcases.

    How many entries send briefcases there, and the lowest and highest sharding value among
    them: enough to know which servers a query over an area (or over part of it) must reach,
    in a few rows per server whatever the number of briefcases moved (docs/design.md invariant 8).
    """

    count: int
    low: int
    high: int

    def merge(self, other: Reach) -> Reach:
        return Reach(self.count + other.count, min(self.low, other.low), max(self.high, other.high))

    def overlaps(self, low: int, high: int | None) -> bool:
        """Whether some entry may lie in sharding values [low, high) (high None: no upper end)."""
        return self.high >= low and (high is None or self.low < high)


def reach_of(relocations: Mapping[tuple[str, GDID], str]) -> dict[tuple[str, str], Reach]:
    """The :class:`Reach` per (area, server) of a whole directory (a router that holds one derives it)."""
    out: dict[tuple[str, str], Reach] = {}
    for (area, gdid), server in relocations.items():
        v = gdid.sharding_value
        seen = out.get((area, server))
        out[(area, server)] = Reach(1, v, v) if seen is None else seen.merge(Reach(1, v, v))
    return out


@dataclass(frozen=True, slots=True)
class _Shard:
    """Everything a placement on one shard of one partition shares, computed once per router.

    ``locate`` is on the path of every briefcase session and of plans over millions of keys:
    building a 10-field frozen dataclass per call cost more than the routing itself, so a
    :class:`Placement` is the GDID, the server and a reference to this shared record.
    """

    area: str
    range_set: GDID
    partition_start: GDID
    partition_end: GDID | None
    shard_index: int
    shard_count: int
    server: str
    layout: ShardLayout
    stamp: tuple[bytes, bytes | None, int, int] = field(init=False, compare=False, repr=False)
    """The layout as a shard stores its stamp (GDIDs as their 12 bytes): what the ownership check
    compares the shard's row with, without turning the row's bytes into GDIDs per session."""

    def __post_init__(self) -> None:
        end = self.partition_end
        object.__setattr__(self, "stamp", (bytes(self.partition_start), None if end is None else bytes(end),
                                           self.shard_index, self.shard_count))


class _Value:
    """A placement as a value: immutable, and compared, hashed, printed and pickled by its
    ``_fields()`` (named ``_names``), like the frozen dataclasses placements were, while its
    per-shard fields live in a record shared by every placement on that shard."""

    __slots__ = ()
    _names: ClassVar[tuple[str, ...]]

    def _fields(self) -> tuple[object, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, _Value)
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(f"{n}={v!r}" for n, v in zip(self._names, self._fields())) + ")"

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __reduce__(self) -> tuple[object, ...]:
        return (self.__class__, self._fields())


class Placement(_Value):
    """Where a briefcase lives and why: a value (:class:`_Value`) over a shared :class:`_Shard`."""

    __slots__ = ("_at", "gdid", "server", "relocated")
    _names = ("area", "gdid", "range_set", "partition_start", "partition_end", "shard_index", "shard_count",
              "server", "default_server", "relocated")

    _at: _Shard
    gdid: GDID
    server: str
    relocated: bool

    def __init__(self, area: str, gdid: GDID, range_set: GDID, partition_start: GDID, partition_end: GDID | None,
                 shard_index: int, shard_count: int, server: str, default_server: str, relocated: bool) -> None:
        layout = ShardLayout(area, partition_start, partition_end, shard_index, shard_count)
        at = _Shard(area, range_set, partition_start, partition_end, shard_index, shard_count, default_server, layout)
        _build(self, at, gdid, server, relocated)

    @property
    def area(self) -> str:
        return self._at.area

    @property
    def range_set(self) -> GDID:
        return self._at.range_set

    @property
    def partition_start(self) -> GDID:
        return self._at.partition_start

    @property
    def partition_end(self) -> GDID | None:
        return self._at.partition_end

    @property
    def shard_index(self) -> int:
        return self._at.shard_index

    @property
    def shard_count(self) -> int:
        return self._at.shard_count

    @property
    def stamp(self) -> tuple[bytes, bytes | None, int, int]:
        """Partition start, end (12 bytes each, None: open), shard index and count, as a shard's layout row holds them."""
        return self._at.stamp

    @property
    def default_server(self) -> str:
        return self._at.server

    @property
    def layout(self) -> ShardLayout:
        """The layout the default shard must carry for this routing to be valid."""
        return self._at.layout

    def _fields(self) -> tuple[object, ...]:
        at = self._at
        return (at.area, self.gdid, at.range_set, at.partition_start, at.partition_end, at.shard_index,
                at.shard_count, self.server, at.server, self.relocated)


# Writing the slots through their descriptors bypasses the immutability guard in __setattr__
# (only this module builds placements this way). Read from the class __dict__: mypy sees the
# class attributes as the instance types, not as member descriptors.
_new = object.__new__
_set_at: Callable[[Placement, _Shard], None] = Placement.__dict__["_at"].__set__
_set_gdid: Callable[[Placement, GDID], None] = Placement.__dict__["gdid"].__set__
_set_server: Callable[[Placement, str], None] = Placement.__dict__["server"].__set__
_set_relocated: Callable[[Placement, bool], None] = Placement.__dict__["relocated"].__set__


def _build(placement: Placement, at: _Shard, gdid: GDID, server: str, relocated: bool) -> Placement:
    _set_at(placement, at)
    _set_gdid(placement, gdid)
    _set_server(placement, server)
    _set_relocated(placement, relocated)
    return placement


@dataclass(frozen=True, slots=True)
class _CentralShard:
    """What every key placed on one CENTRAL shard shares, computed once per router (as
    :class:`_Shard` for GDIDs): a placement of a new key sets three slots, not six."""

    area: str
    shard_index: int
    shard_count: int
    server: str


class CentralPlacement(_Value):
    """The CENTRAL shard of a key and why (its bytes and their FNV-1a-64): a value
    (:class:`_Value`) over a shared :class:`_CentralShard`."""

    __slots__ = ("_at", "key", "hash")
    _names = ("area", "key", "hash", "shard_index", "shard_count", "server")

    _at: _CentralShard
    key: bytes
    hash: int

    def __init__(self, area: str, key: bytes, hash: int, shard_index: int, shard_count: int, server: str) -> None:
        _build_central(self, _CentralShard(area, shard_index, shard_count, server), key, hash)

    @property
    def area(self) -> str:
        return self._at.area

    @property
    def shard_index(self) -> int:
        return self._at.shard_index

    @property
    def shard_count(self) -> int:
        return self._at.shard_count

    @property
    def server(self) -> str:
        return self._at.server

    def _fields(self) -> tuple[str, bytes, int, int, int, str]:
        at = self._at
        return (at.area, self.key, self.hash, at.shard_index, at.shard_count, at.server)


_set_central_at: Callable[[CentralPlacement, _CentralShard], None] = CentralPlacement.__dict__["_at"].__set__
_set_central_key: Callable[[CentralPlacement, bytes], None] = CentralPlacement.__dict__["key"].__set__
_set_central_hash: Callable[[CentralPlacement, int], None] = CentralPlacement.__dict__["hash"].__set__


def _build_central(placement: CentralPlacement, at: _CentralShard, key: bytes, hash_: int) -> CentralPlacement:
    _set_central_at(placement, at)
    _set_central_key(placement, key)
    _set_central_hash(placement, hash_)
    return placement


@dataclass(frozen=True, slots=True)
class _Partition:
    start: GDID  # absolute
    end: GDID | None  # absolute, exclusive; None = open-ended
    shards: tuple[str, ...]
    placed: tuple[_Shard, ...]  # per shard index: what its placements share


@dataclass(frozen=True, slots=True)
class _RangeSet:
    breakpoint: GDID
    starts: tuple[int, ...]  # absolute sharding values, strictly increasing
    partitions: tuple[_Partition, ...]
    placed: tuple[tuple[_Shard, ...], ...]  # per partition: its _Partition.placed


def _partition(area: str, range_set: GDID, start: GDID, end: GDID | None, shards: tuple[str, ...]) -> _Partition:
    layouts = [ShardLayout(area, start, end, i, len(shards)) for i in range(len(shards))]
    placed = tuple(_Shard(area, range_set, start, end, i, len(shards), server, layouts[i]) for i, server in enumerate(shards))
    return _Partition(start, end, shards, placed)


def _central_bytes(key: str | bytes | GDID) -> bytes:
    """The bytes a CENTRAL key hashes: UTF-8 of a str as given, the 12-byte form of a GDID."""
    if isinstance(key, GDID):
        return bytes(key)
    if isinstance(key, str):
        try:
            return key.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates: what undecodable bytes in argv or a file name become
            shown = key if len(key) <= 80 else key[:77] + "..."
            raise RoutingError(f"a CENTRAL key must be text UTF-8 can encode: {shown!r} has {exc.reason} at "
                               f"position {exc.start}") from None
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise RoutingError(f"a CENTRAL key must be str, bytes or GDID, got {type(key).__name__}")


CENTRAL_CACHE_SIZE = 32_768
"""Keys whose CENTRAL placement a router remembers (then it starts over): repeated keys (a login
e-mail, a tenant slug) route by one dict lookup instead of FNV-1a in Python."""


class Router:
    """Immutable routing table built from one map version and one relocation snapshot."""

    __slots__ = ("_map", "_areas", "_central", "_central_at", "_relocations", "_moved", "_central_cache", "_loader",
                 "_load_lock", "_reach", "_reach_loader")

    def __init__(
        self,
        pmap: PartitionMap,
        relocations: Mapping[tuple[str, GDID], str] | Callable[[], Mapping[tuple[str, GDID], str]] | None = None,
        reach: Callable[[], Mapping[tuple[str, str], Reach]] | None = None,
    ) -> None:
        """``relocations``: the directory, or a function that reads it, called at most once and
        only when something asks for it (:attr:`relocations`, :meth:`locate`). ``reach``: a
        function that reads the directory's summary per target server (:attr:`relocation_reach`),
        called at most once, when asked for and the directory is not held; without it the
        summary is derived from the directory.

        Briefcase sessions route without the directory (by the map and the fences they meet,
        :mod:`mdb.retry`), and fan-out asks only for the summary, so an application process
        holds neither a per-briefcase dictionary nor anything that grows with what moved
        (docs/design.md invariant 8).
        """
        self._map = pmap
        self._loader: Callable[[], Mapping[tuple[str, GDID], str]] | None = None
        self._load_lock = threading.Lock()
        self._reach: Mapping[tuple[str, str], Reach] | None = None
        self._reach_loader = reach
        self._relocations: Mapping[tuple[str, GDID], str] | None = None
        # per area, only for areas with relocations: locate skips the (slow, GDID-hashing) lookup elsewhere
        self._moved: dict[str, dict[GDID, str]] = {}
        if callable(relocations):
            self._loader = relocations
        else:
            self._set_directory(relocations or {})
        self._areas: dict[str, tuple[tuple[int, ...], tuple[_RangeSet, ...]]] = {}
        self._central: tuple[str, ...] = ()
        self._central_at: tuple[_CentralShard, ...] = ()
        self._central_cache: dict[str | bytes, CentralPlacement] = {}
        for name, area in pmap.areas.items():
            if area.kind == "central":
                self._central = tuple(area.shards or ())
                self._central_at = tuple(_CentralShard(name, i, len(self._central), server)
                                         for i, server in enumerate(self._central))
                continue
            sets = []
            specs = area.effective_range_sets()
            for r, rs in enumerate(specs):
                starts = list(rs.absolute_starts())
                set_end = specs[r + 1].breakpoint.sharding_value if r + 1 < len(specs) else None
                ends = [*starts[1:], set_end]
                parts = tuple(
                    _partition(name, rs.breakpoint, GDID.from_sharding_value(start),
                               None if end is None else GDID.from_sharding_value(end), p.shards)
                    for p, start, end in zip(rs.partitions, starts, ends)
                )
                sets.append(_RangeSet(rs.breakpoint, tuple(starts), parts, tuple(p.placed for p in parts)))
            self._areas[name] = (tuple(s.breakpoint.sharding_value for s in sets), tuple(sets))

    @property
    def map(self) -> PartitionMap:
        return self._map

    @property
    def version(self) -> int:
        return self._map.version

    def _set_directory(self, relocations: Mapping[tuple[str, GDID], str]) -> Mapping[tuple[str, GDID], str]:
        directory = dict(relocations)
        moved: dict[str, dict[GDID, str]] = {}
        for (area_name, gdid), server in directory.items():
            moved.setdefault(area_name, {})[gdid] = server
        self._moved = moved
        self._relocations = directory
        return directory

    @property
    def relocations(self) -> Mapping[tuple[str, GDID], str]:
        """The relocation directory (read now if this router was given a reader and nobody asked yet)."""
        directory = self._relocations
        if directory is None:
            with self._load_lock:
                directory = self._directory_locked()
        return directory

    @property
    def relocation_reach(self) -> Mapping[tuple[str, str], Reach]:
        """(area, server) -> :class:`Reach` of the directory's entries: which servers hold relocated
        briefcases of which areas, in a few rows per server. Read with the ``reach`` function this
        router was given (never the whole directory), or derived from the directory when held."""
        reach = self._reach
        if reach is None:
            with self._load_lock:
                reach = self._reach
                if reach is None:
                    if self._relocations is None and self._reach_loader is not None:
                        reach = dict(self._reach_loader())
                    else:
                        reach = reach_of(self._directory_locked())
                    self._reach = reach
        return reach

    def _directory_locked(self) -> Mapping[tuple[str, GDID], str]:
        """The directory, read now if needed; the caller holds the load lock."""
        directory = self._relocations
        if directory is None:
            assert self._loader is not None  # set whenever the directory is not
            directory = self._set_directory(self._loader())
        return directory

    @property
    def reach_loaded(self) -> bool:
        """Whether :attr:`relocation_reach` is known (no I/O to ask for it)."""
        return self._reach is not None or self._relocations is not None

    @property
    def directory_loaded(self) -> bool:
        """Whether this router holds the relocation directory (an application's routers never need to)."""
        return self._relocations is not None

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

    def _shard(self, area: str, gdid: GDID) -> _Shard:
        """The shard the map puts ``gdid`` on (relocations ignored); the errors of an unroutable GDID."""
        v = gdid.sharding_value
        if not v and gdid.is_zero:
            raise RoutingError(f"cannot route GDID {gdid} in area {area!r}: the zero GDID means 'none'")
        table = self._areas.get(area)
        breakpoints, sets = self._area(area) if table is None else table
        r = bisect_right(breakpoints, v) - 1
        if r < 0:
            raise RoutingError(f"GDID {gdid} is below the first range set of area {area!r} (breakpoint {sets[0].breakpoint})")
        rs = sets[r]
        p = bisect_right(rs.starts, v) - 1
        if p < 0:
            raise RoutingError(f"GDID {gdid} is below the first partition start {rs.partitions[0].start} of area {area!r}")
        return shard_in(rs.placed[p], v)

    def default_placement(self, area: str, gdid: GDID) -> Placement:
        """Where the map puts ``gdid``, ignoring relocations."""
        at = self._shard(area, gdid)
        return _build(_new(Placement), at, gdid, at.server, False)

    def locate(self, area: str, gdid: GDID) -> Placement:
        """Where ``gdid`` lives: the default shard, or its relocation where one exists."""
        at = self._shard(area, gdid)
        if self._relocations is None:
            self.relocations  # noqa: B018  (reads the directory: locate promises it)
        moved = self._moved.get(area)
        if moved is not None:
            moved_to = moved.get(gdid)
            if moved_to is not None and moved_to != at.server:
                return _build(_new(Placement), at, gdid, moved_to, True)
        return _build(_new(Placement), at, gdid, at.server, False)

    def placement_on(self, area: str, gdid: GDID, server: str) -> Placement:
        """``gdid`` routed to ``server``: its default placement when that is its default shard,
        else a relocated one (the target must hold a 'resident' record). How a session follows a
        fence or a learned location without the relocation directory."""
        at = self._shard(area, gdid)
        return _build(_new(Placement), at, gdid, server, server != at.server)

    def locate_central(self, key: str | bytes | GDID) -> CentralPlacement:
        """CENTRAL shard of a key. A ``str`` is UTF-8 encoded as given: normalize it first.

        ``str`` and ``bytes`` keys are remembered (up to :data:`CENTRAL_CACHE_SIZE`, then the
        cache starts over): the placement is immutable and a pure function of the key.
        """
        kind = key.__class__
        remembered = kind is str or kind is bytes
        if remembered:
            hit = self._central_cache.get(key)  # type: ignore[arg-type]  # narrowed by the class check
            if hit is not None:
                return hit
        if kind is str:
            try:
                data = key.encode("utf-8")  # type: ignore[union-attr]  # narrowed by the class check
            except UnicodeEncodeError:
                data = _central_bytes(key)  # raises the RoutingError that says what is wrong with the key
        else:
            data = key if kind is bytes else _central_bytes(key)
        h = fnv1a_64(data)
        placement = _build_central(_new(CentralPlacement), self._central_shard(h), data, h)
        if remembered:
            cache = self._central_cache
            if len(cache) >= CENTRAL_CACHE_SIZE:
                cache.clear()
            cache[key] = placement  # type: ignore[index]  # narrowed by the class check
        return placement

    def locate_central_many(self, keys: Sequence[str | bytes | GDID]) -> list[CentralPlacement]:
        """``[locate_central(k) for k in keys]``, hashing the keys not seen yet together
        (:func:`fnv1a_64_many`): for plans and checks over many CENTRAL keys."""
        cache = self._central_cache
        out: list[CentralPlacement | None] = [
            cache.get(key) if key.__class__ is str or key.__class__ is bytes else None
            for key in keys
        ]
        todo = [i for i, hit in enumerate(out) if hit is None]
        if todo:
            try:
                datas = [key.encode("utf-8") if key.__class__ is str else _central_bytes(key)
                         for key in [keys[i] for i in todo]]
            except UnicodeEncodeError:
                datas = [_central_bytes(keys[i]) for i in todo]  # raises the RoutingError naming the key
            shard = self._central_shard
            for i, data, h in zip(todo, datas, fnv1a_64_many(datas)):
                placement = out[i] = _build_central(_new(CentralPlacement), shard(h), data, h)
                key = keys[i]
                if key.__class__ is str or key.__class__ is bytes:
                    if len(cache) >= CENTRAL_CACHE_SIZE:
                        cache.clear()
                    cache[key] = placement
        return out  # type: ignore[return-value]  # every slot is filled above

    def _central_shard(self, h: int) -> _CentralShard:
        at = self._central_at
        try:
            return at[h % len(at)]
        except ZeroDivisionError:
            raise RoutingError("the map has no CENTRAL area (an area of kind: central): it routes no keys") from None

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

    def partition(self, area: str, start: GDID) -> tuple[GDID, GDID | None, tuple[str, ...]]:
        """The partition of ``area`` that starts at ``start`` (absolute): (start, end or None, shards)."""
        starts = []
        for s, e, shards in self.partitions(area):
            if s == start:
                return s, e, shards
            starts.append(str(s))
        raise RoutingError(f"area {area!r} has no partition starting at {start} (starts: {', '.join(starts)})")

    def partition_member(self, area: str, start: GDID) -> Callable[[GDID], bool]:
        """Whether the map puts a GDID in the partition of ``area`` starting at ``start``.

        A reshard plan asks this of every key of the partition, so it compares the partition's
        bounds directly instead of building a Placement per key. The zero GDID raises, as
        routing it does."""
        pstart, pend, _ = self.partition(area, start)
        low, high = pstart.sharding_value, None if pend is None else pend.sharding_value

        def member(gdid: GDID) -> bool:
            v = gdid.sharding_value
            if not v and gdid.is_zero:
                self._shard(area, gdid)  # raises: the zero GDID means 'none', it routes nowhere
            return low <= v and (high is None or v < high)

        return member

    def layouts(self) -> Iterator[tuple[str, ShardLayout]]:
        """(server, layout) for every shard of every area, CENTRAL included: what to stamp."""
        for index, server in enumerate(self._central):
            yield server, ShardLayout(self._map.central_area, GDID.ZERO, None, index, len(self._central))
        for area in self._areas:
            for start, end, shards in self.partitions(area):
                for index, server in enumerate(shards):
                    yield server, ShardLayout(area, start, end, index, len(shards))
