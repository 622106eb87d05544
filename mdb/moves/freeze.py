"""Freezing a partition's writes on its old shards for a reshard's final phase.

Why: between a reshard's last sweep and the moment the new map is in place, an application
process with the old map could still CREATE a briefcase on an old shard that the new map
routes elsewhere; it would be stranded (a new-map session would find an empty briefcase on the
new shard). The freeze closes that window. Every write session takes its partition's advisory
key SHARED in its BEGIN prelude and reads the freeze marker (:mod:`mdb.ownership`); the freeze
takes the key EXCLUSIVE on each old shard, which waits for the writers already inside, and
commits the marker, which turns every later writer away with a retryable
``BriefcaseMovingError`` (the Store waits and retries, up to ``move_wait_seconds``). Moves do
not run the session check, so the final sweep can still move stragglers while writes wait.
On SQLite the freezing transaction's BEGIN IMMEDIATE serializes it with every writer instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import and_, delete, insert, select

from mdb.cluster import Cluster
from mdb.gdid import GDID
from mdb.faults import fault_point, register
from mdb.ownership import FREEZE_GDID, partition_lock_key_sql
from mdb.system_tables import STATE_FROZEN, briefcase_state

__all__ = ["freeze_partition", "frozen_by", "unfreeze_partition"]

DEFAULT_FREEZE_LOCK_WAIT = 30.0

FAULT_POINTS = register("reshard.during_freeze")


def _marker(area: str, start: GDID) -> Any:
    return and_(
        briefcase_state.c.area == area, briefcase_state.c.gdid == FREEZE_GDID,
        briefcase_state.c.state == STATE_FROZEN, briefcase_state.c.peer == str(start),
    )


def freeze_partition(
    store: Cluster, area: str, start: GDID, servers: Iterable[str], reshard_id: str, *, lock_wait: float = DEFAULT_FREEZE_LOCK_WAIT
) -> None:
    """Stop writes of partition ``start`` on ``servers``, waiting for the writers already in; idempotent."""
    for n, server in enumerate(servers):
        with store.transaction(server) as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, int(lock_wait * 1000))}ms'")
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({partition_lock_key_sql(area, start)})")
            conn.execute(delete(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == FREEZE_GDID))
            conn.execute(insert(briefcase_state).values(
                area=area, gdid=FREEZE_GDID, state=STATE_FROZEN, peer=str(start), move_id=reshard_id
            ))
        if n == 0:
            fault_point("reshard.during_freeze")


def unfreeze_partition(store: Cluster, area: str, start: GDID, servers: Iterable[str]) -> int:
    """Let writes of partition ``start`` through again on ``servers``; idempotent. Returns markers removed."""
    removed = 0
    for server in servers:
        with store.transaction(server) as conn:
            removed += conn.execute(delete(briefcase_state).where(_marker(area, start))).rowcount
    return removed


def frozen_by(store: Cluster, area: str, start: GDID, server: str) -> str | None:
    """The reshard id whose freeze of partition ``start`` is on ``server``, if any."""
    with store.transaction(server) as conn:
        return conn.execute(select(briefcase_state.c.move_id).where(_marker(area, start))).scalar_one_or_none()
