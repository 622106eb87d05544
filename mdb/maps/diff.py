"""The diff of two partition map versions, each change accepted or refused with its reason (pure).

A map edit must never re-route data that exists (docs/design.md invariant 4). What exists is
bounded per area by its **high-water mark**: the highest GDID stored in the area (or issued
for it). An edit is safe when every GDID at or below that mark keeps its range set, partition
and shard; so existing range sets and partitions must stay exactly as they were, and anything
new (a partition, a range set) must start strictly above the mark. :func:`diff_maps` decides
that from two maps and the marks it is given, with no I/O: the live marks come from
:mod:`mdb.maps.high_water`, and :mod:`mdb.maps.apply` refuses to stamp a map this refuses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from mdb.errors import MapEditError
from mdb.gdid import GDID
from mdb.partition_map import AreaSpec, PartitionMap, RangeSetSpec, ServerSpec, absolute_start
from mdb.urls import mask_url

__all__ = ["MapChange", "MapDiff", "Verdict", "diff_maps"]

Verdict = Literal["accepted", "refused"]


@dataclass(frozen=True, slots=True)
class MapChange:
    """One difference between two map versions and whether it is safe."""

    kind: str
    """version, server-added, server-removed, server-url, models, area-added, area-removed,
    area-kind, central-shards, range-set-added, range-set-removed, breakpoint-changed,
    partition-added, partition-removed, partition-start-changed, shards-changed,
    reshard-target"""
    subject: str
    old: str | None
    new: str | None
    accepted: bool
    reason: str

    @property
    def verdict(self) -> Verdict:
        return "accepted" if self.accepted else "refused"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "subject": self.subject, "old": self.old, "new": self.new,
                "verdict": self.verdict, "reason": self.reason}


@dataclass(frozen=True)
class MapDiff:
    old_version: int
    new_version: int
    changes: tuple[MapChange, ...]
    high_water: Mapping[str, GDID | None]
    """The mark used per partitioned area of the old map (None = unknown)."""

    @property
    def ok(self) -> bool:
        return all(c.accepted for c in self.changes)

    @property
    def refused(self) -> list[MapChange]:
        return [c for c in self.changes if not c.accepted]

    def refusal_text(self) -> str:
        return "; ".join(f"{c.subject}: {c.reason}" for c in self.refused)

    def raise_if_refused(self) -> None:
        if not self.ok:
            raise MapEditError(
                f"map version {self.new_version} refused against version {self.old_version} "
                f"({len(self.refused)} unsafe change(s)): {self.refusal_text()}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "old_version": self.old_version,
            "new_version": self.new_version,
            "ok": self.ok,
            "high_water": {a: None if g is None else str(g) for a, g in self.high_water.items()},
            "changes": [c.to_json() for c in self.changes],
        }


def _gdid_v(v: int) -> GDID:
    return GDID.from_sharding_value(v)


def _fmt_shards(shards: Sequence[str]) -> str:
    return "[" + ", ".join(shards) + "]"


class _Differ:
    def __init__(
        self,
        old: PartitionMap,
        new: PartitionMap,
        high_water: Mapping[str, GDID] | None,
        allow_reshard_of: tuple[str, GDID] | None,
        relocated_to: Iterable[str],
    ) -> None:
        self.old, self.new = old, new
        self.hw = dict(high_water) if high_water is not None else {}
        self.allow = allow_reshard_of
        self.relocated_to = set(relocated_to)
        self.changes: list[MapChange] = []
        self.reshard_found = False

    def add(self, kind: str, subject: str, old: str | None, new: str | None, accepted: bool, reason: str) -> None:
        self.changes.append(MapChange(kind, subject, old, new, accepted, reason))

    def run(self) -> MapDiff:
        old, new = self.old, self.new
        if new.version > old.version:
            self.add("version", "version", str(old.version), str(new.version), True, "the version increases")
        else:
            self.add("version", "version", str(old.version), str(new.version), False,
                     f"the version must increase (old {old.version}, new {new.version}): "
                     "processes only adopt a map whose version is higher than the one they hold")
        for name, spec in old.areas.items():
            if name not in new.areas:
                self.add("area-removed", f"area {name}", name, None, False,
                         f"area {name!r} is removed: its data would become unreachable")
                continue
            self._area(name, spec, new.areas[name])
        for name, spec in new.areas.items():
            if name not in old.areas:
                what = "central area" if spec.kind == "central" else f"{sum(len(rs.partitions) for rs in spec.effective_range_sets())} partition(s)"
                self.add("area-added", f"area {name}", None, what, True, "a new area holds no data yet")
        self._servers()
        if old.models != new.models:
            self.add("models", "models", ", ".join(old.models) or "-", ", ".join(new.models) or "-", True,
                     "model modules do not affect placement")
        if self.allow is not None and not self.reshard_found:
            area, start = self.allow
            self.add("reshard-target", f"area {area} partition {start}", None, None, False,
                     f"allow_reshard_of names partition {start} of area {area!r}, but the old map has no "
                     "partition with that start whose shard list this edit changes")
        hw = {name: self.hw.get(name) for name, a in old.areas.items() if a.kind != "central"}
        return MapDiff(old.version, new.version, tuple(self.changes), hw)

    def _servers(self) -> None:
        old, new = self.old, self.new
        in_use: dict[str, list[str]] = {}
        for name, area in old.areas.items():
            for server in area.servers():
                in_use.setdefault(server, []).append(name)
        for name, spec in old.servers.items():
            if name not in new.servers:
                areas = in_use.get(name, [])
                if name in self.relocated_to:
                    self.add("server-removed", f"server {name}", spec.masked_primary, None, False,
                             f"server {name!r} is removed but relocated briefcases live on it")
                elif areas:
                    # Also after a reshard that empties it: its stamp must be withdrawn by an
                    # apply that still names it; remove it from servers: in a later version.
                    self.add("server-removed", f"server {name}", spec.masked_primary, None, False,
                             f"server {name!r} is removed but the old map uses it in area(s) {', '.join(areas)}")
                else:
                    self.add("server-removed", f"server {name}", spec.masked_primary, None, True,
                             "no area and no relocation uses it")
                continue
            now = new.servers[name]
            if now.primary != spec.primary:
                self.add("server-url", f"server {name} primary", spec.masked_primary, now.masked_primary, True,
                         "a changed URL reaches the same data under another address")
            if now.replica != spec.replica:
                self.add("server-url", f"server {name} replica", spec.masked_replica, now.masked_replica, True,
                         "replicas serve reads only")
            if (now.pooler, now.direct) != (spec.pooler, spec.direct):
                self.add("server-url", f"server {name} pooler", _pooling(spec), _pooling(now), True,
                         "the same data through or around a connection pooler")
        for name, spec in new.servers.items():
            if name not in old.servers:
                self.add("server-added", f"server {name}", None, spec.masked_primary, True, "a new server holds no data yet")

    def _area(self, name: str, old: AreaSpec, new: AreaSpec) -> None:
        subject = f"area {name}"
        if old.kind != new.kind:
            self.add("area-kind", subject, old.kind, new.kind, False,
                     f"area {name!r} changes kind from {old.kind} to {new.kind}: every key would re-route")
            return
        if old.kind == "central":
            if tuple(old.shards or ()) != tuple(new.shards or ()):
                self.add("central-shards", subject, _fmt_shards(old.shards or ()), _fmt_shards(new.shards or ()), False,
                         "the CENTRAL shard list is fixed: a key's shard is FNV-1a-64 of the key mod the shard count, "
                         "so any change to the list re-routes existing CENTRAL keys")
            return
        hw = self.hw.get(name)
        old_sets = old.effective_range_sets()
        new_sets = new.effective_range_sets()
        new_by_bp = {rs.breakpoint.sharding_value: rs for rs in new_sets}
        old_bps = {rs.breakpoint.sharding_value for rs in old_sets}
        paired_new: set[int] = set()
        for r, rs in enumerate(old_sets):
            bp = rs.breakpoint.sharding_value
            if bp in new_by_bp:
                self._range_set(name, rs, new_by_bp[bp], hw)
                continue
            # Name it a changed breakpoint when the new map has an unmatched set at the same position.
            if r < len(new_sets) and new_sets[r].breakpoint.sharding_value not in old_bps:
                paired_new.add(new_sets[r].breakpoint.sharding_value)
                self.add("breakpoint-changed", f"{subject} range set {r}", str(rs.breakpoint), str(new_sets[r].breakpoint), False,
                         f"the breakpoint of range set {rs.breakpoint} changes: GDIDs around it would move between range sets")
            else:
                self.add("range-set-removed", f"{subject} range set {rs.breakpoint}", str(rs.breakpoint), None, False,
                         f"range set {rs.breakpoint} is removed: its GDIDs would re-route to the set below")
        for rs in new_sets:
            bp = rs.breakpoint.sharding_value
            if bp in old_bps or bp in paired_new:
                continue
            ok, reason = self._above_mark(name, bp, hw, f"range set {rs.breakpoint}")
            self.add("range-set-added", f"{subject} range set {rs.breakpoint}", None,
                     f"{len(rs.partitions)} partition(s)", ok, reason)

    def _range_set(self, name: str, old: RangeSetSpec, new: RangeSetSpec, hw: GDID | None) -> None:
        bp = old.breakpoint
        old_parts = {p.start.sharding_value: p for p in old.partitions}
        new_parts = {p.start.sharding_value: p for p in new.partitions}
        gone = [p for p in old.partitions if p.start.sharding_value not in new_parts]
        came = [p for p in new.partitions if p.start.sharding_value not in old_parts]
        paired = len(gone) == len(came) and bool(gone)
        for i, p in enumerate(gone):
            start = _gdid_v(absolute_start(bp, p.start))
            if paired:
                moved = _gdid_v(absolute_start(bp, came[i].start))
                self.add("partition-start-changed", f"area {name} partition {start}", str(start), str(moved), False,
                         f"partition start {start} changes to {moved}: GDIDs between them would change partition")
            else:
                self.add("partition-removed", f"area {name} partition {start}", _fmt_shards(p.shards), None, False,
                         f"partition {start} is removed: its GDIDs would re-route to the partition below")
        if not paired:
            for p in came:
                start_v = absolute_start(bp, p.start)
                ok, reason = self._above_mark(name, start_v, hw, f"partition {_gdid_v(start_v)}")
                self.add("partition-added", f"area {name} partition {_gdid_v(start_v)}", None, _fmt_shards(p.shards), ok, reason)
        for v, p in old_parts.items():
            q = new_parts.get(v)
            if q is None or q.shards == p.shards:
                continue
            start = _gdid_v(absolute_start(bp, p.start))
            subject = f"area {name} partition {start}"
            if self.allow is not None and self.allow[0] == name and self.allow[1].sharding_value == start.sharding_value:
                self.reshard_found = True
                self.add("shards-changed", subject, _fmt_shards(p.shards), _fmt_shards(q.shards), True,
                         "the reshard of exactly this partition (its briefcases were moved by the reshard tool)")
                continue
            how = "reordered" if sorted(p.shards) == sorted(q.shards) else "changed"
            self.add("shards-changed", subject, _fmt_shards(p.shards), _fmt_shards(q.shards), False,
                     f"the shard list of partition {start} is {how}: a GDID's shard is its position "
                     f"v mod {len(p.shards)} in the list, so existing briefcases would re-route; "
                     "changing a shard list is a reshard (`mdb reshard`), which moves them first")

    def _above_mark(self, area: str, start_v: int, hw: GDID | None, what: str) -> tuple[bool, str]:
        if hw is None:
            return False, (
                f"the high-water mark of area {area!r} is unknown, so nothing shows that no GDID at or above "
                f"{what} exists yet: supply the mark (the live system, or an explicit AREA=GDID)"
            )
        if start_v <= hw.sharding_value:
            return False, (
                f"{what} starts at or below the high-water mark {hw} of area {area!r}: GDIDs up to the mark "
                "may exist there and would re-route; start it above the mark"
            )
        return True, f"starts above the high-water mark {hw} of area {area!r}"


def diff_maps(
    old: PartitionMap,
    new: PartitionMap,
    high_water: Mapping[str, GDID] | None,
    *,
    allow_reshard_of: tuple[str, GDID] | None = None,
    relocated_to: Iterable[str] = (),
) -> MapDiff:
    """Every change from ``old`` to ``new``, each accepted or refused with its reason. No I/O.

    ``high_water`` maps an area to its high-water mark (the highest GDID issued or stored in
    it); an area missing from it has an unknown mark, and then nothing new may be added to it.
    ``allow_reshard_of=(area, absolute partition start)`` accepts exactly that partition's
    shard-list change (the reshard tool passes it after moving the briefcases).
    ``relocated_to`` names servers that relocated briefcases live on (so they may not go).
    """
    return _Differ(old, new, high_water, allow_reshard_of, relocated_to).run()


def _pooling(spec: ServerSpec) -> str:
    return f"pooler {spec.pooler}" + (f", direct {mask_url(spec.direct)}" if spec.direct else "")
