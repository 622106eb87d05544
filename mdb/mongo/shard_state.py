"""mdb's own collections on every MongoDB shard: the layout stamp, briefcase states, move guards.

The same records as the SQL ``mdb_shard_layout`` / ``mdb_briefcase_state`` tables (same field
names, GDIDs as their 12 bytes), so the ownership decision is :func:`mdb.ownership.check_ownership`
itself, fed a row of the same shape. ``mdb_briefcase_guard`` replaces PostgreSQL's advisory
lock: a move sets ``locked_by`` on the source, and every write session increments the guard in
its own transaction, so a session in flight when the move locks conflicts with it (one of the
two transactions is retried) and every later session sees the lock and waits.
"""

from __future__ import annotations

import random
from typing import Any, Final

from mdb.backends.mongo import LAYOUT, STATE, freeze_id, state_id
from mdb.errors import BriefcaseMovingError
from mdb.gdid import GDID
from mdb.router import Placement
from mdb.system_tables import STATE_FROZEN, STATE_GONE, STATE_INCOMING

__all__ = [
    "GUARD",
    "LAYOUT",
    "STATE",
    "check_guard",
    "guard_ids",
    "set_guard",
    "excluded_gdids",
    "ownership_rows",
    "state_id",
]

GUARD: Final = "mdb_briefcase_guard"
SYSTEM_COLLECTIONS: Final = (LAYOUT, STATE, GUARD)


def ownership_rows(db: Any, placement: Placement, session: Any = None) -> list[tuple[Any, ...]]:
    """The one row :func:`mdb.ownership.check_ownership` reads, from this shard's documents.

    The briefcase's state and its partition's freeze marker come in one query. A write context
    meets the freeze (while a reshard has the partition frozen here, the check raises the
    retryable ``BriefcaseMovingError`` and the context waits, as a SQL session does); every
    context, readers too, uses it to tell a reshard's map apply (the shard re-stamped before the
    new map is published: a bounded wait and a map re-read) from a stale route (ADR 0012).
    """
    layout = db[LAYOUT].find_one({"_id": placement.area}, session=session) or {}
    own = state_id(placement.area, placement.gdid)
    marker = freeze_id(placement.area, placement.partition_start)
    found = {d["_id"]: d for d in db[STATE].find({"_id": {"$in": [own, marker]}}, session=session)}
    state, frozen = found.get(own, {}), found.get(marker)
    return [
        (
            layout.get("partition_start"),
            layout.get("partition_end"),
            layout.get("shard_index"),
            layout.get("shard_count"),
            state.get("state"),
            state.get("peer"),
            frozen.get("move_id") if frozen is not None and frozen.get("state") == STATE_FROZEN else None,
        )
    ]


GUARD_SLOTS: Final = 16
"""Guard documents per briefcase: writers bump one at random (two writers collide with
probability 1/16), a move locks all of them (so it conflicts with every writer in flight)."""


def guard_ids(area: str, gdid: GDID) -> list[str]:
    base = state_id(area, gdid)
    return [f"{base}:{slot:02d}" for slot in range(GUARD_SLOTS)]


def check_guard(db: Any, placement: Placement, session: Any) -> None:
    """A write session's guard: bump one guard slot; raise BriefcaseMovingError while a move holds the briefcase.

    On a transactional server the bump is part of the session's transaction, so a move that
    locks the guard (writing every slot) conflicts with any session still in flight.
    """
    import pymongo

    slot = random.randrange(GUARD_SLOTS)
    guard = db[GUARD].find_one_and_update(
        {"_id": guard_ids(placement.area, placement.gdid)[slot]},
        {"$inc": {"writes": 1}, "$setOnInsert": {"area": placement.area, "gdid": bytes(placement.gdid)}},
        upsert=True, return_document=pymongo.ReturnDocument.AFTER, session=session,
    )
    if guard and guard.get("locked_by"):
        raise BriefcaseMovingError(
            f"briefcase {placement.area}/{placement.gdid} on server {placement.server!r}: "
            f"move {guard['locked_by']} holds it (new sessions wait for its commit point)"
        )


def set_guard(db: Any, area: str, gdid: GDID, move_id: str | None, session: Any = None) -> None:
    """Lock (``move_id``) or unlock (None) every guard slot of a briefcase."""
    for gid in guard_ids(area, gdid):
        db[GUARD].update_one(
            {"_id": gid}, {"$set": {"locked_by": move_id, "area": area, "gdid": bytes(gdid)}}, upsert=True, session=session
        )


def excluded_gdids(db: Any, area: str) -> list[bytes]:
    """Briefcases whose documents here are not authoritative: incoming copies and fenced leftovers."""
    docs = db[STATE].find({"area": area, "state": {"$in": [STATE_INCOMING, STATE_GONE]}}, {"gdid": 1})
    return [d["gdid"] for d in docs]
