"""The ownership check every briefcase session runs on its shard (DESIGN.md invariant 2).

A process routes with the map and relocations it has cached; that cache may be stale. So the
session asks the shard itself, inside the session's own transaction: "is this briefcase still
here?" (no fence, no unfinished incoming copy) and "do you own it under the layout I routed
with?" (area, partition start and end, shard index, shard count). On PostgreSQL the check is a
prelude sent with BEGIN in one simple-protocol string (see ``mdb.engines``), after a shared
advisory lock on the briefcase, so a move's exclusive lock makes new sessions wait and the
check, a later statement with a fresh snapshot, then sees the fence the move committed.
"""

from __future__ import annotations

from typing import Any

from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.gdid import GDID
from mdb.router import Placement
from mdb.system_tables import STATE_GONE, STATE_INCOMING, STATE_RESIDENT

__all__ = ["check_ownership", "lock_key_sql", "ownership_prelude"]


def _blob(backend: str, gdid: GDID) -> str:
    return f"'\\x{gdid.hex}'::bytea" if backend == "postgresql" else f"X'{gdid.hex}'"


def lock_key_sql(area: str, gdid: GDID) -> str:
    """SQL for the briefcase's advisory lock key (PostgreSQL); moves lock the same key.

    Area names are restricted by the map to a safe alphabet, so inlining them is safe.
    """
    return f"hashtextextended('{area}:{gdid.hex}', 0)"


def ownership_prelude(backend: str, placement: Placement, lock: bool) -> list[str]:
    """Statements to run right after BEGIN; the last one returns the row :func:`check_ownership` reads."""
    area = placement.area
    statements = []
    if lock and backend == "postgresql":
        statements.append(f"SELECT pg_advisory_xact_lock_shared({lock_key_sql(area, placement.gdid)})")
    statements.append(
        "SELECT l.partition_start, l.partition_end, l.shard_index, l.shard_count, s.state, s.peer "
        "FROM (SELECT 1 AS one) AS x "
        f"LEFT JOIN mdb_shard_layout AS l ON l.area = '{area}' "
        f"LEFT JOIN mdb_briefcase_state AS s ON s.area = '{area}' AND s.gdid = {_blob(backend, placement.gdid)}"
    )
    return statements


def _gdid(value: Any) -> GDID | None:
    return None if value is None else GDID.from_bytes(value)


def check_ownership(rows: list[tuple[Any, ...]] | None, placement: Placement, map_version: int) -> None:
    """Raise a retryable error unless the shard confirms it holds the briefcase as routed."""
    if not rows:
        raise RuntimeError("the ownership check returned no row; the BEGIN prelude did not run")
    start, end, index, count, state, peer = rows[0]
    what = f"briefcase {placement.area}/{placement.gdid} on server {placement.server!r}"
    if state == STATE_GONE:
        raise StaleRouteError(f"{what}: fenced, it moved to server {peer!r}")
    if state == STATE_INCOMING:
        raise BriefcaseMovingError(f"{what}: a move into this server is not finished yet")
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
