"""Applying a map version: stamping its layouts onto every shard, under a lock, with undo.

:func:`apply_map` is the only code that stamps a new layout onto shards (docs/design.md
invariant 4). It checks the new map against the newest applied one (:mod:`mdb.maps.history`)
with the live high-water marks (:mod:`mdb.maps.high_water`) through the pure diff
(:mod:`mdb.maps.diff`), writes nothing unless every change is accepted, and records the map
in CENTRAL so every Store picks it up on refresh. A tool: it opens a Store on the new map to
reach servers the old one does not name, and prepares their tables with :mod:`mdb.schema`.

Every SQL server of the new map must reach the database CENTRAL recorded for its name
(:mod:`mdb.maps.identity`); a URL that reaches another one is a refused change in the diff
(``server-identity``), so a dry run refuses it too. A real apply first gives the databases of
names CENTRAL never recorded an identity through the URLs of the map the system runs, so a
changed URL of such a server is compared with them; after the stamps, the names still
unrecorded (new servers) are recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import insert
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from mdb import dberrors
from mdb.backends import Backend, backend_of, servers_where
from mdb.backends.base import ServerSchema, documents_of
from mdb.backends.sql import lock_layout, write_layout
from mdb.cluster import Cluster
from mdb.errors import MapEditError, MdbError
from mdb.gdid import GDID
from mdb.maps.diff import MapDiff, diff_maps
from mdb.maps.diff import MapChange
from mdb.maps.high_water import high_water_marks, stored_high_water
from mdb.ownership import applying_mark
from mdb.maps.history import AppliedMap, maps_server, maps_table, newest_applied
from mdb.maps.identity import IdentityFinding, adopt, record_identities, recorded_identities, survey
from mdb.maps.text import recordable_yaml
from mdb.partition_map import PartitionMap, read_map_text
from mdb.router import Router, ShardLayout
from mdb.schema import create_tables, server_tables
from mdb.store import Store

__all__ = ["ApplyReport", "StampChange", "apply_map", "live_diff"]


@dataclass(frozen=True)
class StampChange:
    """One layout stamp the apply wrote, rewrote or deleted: what ``mdb map apply`` shows the operator."""

    server: str
    area: str
    action: Literal["added", "changed", "removed"]
    old: str | None
    new: str | None


@dataclass
class ApplyReport:
    """What an apply checked and changed (the diff, prepared servers, stamps, where the map was recorded)."""

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


def _has_identity(backend: Backend) -> bool:
    """Servers whose database carries an mdb identity (checked before an apply, recorded after)."""
    return backend.has_identity


def _end_shrinks(live: ShardLayout, new: ShardLayout | None) -> bool:
    """True when ``new`` ends the partition below where ``live`` ends (leaving the area is not shrinking)."""
    if new is None or new.partition_end is None:
        return False
    return live.partition_end is None or new.partition_end.sharding_value < live.partition_end.sharding_value


def _documents_for(target: Store, cluster: Cluster) -> None:
    """Give ``target`` the caller's MongoDB clients (its client factory and document types).

    The stamps of MongoDB servers are written through ``target``'s document side; one made
    afresh would reach the servers with the default driver, not the caller's (a test's fake).
    """
    if not servers_where(target.map, lambda b: b.holds_documents):
        return
    try:
        mine = documents_of(cluster)
    except TypeError:  # the caller has no document side to hand on
        return
    from mdb.mongo.store import MongoStore  # MongoDB is an optional plug-in, loaded for a map that has it

    if isinstance(mine, MongoStore):
        MongoStore.attach(target, client_factory=mine.clients.factory, types=mine.types, transactions=mine.clients.force_transactions)


def _prepare(target: Store, router: Router, server: str, layouts: list[ShardLayout], version: int) -> list[str]:
    """Create what a server new to the map, or new in a role, must hold; the tables or collections created.

    Its stamps are written by the apply's next steps, not here.
    """
    if backend_of(target.map, server).holds_documents:
        from mdb.mongo.schema import server_collections

        _, collections = server_collections(target.mongo, router, server, layouts)
        schema = ServerSchema([], version, collections=collections)
        return backend_of(target.map, server).apply_schema(target, server, schema).created
    _, tables = server_tables(target, router, server, layouts)
    with target.transaction(server) as conn:
        return create_tables(conn, tables)


def _shrink_check(cluster: Cluster, conn: Connection, server: str, area: str, live: ShardLayout, new: ShardLayout | None) -> None:
    """Under the lock: refuse when a GDID this shard stores would fall outside its new range."""
    if new is None or not _end_shrinks(live, new):
        return  # leaving the area happens only in a reshard, which moved the briefcases first
    existing = set(sa_inspect(conn).get_table_names())
    cols = [bt.key_column(bt.tables[0]) for bt in cluster.types_of(area) if bt.tables[0].name in existing]
    top = stored_high_water(conn, cols)
    assert new.partition_end is not None
    if top is not None and top >= new.partition_end.sharding_value:
        raise MapEditError(
            f"server {server!r} stores GDID {GDID.from_sharding_value(top)} of area {area!r}, at or above the new partition end "
            f"{new.partition_end} (written after the high-water mark was read): choose a start above it"
        )


def _identity_change(f: IdentityFinding) -> MapChange | None:
    """A diff row for a server whose URL may not be trusted (refused) or cannot be confirmed (accepted, said so)."""
    if f.verdict == "unreachable" and f.error is not None:
        raise f.error  # a down server stops the apply before anything changes, as step 1 always did
    if f.verdict not in ("refused", "unconfirmed"):
        return None
    old = None if f.recorded is None else f"{f.recorded.identity or 'no identity'} at {f.recorded.url}"
    new = f"{f.live or 'no identity'} at {f.url}"
    return MapChange("server-identity", f"server {f.server}", old, new, f.verdict != "refused", f.problem or "")


def _with_identities(diff: MapDiff, cluster: Cluster, new_map: PartitionMap) -> MapDiff:
    """``diff`` plus a refused ``server-identity`` change for each SQL server of ``new_map`` whose URL
    reaches a database other than the one CENTRAL recorded (or its old URL reaches)."""
    target = Store(new_map, types=[])
    try:
        findings = survey(cluster, target, servers_where(new_map, _has_identity), old=cluster)
    finally:
        target.close()
    rows = [c for c in map(_identity_change, findings) if c is not None]
    return diff if not rows else MapDiff(diff.old_version, diff.new_version, (*diff.changes, *rows), diff.high_water)


def _live_diff(
    cluster: Cluster, new_map: PartitionMap, allow_reshard_of: tuple[str, GDID] | None, margin: int
) -> tuple[MapDiff, PartitionMap, AppliedMap | None]:
    cluster.refresh()
    old_applied = newest_applied(cluster)
    old_map = old_applied.parse(cluster.map) if old_applied else cluster.map
    relocated_to = {server for _, server in cluster.router.relocation_reach}
    marks = high_water_marks(cluster, margin=margin)
    diff = diff_maps(old_map, new_map, marks, allow_reshard_of=allow_reshard_of, relocated_to=relocated_to)
    return _with_identities(diff, cluster, new_map), old_map, old_applied


def _adopt_running(cluster: Cluster, new_map: PartitionMap) -> None:
    """Give the databases of the names CENTRAL never recorded an identity, through the map the system
    runs, and record them: a changed URL of such a server is then checked like any other."""
    cluster.refresh()
    records = recorded_identities(cluster)
    names = [s for s in servers_where(cluster.map, _has_identity) if s in new_map.servers and s not in records]
    moving = {s for s in names if cluster.map.servers[s].primary != new_map.servers[s].primary}
    adopted = adopt(cluster, [s for s in names if s not in moving])  # a down server stops the apply, as step 1 would
    for name in moving:
        try:
            adopted.update(adopt(cluster, [name]))
        except (MdbError, DBAPIError):  # its old address is gone: the diff shows the new URL as not confirmed, and why
            continue
    record_identities(cluster, adopted)


def live_diff(
    cluster: Cluster, new_map: PartitionMap, *, allow_reshard_of: tuple[str, GDID] | None = None, margin: int = 0
) -> MapDiff:
    """``diff_maps`` from the newest applied map (else the cluster's) to ``new_map``, with live marks.

    What ``apply_map`` checks first; never raises for a refused change (see ``MapDiff.ok``).
    """
    return _live_diff(cluster, new_map.resolved_in(cluster.map.folder), allow_reshard_of, margin)[0]


def apply_map(
    cluster: Cluster,
    new_map: PartitionMap,
    *,
    yaml_text: str | None = None,
    allow_reshard_of: tuple[str, GDID] | None = None,
    margin: int = 0,
    lock_timeout: float = 10.0,
    dry_run: bool = False,
) -> ApplyReport:
    """Validate ``new_map`` against the live system and stamp it onto every shard, safely.

    The old side is the newest map recorded in CENTRAL (else the cluster's own map). Nothing is
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
       new range (GDIDs written since the marks were read). Each such shard first gets the
       apply's marker (:func:`mdb.ownership.applying_mark`, not in a reshard's own apply, whose
       freeze markers do this): an old process that meets the new stamp waits and re-reads the
       map until step 6 instead of failing with StaleRouteError; it cannot write to the wrong
       shard either way. The markers are removed after step 6.
    5. Stamps of servers that leave an area (a reshard) are deleted the same way.
    6. The map text is recorded in CENTRAL; refreshing Stores adopt it (retrying processes
       that met a new stamp in steps 4-5 succeed from here on).

    ``dry_run`` does every check (refusing like a real run) and returns before step 1.

    A failure in steps 3-5 restores every stamp already written (tables created stay; they
    are empty) and raises MapEditError. A crash between 4 and 6 leaves old processes refused
    (retryably) for the changed ranges, never misrouted; running the apply again finishes it.
    """
    # A map given as text (a reshard's) has relative SQLite paths; they mean what the Store's do.
    new_map = new_map.resolved_in(cluster.map.folder)
    if not dry_run:
        _adopt_running(cluster, new_map)
    diff, old_map, old_applied = _live_diff(cluster, new_map, allow_reshard_of, margin)
    report = ApplyReport(old_map.version, new_map.version, diff)
    diff.raise_if_refused()
    known = [old_applied.yaml] if old_applied else []
    if cluster.map_path is not None and Path(cluster.map_path).is_file():
        known.append(read_map_text(cluster.map_path))
    text = recordable_yaml(new_map, yaml_text, known)
    if dry_run:
        return report

    target = Store(new_map, types=cluster.types)
    try:
        _documents_for(target, cluster)
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
            live[server] = backend_of(new_map, server).read_layouts(target, server)
        areas = set(new_router.area_names())

        # 2. tables on new servers and servers with a new role
        for server in new_map.servers:
            new_roles = set(new_layouts.get(server, {}))
            if server in new_router.central_servers():
                new_roles.add(new_map.central_area)
            if server in old_map.servers and new_roles <= old_roles.get(server, set()):
                continue
            all_layouts = [layout for s, layout in new_router.layouts() if s == server]
            report.prepared[server] = _prepare(target, new_router, server, all_layouts, new_map.version)

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

        unchecked = [(s, a) for s, a, current, new in plan_change if _end_shrinks(current, new) and not backend_of(new_map, s).rechecks_shrink]
        if unchecked:  # its stored GDIDs cannot be re-checked under a lock that holds off writers
            raise MapEditError(
                f"map version {new_map.version} not applied: it shrinks the partition end of {unchecked[0][1]!r} on "
                f"{backend_of(new_map, unchecked[0][0]).kind} server {unchecked[0][0]!r}, which only SQL shards support; nothing was written"
            )
        undo: list[tuple[str, str, ShardLayout | None]] = []
        # A plain apply marks the shards whose stamp changes until the map is published: a session
        # with the old map that meets a new stamp meanwhile waits and re-reads the map instead of
        # failing with StaleRouteError (a reshard's own apply has its freeze markers for that).
        marked = sorted({server for server, *_ in plan_change}) if allow_reshard_of is None else []
        try:
            for server, area, current, _ in plan_change if marked else []:
                backend_of(new_map, server).mark_applying(target, server, area, current.partition_start, applying_mark(new_map.version))
            # 3. new stamps: nobody routes here yet
            for server, area, layout in plan_add:
                problem = backend_of(new_map, server).stamp_layout(target, server, layout, new_map.version, replace=True)
                if problem:  # replace=True never refuses; a problem here is a bug, not an operator error
                    raise MapEditError(f"server {server!r}: {problem}")
                undo.append((server, area, None))
                report.stamps.append(StampChange(server, area, "added", None, _fmt_layout(layout)))
            # 4./5. changed and removed stamps, each under the shard's layout lock
            for server, area, current, new_layout in plan_change:
                if _end_shrinks(current, new_layout):  # SQL only (refused above on other kinds)
                    with target.transaction(server) as conn:
                        lock_layout(conn, lock_timeout)
                        _shrink_check(cluster, conn, server, area, current, new_layout)
                        write_layout(conn, server, area, new_layout, new_map.version)
                else:
                    backend_of(new_map, server).replace_layout(
                        target, server, area, new_layout, new_map.version, lock_timeout=lock_timeout
                    )
                undo.append((server, area, current))
                action: Literal["changed", "removed"] = "changed" if new_layout is not None else "removed"
                report.stamps.append(StampChange(server, area, action, _fmt_layout(current), _fmt_layout(new_layout)))
        except Exception as exc:
            problems = _undo(target, undo, old_map.version, lock_timeout) + _clear_marks(target, marked)
            detail = str(exc) if isinstance(exc, MdbError) else f"{type(exc).__name__}: {dberrors.describe(exc)}"
            restored = "every stamp written so far was restored" if not problems else (
                "restoring stamps FAILED on: " + "; ".join(problems) + " (run the apply again to finish)"
            )
            raise MapEditError(f"map version {new_map.version} not applied: {detail}; {restored}") from exc

        # the identities of the servers CENTRAL has no record of yet (new ones), recorded before publishing
        records = recorded_identities(cluster)
        record_identities(cluster, adopt(target, [s for s in servers_where(new_map, _has_identity) if s not in records]))

        # 6. publish
        server = maps_server(new_map)
        with target.transaction(server) as conn:
            create_tables(conn, [maps_table])
            conn.execute(insert(maps_table).values(version=new_map.version, yaml=text))
        report.recorded_on = server
        left = _clear_marks(target, marked)
        if left:
            raise MapEditError(f"map version {new_map.version} is applied and published, but removing its markers failed on "
                               f"{'; '.join(left)}: they turn no session away, and the next apply that changes a stamp there removes them")
    finally:
        target.close()
    cluster.refresh()
    return report


def _clear_marks(target: Cluster, servers: list[str]) -> list[str]:
    """Remove the apply's markers (:func:`mdb.ownership.applying_mark`) from ``servers``; the problems, one per server."""
    problems = []
    for server in servers:
        try:
            backend_of(target.map, server).clear_applying(target, server)
        except Exception as exc:  # reported to the operator in the MapEditError, never dropped
            problems.append(f"server {server!r}: {exc}")
    return problems


def _undo(target: Cluster, undo: list[tuple[str, str, ShardLayout | None]], version: int, lock_timeout: float) -> list[str]:
    problems = []
    for server, area, previous in reversed(undo):
        try:
            backend_of(target.map, server).replace_layout(target, server, area, previous, version, lock_timeout=lock_timeout)
        except Exception as exc:  # reported to the operator in the MapEditError, never dropped
            problems.append(f"server {server!r} area {area!r}: {exc}")
    return problems
