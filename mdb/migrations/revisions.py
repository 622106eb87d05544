"""The Alembic revision of an area on one server: read it, stamp it, and refuse a move across two.

Alembic keeps the revision a database is at in its version table; mdb gives every area its
own (``alembic_version_<area>``) because one server holds several areas (a spare holds every
area's tables, a CENTRAL shard may be a user shard too) and their histories are independent.
That table on each server is the truth a rerun after a crash relies on: nothing else records
which servers a rollout already did.

This module depends on SQLAlchemy and Alembic only (a connection in, a revision out), so the
move protocol and ``schema apply`` can call it without depending on the fleet runner.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import Column, MetaData, String, Table
from sqlalchemy.engine import Connection

from alembic.runtime.migration import MigrationContext
from mdb.dialects import sql_dialect
from mdb.errors import MigrationError
from mdb.system_tables import MIGRATION_VERSION_PREFIX, version_table

__all__ = [
    "SCHEMA_LOCK_KEY",
    "current_revision",
    "lock_out_migrations",
    "lock_out_moves",
    "require_one_revision",
    "stamp_revision",
    "version_table",
]

VERSION_TABLE_PREFIX = MIGRATION_VERSION_PREFIX
"""Every area's version table starts so (``schema check`` should not call these tables extra)."""


SCHEMA_LOCK_KEY = 0x6D64626D69677261  # "mdbmigra": one PostgreSQL advisory lock key per server
"""A migration holds it exclusive on a server, a move's copy shared: the two never overlap on one server."""


def _context(conn: Connection, area: str) -> MigrationContext:
    return MigrationContext.configure(conn, opts={"version_table": version_table(area)})


def current_revision(conn: Connection, area: str) -> str | None:
    """The revision ``area`` is at on ``conn``'s server; None when never migrated (no version table or no row).

    A history with several heads at once is refused: mdb rolls out one line of revisions (merge
    branches with ``alembic merge`` first), so "the revision of a server" is one value.
    """
    heads = _context(conn, area).get_current_heads()
    if len(heads) > 1:
        raise MigrationError(f"area {area!r} is at several revisions at once ({', '.join(heads)}): merge the branches first")
    return heads[0] if heads else None


def stamp_revision(conn: Connection, area: str, revision: str | None) -> None:
    """Record ``revision`` as the area's revision on ``conn``'s server without running a migration.

    For a server whose tables were just created from the models (``schema apply`` on a new or
    spare server): the models are the head of the history, so the server is at head already and
    running the history on it would add columns that exist.
    """
    if _context(conn, area).get_current_heads() == ((revision,) if revision else ()):
        return
    # The table as Alembic creates it (alembic.runtime.migration: version_num VARCHAR(32) primary key).
    table = Table(version_table(area), MetaData(), Column("version_num", String(32), primary_key=True, nullable=False))
    table.create(conn, checkfirst=True)
    conn.execute(table.delete())
    if revision is not None:
        conn.execute(table.insert().values(version_num=revision))


def require_one_revision(area: str, revisions: Mapping[str, str | None]) -> str | None:
    """Refuse (MigrationError) to copy ``area``'s tables between servers at different revisions.

    ``revisions`` maps each server a move or reshard reads or writes to the area's revision
    there (:func:`current_revision`). A move copies rows column for column: a target one
    revision behind lacks the new column (the copy fails halfway or drops data), one ahead has
    a NOT NULL column the source's rows do not fill. Returns the one revision they share. The
    fix is named: ``mdb migrate up``.
    """
    distinct = set(revisions.values())
    if len(distinct) > 1:
        at = ", ".join(f"{server!r} at {rev or 'base'}" for server, rev in revisions.items())
        raise MigrationError(
            f"area {area!r}: the servers of this move are at different revisions ({at}); a move needs them at one "
            f"revision (bring them to the same revision first: mdb migrate up MAP)"
        )
    return next(iter(distinct), None)


def lock_out_moves(conn: Connection, server: str) -> None:
    """Take the server's schema lock exclusive for this transaction, or refuse at once.

    Called by a migration before it changes a server's tables: a move copying into or out of
    the server holds the lock shared (:func:`lock_out_migrations`), and a copy running while a
    column appears would write rows of the old shape into the new table.
    """
    if not sql_dialect(conn).try_advisory_xact_lock(conn, SCHEMA_LOCK_KEY, shared=False):
        raise MigrationError(f"server {server!r}: a move is copying briefcases to or from it; migrate it after the move ends")


def lock_out_migrations(conn: Connection, server: str) -> None:
    """Take the server's schema lock shared for this transaction, or refuse at once.

    For a move's copy (on the source and on the target): several moves may run at once on one
    server, a migration may not run during any of them.
    """
    # SQLite has no advisory locks (always granted): one writer per file, so a migration's
    # transaction and a copy cannot overlap there.
    if not sql_dialect(conn).try_advisory_xact_lock(conn, SCHEMA_LOCK_KEY, shared=True):
        raise MigrationError(f"server {server!r}: a schema migration is running on it; move after it ends (mdb migrate status MAP)")
