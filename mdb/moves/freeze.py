"""Freezing a partition's writes on its old shards for a reshard's final phase.

Why: between a reshard's last sweep and the moment the new map is in place, an application
process with the old map could still CREATE a briefcase on an old shard that the new map
routes elsewhere; it would be stranded (a new-map session would find an empty briefcase on the
new shard). The freeze closes that window. Every write session (SQL) or write context
(MongoDB) reads its partition's freeze marker in its ownership check (:mod:`mdb.ownership`,
:func:`mdb.mongo.shard_state.ownership_rows`); the freeze writes the marker on each old shard
through the shard's backend, which turns every later writer away with a retryable
``BriefcaseMovingError`` (the Store waits and retries, up to ``move_wait_seconds``). On
PostgreSQL the freeze first takes the partition's advisory key EXCLUSIVE, which every writer
holds SHARED from its BEGIN prelude, so it waits for the writers already inside; on SQLite
BEGIN IMMEDIATE serializes it with every writer; on MongoDB see docs/mongodb.md. Moves do not
run the session check, so the final sweep can still move stragglers while writes wait.
"""

from __future__ import annotations

from collections.abc import Iterable

from mdb.backends import backend_of
from mdb.cluster import Cluster
from mdb.faults import fault_point, register
from mdb.gdid import GDID

__all__ = ["freeze_partition", "frozen_by", "unfreeze_partition"]

DEFAULT_FREEZE_LOCK_WAIT = 30.0

FAULT_POINTS = register("reshard.during_freeze")


def freeze_partition(
    store: Cluster, area: str, start: GDID, servers: Iterable[str], reshard_id: str, *, lock_wait: float = DEFAULT_FREEZE_LOCK_WAIT
) -> None:
    """Stop writes of partition ``start`` on ``servers``, waiting for the writers already in; idempotent."""
    for n, server in enumerate(servers):
        backend_of(store.map, server).freeze_partition(store, server, area, start, reshard_id, lock_wait=lock_wait)
        if n == 0:
            fault_point("reshard.during_freeze")


def unfreeze_partition(store: Cluster, area: str, start: GDID, servers: Iterable[str]) -> int:
    """Let writes of partition ``start`` through again on ``servers``; idempotent. Returns markers removed."""
    return sum(backend_of(store.map, server).unfreeze_partition(store, server, area, start) for server in servers)


def frozen_by(store: Cluster, area: str, start: GDID, server: str) -> str | None:
    """The reshard id whose freeze of partition ``start`` is on ``server``, if any."""
    return backend_of(store.map, server).frozen_by(store, server, area, start)
