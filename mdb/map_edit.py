"""Safe partition map edits (docs/design.md invariant 4): diff, high-water marks, apply, history.

A map edit must never re-route data that exists. What exists is bounded per area by its
**high-water mark**: the highest GDID stored in the area (or issued for it). An edit is safe
when every GDID at or below that mark keeps its range set, partition and shard; so existing
range sets and partitions must stay exactly as they were, and anything new (a partition, a
range set) must start strictly above the mark. :func:`diff_maps` decides that, purely;
:func:`apply_map` is the only code that stamps a new layout onto shards, and it records the
applied map in CENTRAL (``mdb_maps``) so every Store picks it up on refresh.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from sqlalchemy import Column, DateTime, Integer, Table, Text, delete, func, insert, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from mdb import dberrors
from mdb.dberrors import translated
from mdb.errors import MapEditError, MdbError
from mdb.gdid import GDID
from mdb.partition_map import AreaSpec, PartitionMap, RangeSetSpec, ServerSpec, parse_map, read_map_text, safe_yaml_load, sqlite_file
from mdb.router import Router, ShardLayout
from mdb.system_tables import central_metadata, shard_layout
from mdb.urls import mask_url

if TYPE_CHECKING:
    from mdb.store import Store

__all__ = [
    "MAPS_KEY",
    "ApplyReport",
    "MapChange",
    "MapDiff",
    "StampChange",
    "apply_map",
    "applied_maps",
    "diff_maps",
    "high_water_marks",
    "live_diff",
    "load_applied_map",
    "newest_applied",
    "maps_table",
]

maps_table = Table(
    "mdb_maps",
    central_metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    # The map text as written, ${NAME} references NOT expanded: no secret is stored here.
    Column("yaml", Text, nullable=False),
    Column("applied_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)

MAPS_KEY = "mdb:maps"
"""The CENTRAL key whose shard (FNV-1a like any CENTRAL key) holds the map history."""

_MAX_V = GDID(2**32 - 1, 0, 2**60 - 1).sharding_value
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SECRET_QUERY_KEYS = ("password", "passwd", "pwd", "secret", "token")

Verdict = Literal["accepted", "refused"]


# -- the diff (pure) -----------------------------------------------------------------------------


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
        base = old.breakpoint.sharding_value
        old_parts = {p.start.sharding_value: p for p in old.partitions}
        new_parts = {p.start.sharding_value: p for p in new.partitions}
        gone = [p for p in old.partitions if p.start.sharding_value not in new_parts]
        came = [p for p in new.partitions if p.start.sharding_value not in old_parts]
        paired = len(gone) == len(came) and bool(gone)
        for i, p in enumerate(gone):
            start = _gdid_v(base + p.start.sharding_value)
            if paired:
                moved = _gdid_v(base + came[i].start.sharding_value)
                self.add("partition-start-changed", f"area {name} partition {start}", str(start), str(moved), False,
                         f"partition start {start} changes to {moved}: GDIDs between them would change partition")
            else:
                self.add("partition-removed", f"area {name} partition {start}", _fmt_shards(p.shards), None, False,
                         f"partition {start} is removed: its GDIDs would re-route to the partition below")
        if not paired:
            for p in came:
                start_v = base + p.start.sharding_value
                ok, reason = self._above_mark(name, start_v, hw, f"partition {_gdid_v(start_v)}")
                self.add("partition-added", f"area {name} partition {_gdid_v(start_v)}", None, _fmt_shards(p.shards), ok, reason)
        for v, p in old_parts.items():
            q = new_parts.get(v)
            if q is None or q.shards == p.shards:
                continue
            start = _gdid_v(base + v)
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


# -- high-water marks (live) --------------------------------------------------------------------


def stored_high_water(conn: Connection, key_columns: Iterable[Any]) -> int | None:
    """The highest sharding value among the keys in ``key_columns`` (GDIDType columns), or None.

    Byte order (what ``max`` sees) is (era, authority, counter), but placement ignores the
    authority. So: the top era first, then the top key of each of the 16 authorities inside
    that era, each an index range probe on the key.
    """
    best: int | None = None
    for col in key_columns:
        # ORDER BY .. DESC LIMIT 1 rather than max(): PostgreSQL has no max(bytea), and both
        # servers answer it from the primary key index.
        top = conn.execute(select(col).order_by(col.desc()).limit(1)).scalar()
        if top is None:
            continue
        era = top.era
        probes = [
            select(col).where(col.between(GDID(era, a, 0), GDID(era, a, 2**60 - 1))).order_by(col.desc()).limit(1)
            .scalar_subquery().label(f"a{a}")
            for a in range(16)
        ]
        for k in conn.execute(select(*probes)).one():
            if k is not None and (best is None or k.sharding_value > best):
                best = k.sharding_value
    return best


def _issued_high_water(store: Store, scopes: Mapping[str, str]) -> dict[str, int]:
    """Per area, the highest GDID the CENTRAL sequences of its scope issued (or skipped past).

    Sequences (``mdb.idgen``) are named (scope, sequence) and know nothing of areas; a
    sequence serves an area when its scope is the area's name (``store.gdids(area, ...)``)
    or the scope ``scopes`` names for it. Its next free position minus one bounds every id
    it issued; blocks handed out but not yet stored are covered by that too.
    """
    from mdb.idgen import sequences

    by_scope: dict[str, str] = {scopes.get(area, area): area for area in store.router.area_names()}
    out: dict[str, int] = {}
    for server in store.router.central_servers():
        with store.transaction(server) as conn:
            if not sa_inspect(conn).has_table(sequences.name):
                continue
            rows = conn.execute(
                select(sequences.c.scope, sequences.c.era, sequences.c.next_counter).where(sequences.c.scope.in_(list(by_scope)))
            )
            for scope, era, next_counter in rows:
                v = int(era) * 2**60 + int(next_counter) - 1
                area = by_scope[scope]
                out[area] = max(out.get(area, 0), v)
    return out


def high_water_marks(store: Store, *, margin: int = 0, scopes: Mapping[str, str] | None = None) -> dict[str, GDID]:
    """The high-water mark of every partitioned area whose briefcase types ``store`` knows.

    The mark is the maximum of the root-table keys on every server that can hold the area's
    briefcases (its shards, relocation targets, spare servers), the relocation directory, and
    what the CENTRAL GDID sequences of the area's scope issued (``scopes`` maps an area to its
    sequence scope when that is not the area's name), plus ``margin`` counter values of
    headroom. An area without registered types is left out: its mark is unknown.
    """
    if margin < 0:
        raise MapEditError(f"the high-water margin must be >= 0, got {margin}")
    router = store.router
    used = {s for a in router.area_names() for s in router.area_servers(a)} | set(router.central_servers())
    spares = [s for s in store.map.servers if s not in used]
    best: dict[str, int] = {}
    per_server: dict[str, list[str]] = {}
    for area in router.area_names():
        if not store.types_of(area):
            continue
        best[area] = 0
        servers = [*router.area_servers(area), *spares]
        servers += [s for (a, _), s in router.relocations.items() if a == area]
        for server in dict.fromkeys(servers):
            per_server.setdefault(server, []).append(area)
    for (area, gdid), _ in router.relocations.items():
        if area in best:
            best[area] = max(best[area], gdid.sharding_value)
    for server, areas in per_server.items():
        with translated(server):
            conn = store.connect(server, readonly=False)
            try:
                existing = set(sa_inspect(conn).get_table_names())
                for area in areas:
                    cols = [bt.key_column(bt.tables[0]) for bt in store.types_of(area)
                            if bt.tables[0].name in existing]
                    top = stored_high_water(conn, cols)
                    if top is not None:
                        best[area] = max(best[area], top)
            finally:
                conn.close()
    for area, v in _issued_high_water(store, scopes or {}).items():
        if area in best:
            best[area] = max(best[area], v)
    return {area: _gdid_v(min(v + margin, _MAX_V)) for area, v in best.items()}


# -- the applied-map history in CENTRAL ---------------------------------------------------------


@dataclass(frozen=True)
class AppliedMap:
    version: int
    yaml: str
    applied_at: datetime | None
    server: str


def _maps_server(pmap: PartitionMap) -> str:
    return Router(pmap).locate_central(MAPS_KEY).server


def _no_history_there(pmap: PartitionMap, server: str) -> bool:
    """True when ``server`` cannot hold a map history: a MongoDB CENTRAL (history is kept on
    SQL CENTRAL servers only), or a SQLite file that does not exist yet (asking would create
    an empty database file, and its folder, as a side effect of a read-only command)."""
    from mdb.mongo.clients import is_mongo_url

    return is_mongo_url(pmap.servers[server].primary) or _sqlite_file_missing(pmap, server)


def _sqlite_file_missing(pmap: PartitionMap, server: str) -> bool:
    """True when ``server`` is a SQLite file that does not exist: connecting would create it."""
    database = sqlite_file(pmap.servers[server].primary)
    return database is not None and not Path(database).exists()


def _newest_applied(store: Store, pmap: PartitionMap, newer_than: int = 0) -> AppliedMap | None:
    server = _maps_server(pmap)
    if _no_history_there(pmap, server):
        return None
    query = (
        select(maps_table.c.version, maps_table.c.yaml, maps_table.c.applied_at)
        .where(maps_table.c.version > newer_than)
        .order_by(maps_table.c.version.desc())
        .limit(1)
    )
    with translated(server):
        conn = store.begin(server)  # not connect(): a connection that died in a restart is replaced
        try:
            try:
                row = conn.execute(query).first()
            except DBAPIError:
                conn.rollback()
                if sa_inspect(conn).has_table(maps_table.name):
                    raise
                return None  # no map was ever applied on this system (apply creates the table)
        finally:
            conn.close()
    return None if row is None else AppliedMap(row[0], row[1], row[2], server)


def load_applied_map(store: Store, current: PartitionMap) -> PartitionMap | None:
    """The newest map recorded by ``apply_map`` in CENTRAL if newer than ``current``, else None.

    Called by ``Store.refresh``; ``${NAME}`` references expand from this process's environment.
    """
    applied = _newest_applied(store, current, newer_than=current.version)
    if applied is None:
        return None
    return _parse_applied(applied, current)


def _parse_applied(applied: AppliedMap, current: PartitionMap) -> PartitionMap:
    """An applied map's text as a map; relative SQLite paths resolve like ``current``'s did."""
    return parse_map(applied.yaml, f"mdb_maps version {applied.version} on server {applied.server!r}", folder=current.folder)


def newest_applied(store: Store) -> AppliedMap | None:
    """The newest map ``mdb map apply`` recorded in CENTRAL (version and text as written), if any."""
    return _newest_applied(store, store.map)


def applied_maps(store: Store) -> list[tuple[int, datetime | None]]:
    """(version, applied_at) of every map recorded in CENTRAL, oldest first."""
    server = _maps_server(store.map)
    if _no_history_there(store.map, server):
        return []
    with store.transaction(server) as conn:
        if not sa_inspect(conn).has_table(maps_table.name):
            return []
        return [(v, t) for v, t in conn.execute(select(maps_table.c.version, maps_table.c.applied_at).order_by(maps_table.c.version))]


def _pooling(spec: ServerSpec) -> str:
    return f"pooler {spec.pooler}" + (f", direct {mask_url(spec.direct)}" if spec.direct else "")


def _literal_secret(url: str) -> bool:
    """True if ``url`` carries a password that is not just a ``${NAME}`` reference."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return mask_url(url) != url
    values: list[str] = [parsed.password] if parsed.password else []
    for key, value in parsed.query.items():
        if key.lower() in _SECRET_QUERY_KEYS:
            values.extend(value if isinstance(value, tuple) else [value])
    return any(not _ENV_REF.fullmatch(str(v)) for v in values)


def _expand(text: str) -> str:
    return _ENV_REF.sub(lambda m: os.environ.get(m.group(1), m.group(0)), text)


def _raw_urls(texts: Iterable[str]) -> dict[str, str]:
    """expanded URL -> URL as written (with ``${NAME}``), from the server lists of map texts."""
    out: dict[str, str] = {}
    for text in texts:
        data = safe_yaml_load(text)
        servers = data.get("servers") if isinstance(data, dict) else None
        for spec in (servers or {}).values():
            for key in ("primary", "replica", "direct"):
                raw = spec.get(key) if isinstance(spec, dict) else None
                if isinstance(raw, str):
                    out.setdefault(_expand(raw), raw)
    return out


def recordable_yaml(pmap: PartitionMap, yaml_text: str | None, known_texts: Iterable[str] = ()) -> str:
    """The text to record for ``pmap``: never one that carries a literal password.

    With ``yaml_text`` (the file as written) it is checked and used. Without it, the map is
    dumped and each URL replaced by its unexpanded form from ``known_texts`` (the maps the
    system already knows); a URL with a password that no known text spells as ``${NAME}``
    is refused.
    """
    if yaml_text is not None:
        check = parse_map(yaml_text, "the map text to record", folder=pmap.folder)
        if check.model_dump() != pmap.model_dump():
            raise MapEditError("the YAML text given to record is not the map being applied")
        data = safe_yaml_load(yaml_text)
    else:
        data = yaml.safe_load(pmap.to_yaml())
        raw = _raw_urls(known_texts)
        for spec in data["servers"].values():
            for key in ("primary", "replica", "direct"):
                if key in spec and spec[key] in raw:
                    spec[key] = raw[spec[key]]
        yaml_text = yaml.safe_dump(data, sort_keys=False)
    for name, spec in (data.get("servers") or {}).items():
        for key in ("primary", "replica", "direct"):
            url = spec.get(key)
            if isinstance(url, str) and _literal_secret(url):
                raise MapEditError(
                    f"server {name!r} {key} URL {mask_url(url)} carries a literal password; the applied map is "
                    "stored in CENTRAL, so write it as ${NAME} (expanded from the environment)"
                )
    return yaml_text


# -- apply ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StampChange:
    server: str
    area: str
    action: Literal["added", "changed", "removed"]
    old: str | None
    new: str | None


@dataclass
class ApplyReport:
    old_version: int
    new_version: int
    diff: MapDiff
    prepared: dict[str, list[str]] = field(default_factory=dict)
    """server -> tables created on it (servers the new map adds or gives a new role)."""
    stamps: list[StampChange] = field(default_factory=list)
    recorded_on: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "old_version": self.old_version,
            "new_version": self.new_version,
            "diff": self.diff.to_json(),
            "prepared": self.prepared,
            "stamps": [{"server": s.server, "area": s.area, "action": s.action, "old": s.old, "new": s.new} for s in self.stamps],
            "recorded_on": self.recorded_on,
        }


def _fmt_layout(layout: ShardLayout | None) -> str | None:
    if layout is None:
        return None
    return f"[{layout.partition_start}, {layout.partition_end or 'open'}) shard {layout.shard_index} of {layout.shard_count}"


def _read_stamps(conn: Connection) -> dict[str, ShardLayout]:
    if not sa_inspect(conn).has_table(shard_layout.name):
        return {}
    rows = conn.execute(select(shard_layout)).mappings()
    return {
        r["area"]: ShardLayout(r["area"], r["partition_start"], r["partition_end"], r["shard_index"], r["shard_count"])
        for r in rows
    }


def _lock_layout(conn: Connection, lock_timeout: float) -> None:
    """Wait for every in-flight session on this shard, and hold off new ones until commit.

    Every session reads ``mdb_shard_layout`` in its ownership check, so on PostgreSQL it holds
    ACCESS SHARE on that table until it ends: ACCESS EXCLUSIVE waits for all of them and
    blocks the checks of new ones, which after our commit read the new stamp. On SQLite the
    transaction's BEGIN IMMEDIATE already serializes us with every writer.
    """
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'")
        conn.exec_driver_sql(f"LOCK TABLE {shard_layout.name} IN ACCESS EXCLUSIVE MODE")


def _write_stamp(conn: Connection, server: str, area: str, layout: ShardLayout | None, version: int) -> None:
    from mdb.schema import stamp_layout

    if layout is None:
        conn.execute(delete(shard_layout).where(shard_layout.c.area == area))
        return
    problem = stamp_layout(conn, layout, version, replace=True)
    if problem:  # replace=True never refuses; a problem here is a bug, not an operator error
        raise MapEditError(f"server {server!r}: {problem}")


def _shrink_check(store: Store, conn: Connection, server: str, area: str, live: ShardLayout, new: ShardLayout | None) -> None:
    """Under the lock: refuse when a GDID this shard stores would fall outside its new range."""
    if new is None:
        return  # leaving the area happens only in a reshard, which moved the briefcases first
    end_shrinks = new.partition_end is not None and (
        live.partition_end is None or new.partition_end.sharding_value < live.partition_end.sharding_value
    )
    if not end_shrinks:
        return
    existing = set(sa_inspect(conn).get_table_names())
    cols = [bt.key_column(bt.tables[0]) for bt in store.types_of(area) if bt.tables[0].name in existing]
    top = stored_high_water(conn, cols)
    assert new.partition_end is not None
    if top is not None and top >= new.partition_end.sharding_value:
        raise MapEditError(
            f"server {server!r} stores GDID {_gdid_v(top)} of area {area!r}, at or above the new partition end "
            f"{new.partition_end} (written after the high-water mark was read): choose a start above it"
        )


def _live_diff(
    store: Store, new_map: PartitionMap, allow_reshard_of: tuple[str, GDID] | None, margin: int
) -> tuple[MapDiff, PartitionMap, AppliedMap | None]:
    store.refresh()
    old_applied = _newest_applied(store, store.map)
    old_map = _parse_applied(old_applied, store.map) if old_applied else store.map
    relocated_to = set(store.router.relocations.values())
    marks = high_water_marks(store, margin=margin)
    diff = diff_maps(old_map, new_map, marks, allow_reshard_of=allow_reshard_of, relocated_to=relocated_to)
    return diff, old_map, old_applied


def live_diff(
    store: Store, new_map: PartitionMap, *, allow_reshard_of: tuple[str, GDID] | None = None, margin: int = 0
) -> MapDiff:
    """``diff_maps`` from the newest applied map (else the Store's) to ``new_map``, with live marks.

    What ``apply_map`` checks first; never raises for a refused change (see ``MapDiff.ok``).
    """
    return _live_diff(store, new_map.resolved_in(store.map.folder), allow_reshard_of, margin)[0]


def apply_map(
    store: Store,
    new_map: PartitionMap,
    *,
    yaml_text: str | None = None,
    allow_reshard_of: tuple[str, GDID] | None = None,
    margin: int = 0,
    lock_timeout: float = 10.0,
    dry_run: bool = False,
) -> ApplyReport:
    """Validate ``new_map`` against the live system and stamp it onto every shard, safely.

    The old side is the newest map recorded in CENTRAL (else the Store's own map). Nothing is
    written unless :func:`diff_maps` accepts every change under the live high-water marks.
    Then, in this order (each step keeps every process, old map or new, from writing a
    briefcase to a shard that will not own it):

    1. Every server of the new map is reached and its stamps read (a down server stops the
       apply before anything changes).
    2. Servers that are new or gain a role get their tables (``schema.server_tables``).
    3. Stamps that did not exist are written: servers joining an area. No process routes there
       by default under the old map, so this is invisible until the map is published.
    4. Stamps that change are rewritten, one shard at a time, each under a lock that waits
       for the shard's in-flight sessions and re-checks that no stored GDID falls outside the
       new range (GDIDs written since the marks were read). After this an old process meets
       the new stamp, raises StaleRouteError and refreshes; it cannot write to the wrong shard.
    5. Stamps of servers that leave an area (a reshard) are deleted the same way.
    6. The map text is recorded in CENTRAL; refreshing Stores adopt it (retrying processes
       that met a new stamp in steps 4-5 succeed from here on).

    ``dry_run`` does every check (refusing like a real run) and returns before step 1.

    A failure in steps 3-5 restores every stamp already written (tables created stay; they
    are empty) and raises MapEditError. A crash between 4 and 6 leaves old processes refused
    (retryably) for the changed ranges, never misrouted; running the apply again finishes it.
    """
    # A map given as text (a reshard's) has relative SQLite paths; they mean what the Store's do.
    new_map = new_map.resolved_in(store.map.folder)
    diff, old_map, old_applied = _live_diff(store, new_map, allow_reshard_of, margin)
    report = ApplyReport(old_map.version, new_map.version, diff)
    diff.raise_if_refused()
    known = [old_applied.yaml] if old_applied else []
    if store.map_path is not None and Path(store.map_path).is_file():
        known.append(read_map_text(store.map_path))
    text = recordable_yaml(new_map, yaml_text, known)
    if dry_run:
        return report

    from mdb.schema import create_tables, server_tables
    from mdb.store import Store as _Store

    target = _Store(new_map, types=store.types)
    try:
        old_router, new_router = Router(old_map), Router(new_map)
        new_layouts: dict[str, dict[str, ShardLayout]] = {}
        for server, layout in new_router.layouts():
            if layout.area != new_map.central_area:
                new_layouts.setdefault(server, {})[layout.area] = layout
        old_roles: dict[str, set[str]] = {}
        for server, layout in old_router.layouts():
            old_roles.setdefault(server, set()).add(layout.area)

        # 1. reach every server, read live stamps
        live: dict[str, dict[str, ShardLayout]] = {}
        for server in new_map.servers:
            with target.transaction(server) as conn:
                live[server] = _read_stamps(conn)
        areas = set(new_router.area_names())

        # 2. tables on new servers and servers with a new role
        for server in new_map.servers:
            new_roles = set(new_layouts.get(server, {}))
            if server in new_router.central_servers():
                new_roles.add(new_map.central_area)
            if server in old_map.servers and new_roles <= old_roles.get(server, set()):
                continue
            all_layouts = [l for s, l in new_router.layouts() if s == server]
            _, tables = server_tables(store, new_router, server, all_layouts)
            with target.transaction(server) as conn:
                report.prepared[server] = create_tables(conn, tables)

        plan_add: list[tuple[str, str, ShardLayout]] = []
        plan_change: list[tuple[str, str, ShardLayout, ShardLayout | None]] = []
        for server, wanted in new_layouts.items():
            for area, layout in wanted.items():
                current = live.get(server, {}).get(area)
                if current is None:
                    plan_add.append((server, area, layout))
                elif current != layout:
                    plan_change.append((server, area, current, layout))
        for server, stamps in live.items():
            for area, current in stamps.items():
                if area in areas and area not in new_layouts.get(server, {}):
                    plan_change.append((server, area, current, None))

        undo: list[tuple[str, str, ShardLayout | None]] = []
        try:
            # 3. new stamps: nobody routes here yet
            for server, area, layout in plan_add:
                with target.transaction(server) as conn:
                    _write_stamp(conn, server, area, layout, new_map.version)
                undo.append((server, area, None))
                report.stamps.append(StampChange(server, area, "added", None, _fmt_layout(layout)))
            # 4./5. changed and removed stamps, each under the shard's layout lock
            for server, area, current, new_layout in plan_change:
                with target.transaction(server) as conn:
                    _lock_layout(conn, lock_timeout)
                    _shrink_check(store, conn, server, area, current, new_layout)
                    _write_stamp(conn, server, area, new_layout, new_map.version)
                undo.append((server, area, current))
                action: Literal["changed", "removed"] = "changed" if new_layout is not None else "removed"
                report.stamps.append(StampChange(server, area, action, _fmt_layout(current), _fmt_layout(new_layout)))
        except Exception as exc:
            problems = _undo(target, undo, old_map.version, lock_timeout)
            detail = str(exc) if isinstance(exc, MdbError) else f"{type(exc).__name__}: {dberrors.describe(exc)}"
            restored = "every stamp written so far was restored" if not problems else (
                "restoring stamps FAILED on: " + "; ".join(problems) + " (run the apply again to finish)"
            )
            raise MapEditError(f"map version {new_map.version} not applied: {detail}; {restored}") from exc

        # 6. publish
        server = _maps_server(new_map)
        with target.transaction(server) as conn:
            create_tables(conn, [maps_table])
            conn.execute(insert(maps_table).values(version=new_map.version, yaml=text))
        report.recorded_on = server
    finally:
        target.close()
    store.refresh()
    return report


def _undo(target: Store, undo: list[tuple[str, str, ShardLayout | None]], version: int, lock_timeout: float) -> list[str]:
    problems = []
    for server, area, previous in reversed(undo):
        try:
            with target.transaction(server) as conn:
                _lock_layout(conn, lock_timeout)
                _write_stamp(conn, server, area, previous, version)
        except Exception as exc:  # reported to the operator in the MapEditError, never dropped
            problems.append(f"server {server!r} area {area!r}: {exc}")
    return problems
