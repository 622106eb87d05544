"""The applied-map history in CENTRAL (``mdb_maps``): which map versions the system runs.

:func:`mdb.maps.apply.apply_map` records each map it stamps here, as written (``${NAME}``
references not expanded, so no secret is stored); every Store adopts the newest one on refresh
(:func:`load_applied_map`), so a map change reaches all processes without a file being copied
around. The history lives on one CENTRAL server, chosen like any CENTRAL key (:data:`MAPS_KEY`),
and only on SQL CENTRAL servers. This module reads through :class:`mdb.cluster.Cluster` and sits
below the Store, which calls it on every refresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import Column, DateTime, Integer, Table, Text, func, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import DBAPIError

from mdb.backends import backend_of
from mdb.cluster import Cluster
from mdb.dberrors import translated
from mdb.partition_map import PartitionMap, parse_map, sqlite_file
from mdb.router import Router
from mdb.system_tables import central_metadata

__all__ = [
    "AppliedMap",
    "applied_maps",
    "load_applied_map",
    "maps_server",
    "maps_table",
    "newest_applied",
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


@dataclass(frozen=True)
class AppliedMap:
    """One row of the history: a map version as it was recorded, and where."""

    version: int
    yaml: str
    applied_at: datetime | None
    server: str

    def parse(self, current: PartitionMap) -> PartitionMap:
        """This text as a map; relative SQLite paths resolve like ``current``'s did."""
        return parse_map(self.yaml, f"mdb_maps version {self.version} on server {self.server!r}", folder=current.folder)


def maps_server(pmap: PartitionMap) -> str:
    """The CENTRAL server of ``pmap`` that holds the history."""
    return Router(pmap).locate_central(MAPS_KEY).server


def _no_history_there(pmap: PartitionMap, server: str) -> bool:
    """True when ``server`` cannot hold a map history: a MongoDB CENTRAL (history is kept on
    SQL CENTRAL servers only), or a SQLite file that does not exist yet (asking would create
    an empty database file, and its folder, as a side effect of a read-only command)."""
    return not backend_of(pmap, server).keeps_records or _sqlite_file_missing(pmap, server)


def _sqlite_file_missing(pmap: PartitionMap, server: str) -> bool:
    """True when ``server`` is a SQLite file that does not exist: connecting would create it."""
    database = sqlite_file(pmap.servers[server].primary)
    return database is not None and not Path(database).exists()


def newest_applied(cluster: Cluster, pmap: PartitionMap | None = None, *, newer_than: int = 0) -> AppliedMap | None:
    """The newest map ``mdb map apply`` recorded in CENTRAL (version and text as written), if any.

    The history is looked up on the CENTRAL servers of ``pmap`` (default: the cluster's map);
    only versions above ``newer_than`` count.
    """
    pmap = cluster.map if pmap is None else pmap
    server = maps_server(pmap)
    if _no_history_there(pmap, server):
        return None
    query = (
        select(maps_table.c.version, maps_table.c.yaml, maps_table.c.applied_at)
        .where(maps_table.c.version > newer_than)
        .order_by(maps_table.c.version.desc())
        .limit(1)
    )
    with translated(server):
        conn = cluster.begin(server)  # not connect(): a connection that died in a restart is replaced
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


def load_applied_map(cluster: Cluster, current: PartitionMap) -> PartitionMap | None:
    """The newest map recorded by ``apply_map`` in CENTRAL if newer than ``current``, else None.

    Called by ``Store.refresh``; ``${NAME}`` references expand from this process's environment.
    """
    applied = newest_applied(cluster, current, newer_than=current.version)
    if applied is None:
        return None
    return applied.parse(current)


def applied_maps(cluster: Cluster) -> list[tuple[int, datetime | None]]:
    """(version, applied_at) of every map recorded in CENTRAL, oldest first."""
    server = maps_server(cluster.map)
    if _no_history_there(cluster.map, server):
        return []
    with cluster.transaction(server) as conn:
        if not sa_inspect(conn).has_table(maps_table.name):
            return []
        return [(v, t) for v, t in conn.execute(select(maps_table.c.version, maps_table.c.applied_at).order_by(maps_table.c.version))]
