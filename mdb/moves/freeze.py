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

A freeze that cannot get the partition's lock within ``lock_wait`` (a write session held open,
e.g. idle in transaction) raises :class:`~mdb.errors.LockTimeoutError` naming the server and the
sessions holding the lock: retryable, and nothing is frozen on that server. The caller (the
reshard) unfreezes the servers frozen before it, so a failed freeze never leaves writes refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from mdb.backends import backend_of
from mdb.cluster import Cluster
from mdb.dberrors import describe, is_lock_timeout
from mdb.errors import LockTimeoutError, MdbError
from mdb.faults import fault_point, register
from mdb.gdid import GDID
from mdb.ownership import freeze_holder, freeze_mark, partition_lock_key_sql

__all__ = ["freeze_partition", "frozen_by", "unfreeze_partition"]

DEFAULT_FREEZE_LOCK_WAIT = 30.0

FAULT_POINTS = register("reshard.during_freeze")


def freeze_partition(
    store: Cluster, area: str, start: GDID, servers: Iterable[str], reshard_id: str, *, lock_wait: float = DEFAULT_FREEZE_LOCK_WAIT,
    new_shards: Sequence[str] | None = None,
) -> None:
    """Stop writes of partition ``start`` on ``servers``, waiting for the writers already in; idempotent.

    ``new_shards``: the partition's new shard list; each marker then lets through the writes of
    the briefcases that stay on its server under it (:func:`mdb.ownership.freeze_mark`), so only
    writes of briefcases still to move wait. Without it every write of the partition waits.
    Servers are frozen one after another; on an error the ones before stay frozen (the caller
    unfreezes them all). A lock wait past ``lock_wait`` is a :class:`LockTimeoutError`.
    """
    for n, server in enumerate(servers):
        mark = freeze_mark(reshard_id, new_shards, server)
        try:
            backend_of(store.map, server).freeze_partition(store, server, area, start, mark, lock_wait=lock_wait)
        except DBAPIError as exc:
            if not is_lock_timeout(exc):
                raise
            raise LockTimeoutError(
                f"reshard {reshard_id}: freezing partition {start} of area {area!r} on server {server!r} waited "
                f"{lock_wait:g} s for the partition's lock ({describe(exc)}); {lock_holders(store, server, area, start)} "
                "(end that session or transaction, then `mdb moves resume MAP`)",
                server=server,
            ) from None
        if n == 0:
            fault_point("reshard.during_freeze")


_HOLDERS_SQL = """
WITH k AS (SELECT {key} AS key)
SELECT a.pid, a.usename, a.application_name, host(a.client_addr), a.state,
       extract(epoch FROM now() - a.xact_start)
FROM k, pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid
  AND l.pid <> pg_backend_pid()
ORDER BY a.xact_start
"""


def lock_holders(store: Cluster, server: str, area: str, start: GDID) -> str:
    """Who holds partition ``start``'s advisory lock on PostgreSQL ``server``, in words for an error line.

    The sessions (pid, user, application, client, state, how long their transaction has been
    open) an operator must end for the freeze to get the lock; asked after the wait failed, so
    it may already be empty. A failure to ask is said, never raised over the error it explains.
    """
    try:
        with store.transaction(server, readonly=True) as conn:
            rows = conn.execute(text(_HOLDERS_SQL.format(key=partition_lock_key_sql(area, start)))).all()
    except (MdbError, DBAPIError) as exc:
        return f"the sessions holding it could not be listed ({describe(exc) if isinstance(exc, DBAPIError) else exc})"
    if not rows:
        return "no session holds it any more"
    sessions = []
    for pid, user, application, client, state, age in rows[:5]:
        where = f", client {client}" if client else ""
        app = f", application {application!r}" if application else ""
        open_for = f", transaction open {float(age):.0f} s" if age is not None else ""
        sessions.append(f"pid {pid} (user {user}{app}{where}, {state}{open_for})")
    more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
    return f"held by session{'s' if len(rows) > 1 else ''} {', '.join(sessions)}{more}"


def unfreeze_partition(store: Cluster, area: str, start: GDID, servers: Iterable[str]) -> int:
    """Let writes of partition ``start`` through again on ``servers``; idempotent. Returns markers removed."""
    return sum(backend_of(store.map, server).unfreeze_partition(store, server, area, start) for server in servers)


def frozen_by(store: Cluster, area: str, start: GDID, server: str) -> str | None:
    """The reshard id whose freeze of partition ``start`` is on ``server``, if any."""
    mark = backend_of(store.map, server).frozen_by(store, server, area, start)
    return None if mark is None else freeze_holder(mark)
