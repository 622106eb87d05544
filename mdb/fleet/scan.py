"""What the fleet tools read of a server, for every server kind: its backend's :class:`~mdb.backends.base.AreaScan`.

:func:`area_data` says where an area's briefcases live (the SQL tables of its briefcase types,
the collections of its document types); :func:`scan_of` hands a server's scan out from the
server's backend, so balance, fsck and rebalance never branch on SQL or MongoDB for reading.
Every scan streams (bounded memory on large shards).
"""

from __future__ import annotations

from mdb.backends import backend_of, servers_where
from mdb.backends.base import AreaData, AreaScan, BriefcaseSize, documents_of
from mdb.cluster import Cluster
from mdb.errors import RoutingError
from mdb.mongo.store import MongoStore
from mdb.mongo.types import DocumentBriefcaseType

__all__ = ["AreaData", "BriefcaseSize", "area_data", "area_servers", "document_types", "holds_area", "scan_of"]


def document_types(store: Cluster, area: str) -> list[type[DocumentBriefcaseType]]:
    """The document briefcase types of ``area`` registered with the Store's MongoDB side.

    None for an area without MongoDB servers (the Store's MongoDB side is then not even created)
    or a cluster without one.
    """
    if not servers_where(store.map, lambda b: b.holds_documents, store.router.area_servers(area)):
        return []
    try:
        mongo = documents_of(store)
    except TypeError:  # a cluster without a document side
        return []
    return mongo.types_of(area) if isinstance(mongo, MongoStore) else []


def area_data(store: Cluster, area: str) -> AreaData:
    """The tables (with key columns) and collections (with key fields) of ``area``'s declared types.

    Raises :class:`~mdb.errors.RoutingError` when neither a briefcase type nor a document type
    of the area is registered (nothing to scan for).
    """
    tables = []
    for btype in store.types_of(area):  # parents before children, as the move machinery orders them
        mine = set(btype.tables)
        tables += [(t, btype.key) for t in btype.tables[0].metadata.sorted_tables if t in mine]
    collections = [(name, dtype.key) for dtype in document_types(store, area) for name in dtype.collections]
    if not tables and not collections:
        raise RoutingError(f"no briefcase type of area {area!r} is registered (list its module under models: in the map)")
    return AreaData(area, tables, collections)


def scan_of(store: Cluster, server: str, data: AreaData) -> AreaScan:
    """``server``'s scan of ``data``, from the backend of the server's kind."""
    return backend_of(store.map, server).scan(store, server, data)


def holds_area(store: Cluster, server: str, data: AreaData) -> bool:
    """Whether ``server`` has any table (collection) of ``data``: a server without them holds none of the area.

    A server of another kind than the area's data holds none of it either. One catalog read.
    """
    return backend_of(store.map, server).holds_area(store, server, data)


def area_servers(store: Cluster, area: str, data: AreaData | None = None) -> list[str]:
    """Every server that can hold ``area``'s briefcases, in map order: its layout, then relocation
    targets outside it, then every other server the map names that has the area's tables
    (spares, servers a reshard took out of the layout, shards of other areas built with every
    area's tables). Without ``data`` only the layout and the relocation targets (no I/O).
    """
    out = list(dict.fromkeys(store.router.area_servers(area)))
    for a, server in sorted(store.router.relocation_reach, key=lambda key: key[1]):
        if a == area and server not in out:
            out.append(server)
    if data is not None:
        out += [s for s in store.map.servers if s not in out and holds_area(store, s, data)]
    return out
