"""The ownership check every briefcase session runs on its shard (docs/design.md invariant 2).

A process routes with the map and relocations it has cached; that cache may be stale. So the
session asks the shard itself, inside the session's own transaction: "is this briefcase still
here?" (no fence, no unfinished incoming copy) and "do you own it under the layout I routed
with?" (area, partition start and end, shard index, shard count). On PostgreSQL the check is a
prelude sent with BEGIN in one simple-protocol string (see ``mdb.engines``), as ``EXECUTE`` of
statements prepared once per pooled connection (:data:`PG_PREPARED`), after a shared
advisory lock on the briefcase, so a move's exclusive lock makes new sessions wait and the
check, a later statement with a fresh snapshot, then sees the fence the move committed.

Write sessions also take a SHARED advisory lock on their partition (:func:`partition_lock_key_sql`)
and read the partition's freeze marker (a state row ``frozen`` under the zero GDID, which is
never a briefcase): a reshard's final phase takes that key EXCLUSIVE on each old shard, which
waits for in-flight writers, and commits the marker, which turns new writers away with a
retryable :class:`BriefcaseMovingError` until the new map is in place (see docs/moves.md).
Read-only sessions ignore the marker: reads cannot strand a briefcase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mdb.engines import Prelude
from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.gdid import GDID
from mdb.router import Placement
from mdb.system_tables import STATE_FROZEN, STATE_GONE, STATE_INCOMING, STATE_RESIDENT

__all__ = ["FREEZE_GDID", "check_ownership", "lock_key_sql", "ownership_prelude", "partition_lock_key_sql"]

FREEZE_GDID = GDID(0, 0, 0)
"""The state-row key of a partition freeze marker: the zero GDID is never a briefcase."""


def _pg_bytea(gdid: GDID) -> str:
    return f"'\\x{gdid.hex}'::bytea"


def _lock_key(area: str, gdid: GDID) -> str:
    return f"{area}:{gdid.hex}"


def _partition_lock_key(area: str, partition_start: GDID) -> str:
    # ``#`` cannot occur in an area name, so this never equals a briefcase key's text.
    return f"{area}#partition:{partition_start.hex}"


def lock_key_sql(area: str, gdid: GDID) -> str:
    """SQL for the briefcase's advisory lock key (PostgreSQL); moves lock the same key.

    Area names are restricted by the map to a safe alphabet, so inlining them is safe.
    """
    return f"hashtextextended('{_lock_key(area, gdid)}', 0)"


def partition_lock_key_sql(area: str, partition_start: GDID) -> str:
    """SQL for a partition's advisory lock key (PostgreSQL); a reshard's freeze locks it EXCLUSIVE."""
    return f"hashtextextended('{_partition_lock_key(area, partition_start)}', 0)"


def _check_sql(area: str, gdid: str, frozen_peer: str | None, freeze_gdid: str) -> str:
    """The check query; the arguments are SQL (literals or ``$n`` parameters).

    ``frozen_peer`` is None for read sessions: they ignore the freeze marker.
    """
    frozen, freeze_join = "NULL", ""
    if frozen_peer is not None:
        frozen = "f.move_id"
        freeze_join = (
            f" LEFT JOIN mdb_briefcase_state AS f ON f.area = {area} AND f.gdid = {freeze_gdid} "
            f"AND f.state = '{STATE_FROZEN}' AND f.peer = {frozen_peer}"
        )
    return (
        f"SELECT l.partition_start, l.partition_end, l.shard_index, l.shard_count, s.state, s.peer, {frozen} "
        "FROM (SELECT 1 AS one) AS x "
        f"LEFT JOIN mdb_shard_layout AS l ON l.area = {area} "
        f"LEFT JOIN mdb_briefcase_state AS s ON s.area = {area} AND s.gdid = {gdid}" + freeze_join
    )


_PG_FREEZE = _pg_bytea(FREEZE_GDID)
_PG_CHECKS: dict[str, tuple[str, Callable[..., str]]] = {
    "mdb_ownership_lock": (
        "text, text",
        lambda partition_key, briefcase_key: f"SELECT pg_advisory_xact_lock_shared(hashtextextended({partition_key}, 0)), "
        f"pg_advisory_xact_lock_shared(hashtextextended({briefcase_key}, 0))",
    ),
    "mdb_ownership_read": ("text, bytea", lambda area, gdid: _check_sql(area, gdid, None, _PG_FREEZE)),
    "mdb_ownership_write": ("text, bytea, text", lambda area, gdid, start: _check_sql(area, gdid, start, _PG_FREEZE)),
}
"""The PostgreSQL check statements: name -> (argument types, query from its arguments as SQL).

One definition, two renderings (:func:`_pg_statement`): prepared once per connection and run as
``EXECUTE``, or inline with literals behind a transaction-pooling pooler."""

PG_PREPARED: dict[str, str] = {
    name: f"({types}) AS " + query(*(f"${n}" for n in range(1, types.count(",") + 2)))
    for name, (types, query) in _PG_CHECKS.items()
}
"""The check as server-side prepared statements (name -> ``(argument types) AS query``).

Parsing and planning the check per session cost more than the whole BEGIN round trip; prepared
once per pooled connection, a session only sends ``EXECUTE`` with its literals.
"""


def _pg_statement(name: str, args: tuple[str, ...], inline: bool) -> str:
    """``EXECUTE name(args)``, or the statement itself with ``args`` inlined; args are SQL literals."""
    return _PG_CHECKS[name][1](*args) if inline else f"EXECUTE {name}({', '.join(args)})"


def _pg_prelude_statements(placement: Placement, lock: bool, inline: bool) -> tuple[str, ...]:
    area, start = placement.area, placement.partition_start
    statements = []
    if lock:
        keys = (f"'{_partition_lock_key(area, start)}'", f"'{_lock_key(area, placement.gdid)}'")
        statements.append(_pg_statement("mdb_ownership_lock", keys, inline))
    gdid = _pg_bytea(placement.gdid)
    if lock:
        statements.append(_pg_statement("mdb_ownership_write", (f"'{area}'", gdid, f"'{start}'"), inline))
    else:
        statements.append(_pg_statement("mdb_ownership_read", (f"'{area}'", gdid), inline))
    return tuple(statements)


_SQLITE_READ = _check_sql(":area", ":gdid", None, ":freeze")
_SQLITE_WRITE = _check_sql(":area", ":gdid", ":start", ":freeze")
"""The check on SQLite, with named parameters (a write session's also reads the freeze marker)."""


def ownership_prelude(backend: str, placement: Placement, lock: bool) -> Prelude:
    """Statements to run right after BEGIN; the last one returns the row :func:`check_ownership` reads.

    ``lock`` (write sessions): take the partition's and the briefcase's advisory keys SHARED
    first, and read the partition's freeze marker. The lock is its own statement, before the
    check, so that the check's snapshot is taken after any wait for a move's exclusive lock.
    """
    if backend == "postgresql":
        # Both renderings: the engine sends the inline one when it is behind a transaction
        # pooler (mdb.engines), where a statement prepared in one transaction's server session
        # is not there in the next one's.
        return Prelude(
            _pg_prelude_statements(placement, lock, inline=False), PG_PREPARED,
            inline=_pg_prelude_statements(placement, lock, inline=True),
        )
    area, start = placement.area, placement.partition_start
    # SQLite: BEGIN IMMEDIATE already serializes write sessions with a reshard's freeze. The
    # check is one text per kind with named parameters, so sqlite3's statement cache parses it
    # once per connection; with the values inlined every briefcase was a new text (24 µs per
    # check instead of 9, measured).
    params: dict[str, Any] = {"area": area, "gdid": bytes(placement.gdid), "freeze": bytes(FREEZE_GDID)}
    if lock:
        params["start"] = str(start)
    return Prelude((_SQLITE_WRITE if lock else _SQLITE_READ,), params=params)


def _gdid(value: Any) -> GDID | None:
    return None if value is None else GDID.from_bytes(value)


def check_ownership(rows: list[tuple[Any, ...]] | None, placement: Placement, map_version: int) -> None:
    """Raise a retryable error unless the shard confirms it holds the briefcase as routed."""
    if not rows:
        raise RuntimeError("the ownership check returned no row; the BEGIN prelude did not run")
    start, end, index, count, state, peer, *rest = rows[0]
    frozen_by = rest[0] if rest else None
    what = f"briefcase {placement.area}/{placement.gdid} on server {placement.server!r}"
    if state == STATE_GONE:
        raise StaleRouteError(f"{what}: fenced, it moved to server {peer!r}")
    if state == STATE_INCOMING:
        raise BriefcaseMovingError(f"{what}: a move into this server is not finished yet")
    if frozen_by is not None:
        raise BriefcaseMovingError(f"{what}: partition {placement.partition_start} is frozen for writes by reshard {frozen_by}")
    if placement.relocated:
        if state != STATE_RESIDENT:
            raise StaleRouteError(f"{what}: the relocation directory points here but the server holds no resident record")
        return
    if start is None:
        raise StaleRouteError(
            f"{what}: the server carries no layout stamp for area {placement.area!r} (run `mdb schema apply`)"
        )
    stamped = (_gdid(start), _gdid(end), int(index), int(count))
    expected = (placement.partition_start, placement.partition_end, placement.shard_index, placement.shard_count)
    if stamped != expected:
        def fmt(t: tuple[Any, ...]) -> str:
            return f"partition [{t[0]}, {t[1] or 'open'}) shard {t[2]} of {t[3]}"

        raise StaleRouteError(
            f"{what}: the server is stamped {fmt(stamped)} but map version {map_version} routed it to {fmt(expected)}"
        )
