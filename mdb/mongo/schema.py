"""``mdb schema apply`` on MongoDB servers: which collections and indexes a server holds.

:func:`mdb.schema.apply_schema` asks this module what a MongoDB server must hold and hands the
result to the server's backend (:class:`mdb.backends.mongo.MongoBackend`), which creates what
is missing and writes the first layout stamps. The rules mirror the SQL ones: every MongoDB
server gets mdb's shard collections, CENTRAL servers the CENTRAL collections, each server its
areas' document collections (a spare server every area's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mdb.backends.base import CollectionSpec, IndexSpec
from mdb.backends.mongo import LAYOUT
from mdb.mongo.hot import COUNTERS, STATS_LOCK
from mdb.mongo.shard_state import GUARD, STATE
from mdb.router import Router, ShardLayout

if TYPE_CHECKING:
    from mdb.mongo.store import MongoStore

__all__ = ["server_collections"]


def server_collections(
    mongo: MongoStore, router: Router, server: str, layouts: list[ShardLayout]
) -> tuple[list[str], list[CollectionSpec]]:
    """(roles, collections) of one MongoDB server under ``router``'s map, in creation order."""
    from mdb.mongo.central import central_collections

    is_central = server in router.central_servers()
    areas = [layout.area for layout in layouts]
    roles = (["central"] if is_central else []) + areas
    if not roles:
        roles.append("spare")
        areas = router.area_names()
    dtypes = [dtype for area in areas for dtype in mongo.types_of(area)]
    # hot-data documents are found by briefcase key (and moved with it)
    collections = [
        CollectionSpec(LAYOUT),
        CollectionSpec(STATE, [IndexSpec([("area", 1), ("state", 1)], "mdb_area_state")]),
        CollectionSpec(GUARD),
        CollectionSpec(COUNTERS, [IndexSpec([(d.key, 1), ("counter", 1)], f"mdb_{d.key}_counter") for d in dtypes]),
        CollectionSpec(STATS_LOCK, [
            IndexSpec([(d.key, 1), ("event_id", 1), ("state", 1)], f"mdb_{d.key}_event") for d in dtypes
        ]),
    ]
    if is_central:
        collections += central_collections()
    for dtype in dtypes:
        for coll in dtype.collections:
            indexes = [IndexSpec(list(i.keys), i.index_name, i.unique, dict(i.options)) for i in dtype.indexes_of(coll)]
            collections.append(CollectionSpec(coll, indexes))
    return roles, collections
