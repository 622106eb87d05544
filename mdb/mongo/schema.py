"""``mdb schema apply`` on MongoDB servers: collections, indexes and the first layout stamp.

Called by :func:`mdb.schema.apply_schema` for every server whose URL is ``mongodb://``; it
mirrors the SQL rules: every MongoDB server gets mdb's shard collections, CENTRAL servers the
CENTRAL collections, each server its areas' document collections (a spare server every
area's), and a layout stamp where it has none. Creating an index that exists is a no-op.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mdb.mongo.hot import COUNTERS, STATS_LOCK
from mdb.backends.mongo import LAYOUT, stamp_layout
from mdb.mongo.shard_state import GUARD, STATE
from mdb.router import Router, ShardLayout

if TYPE_CHECKING:
    from mdb.mongo.store import MongoStore
    from mdb.schema import ShardReport

__all__ = ["apply_mongo_server"]


def _ensure(db: Any, name: str, existing: set[str], created: list[str]) -> Any:
    if name not in existing:
        db.create_collection(name)
        existing.add(name)
        created.append(name)
    return db[name]


def apply_mongo_server(mongo: MongoStore, router: Router, server: str, layouts: list[ShardLayout], report: ShardReport) -> None:
    """Prepare one MongoDB server; fills ``report`` (roles, created, stamped, kept, problems)."""
    from mdb.mongo.central import ensure_central_collections

    pmap = mongo.store.map
    db = mongo.database(server)
    is_central = server in router.central_servers()
    areas = [l.area for l in layouts]
    report.roles = (["central"] if is_central else []) + areas
    if not report.roles:
        report.roles.append("spare")
        areas = router.area_names()
    existing = set(db.list_collection_names())
    created: list[str] = []
    for name in (LAYOUT, STATE, GUARD, COUNTERS, STATS_LOCK):
        _ensure(db, name, existing, created)
    db[STATE].create_index([("area", 1), ("state", 1)], name="mdb_area_state")
    for area in areas:  # hot-data documents are found by briefcase key (and moved with it)
        for dtype in mongo.types_of(area):
            db[COUNTERS].create_index([(dtype.key, 1), ("counter", 1)], name=f"mdb_{dtype.key}_counter")
            db[STATS_LOCK].create_index([(dtype.key, 1), ("event_id", 1), ("state", 1)], name=f"mdb_{dtype.key}_event")
    if is_central:
        ensure_central_collections(db, existing, created)
    for area in areas:
        for dtype in mongo.types_of(area):
            for coll in dtype.collections:
                handle = _ensure(db, coll, existing, created)
                for index in dtype.indexes_of(coll):
                    handle.create_index(list(index.keys), name=index.index_name, unique=index.unique, **dict(index.options))
    report.created = created
    stamped = {d["_id"] for d in db[LAYOUT].find({}, {"_id": 1})}
    for layout in layouts:
        problem = stamp_layout(db, layout, pmap.version, replace=False)
        if problem:
            report.problems.append(problem)
        else:
            (report.kept if layout.area in stamped else report.stamped).append(layout.area)
