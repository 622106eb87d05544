"""The fleet ledger: what each ``mdb migrate up|down`` run did, in CENTRAL (``mdb_migration_runs``).

The version table on each server says where that server *is*; it cannot say which run
brought it there, which servers a run never reached, or why one failed. One row per (run,
area, server) does: written ``pending`` for every server before the first one starts, then
``done`` / ``already`` / ``failed`` / ``not started`` as each finishes. A run killed halfway
leaves its unreached rows ``pending``: the operator sees where it stopped, and the rerun (a new
run id) upgrades exactly those servers, because it reads each version table again.

The table is on ``central_metadata`` like every other CENTRAL table and is created on demand
by the first run, so a fleet prepared before this feature needs no ``schema apply``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Column, DateTime, String, Table, Text, func, select
from sqlalchemy.engine import Connection

from mdb.system_tables import central_metadata

__all__ = ["LedgerRow", "finish", "last_run", "start"]

PENDING = "pending"

migration_runs = Table(
    "mdb_migration_runs",
    central_metadata,
    Column("run_id", String(36), primary_key=True),
    Column("area", String(63), primary_key=True),
    Column("server", String(63), primary_key=True),
    Column("direction", String(8), nullable=False),
    Column("target", String(64), nullable=True),
    Column("before", String(64), nullable=True),
    Column("outcome", String(16), nullable=False),
    Column("detail", Text, nullable=True),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
    Column("finished_at", DateTime(timezone=True), nullable=True),
)


@dataclass(frozen=True)
class LedgerRow:
    run_id: str
    area: str
    server: str
    direction: str
    target: str | None
    outcome: str
    detail: str | None


def start(conn: Connection, run_id: str, direction: str, rows: list[tuple[str, str, str | None]]) -> None:
    """Record a run about to start: one ``pending`` row per (area, server, target revision)."""
    migration_runs.create(conn, checkfirst=True)
    if rows:
        conn.execute(migration_runs.insert(), [
            {"run_id": run_id, "area": area, "server": server, "direction": direction, "target": target, "outcome": PENDING}
            for area, server, target in rows
        ])


def finish(conn: Connection, run_id: str, area: str, server: str, outcome: str, before: str | None, detail: str | None) -> None:
    """Record how one server of the run ended."""
    conn.execute(
        migration_runs.update()
        .where(migration_runs.c.run_id == run_id, migration_runs.c.area == area, migration_runs.c.server == server)
        .values(outcome=outcome, before=before, detail=detail, finished_at=func.current_timestamp())
    )


def last_run(conn: Connection) -> list[LedgerRow]:
    """The rows of the most recently started run (empty when no run was ever recorded)."""
    migration_runs.create(conn, checkfirst=True)
    newest = conn.execute(
        select(migration_runs.c.run_id).order_by(migration_runs.c.started_at.desc(), migration_runs.c.run_id.desc()).limit(1)
    ).scalar()
    if newest is None:
        return []
    rows = conn.execute(select(migration_runs).where(migration_runs.c.run_id == newest).order_by(migration_runs.c.area, migration_runs.c.server))
    return [LedgerRow(r.run_id, r.area, r.server, r.direction, r.target, r.outcome, r.detail) for r in rows]

