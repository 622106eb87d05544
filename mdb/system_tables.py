"""mdb's own tables.

``shard_metadata`` lives on every server: the ownership stamp each session checks
(``mdb_shard_layout``) and the per-briefcase exceptions to default routing
(``mdb_briefcase_state``: fences, incoming copies, relocated residents). ``central_metadata``
lives on the CENTRAL shards only. Tables defined elsewhere join them: the server identity
(``mdb_server_identity``, on every server, and CENTRAL's record of it, ``mdb_server_ids``, both
in :mod:`mdb.maps.identity`). Feature modules (GDID sequences, indexes, the relocation
directory, the move journal) define their tables on it, and :func:`load_system_tables`
imports them so that ``mdb schema apply`` creates every one of them.
"""

from __future__ import annotations

import importlib
from typing import Final

from sqlalchemy import BigInteger, Column, DateTime, Integer, MetaData, String, Table, func

from mdb.sqltypes import GDIDType

__all__ = [
    "CHECK_VERSION_TABLE",
    "lease_fences",
    "on_demand_metadata",
    "CENTRAL_TABLE_MODULES",
    "MIGRATION_VERSION_PREFIX",
    "STATE_FROZEN",
    "STATE_GONE",
    "STATE_INCOMING",
    "STATE_RESIDENT",
    "briefcase_state",
    "central_metadata",
    "load_system_tables",
    "shard_layout",
    "version_table",
    "shard_metadata",
]

shard_metadata = MetaData()
central_metadata = MetaData()
on_demand_metadata = MetaData()
"""Tables mdb creates where and when it first needs them, on any server (shard or CENTRAL): known, never "extra"."""

lease_fences = Table(
    "mdb_lease_fences",
    on_demand_metadata,
    # The newest epoch of each move lease this server has seen (mdb.moves.fencing: a lease is not a fence).
    Column("lease_id", String(64), primary_key=True),
    Column("epoch", BigInteger, nullable=False),
)

shard_layout = Table(
    "mdb_shard_layout",
    shard_metadata,
    Column("area", String(63), primary_key=True),
    Column("partition_start", GDIDType, nullable=False),
    # Exclusive end of the partition (next start or next breakpoint); NULL = open-ended. A new
    # partition above the high-water mark bounds the old last one, and the end in the stamp
    # makes a process still holding the old map notice.
    Column("partition_end", GDIDType, nullable=True),
    Column("shard_index", Integer, nullable=False),
    Column("shard_count", Integer, nullable=False),
    Column("map_version", Integer, nullable=False),
    Column("stamped_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)

STATE_GONE: Final = "gone"
"""Fence: the briefcase left this shard for ``peer``. Written at a move's commit point."""
STATE_INCOMING: Final = "incoming"
"""A copy is being made here by move ``move_id``; not authoritative until the move finalizes."""
STATE_RESIDENT: Final = "resident"
"""The briefcase lives here although the map's default shard is another one (a relocation)."""
STATE_FROZEN: Final = "frozen"
"""Under the zero GDID, ``peer`` = a partition start: write sessions of that partition wait (a reshard's final phase)."""

briefcase_state = Table(
    "mdb_briefcase_state",
    shard_metadata,
    Column("area", String(63), primary_key=True),
    Column("gdid", GDIDType, primary_key=True),
    Column("state", String(16), nullable=False),
    Column("peer", String(63), nullable=True),
    Column("move_id", String(64), nullable=True),
    Column("changed_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)

CHECK_VERSION_TABLE: Final = "mdb_check_version"
"""SQLite: one row whose ``token`` changes with every change to the tables the check reads.

Triggers on ``mdb_shard_layout`` and ``mdb_briefcase_state`` set it to a new random value in the
transaction of the change, whatever wrote it (a move, ``mdb map apply``, fsck, an older mdb, a
person at the ``sqlite3`` prompt). So the check's rows read under one token are the rows any
later transaction that reads the same token would read: a session reads the token, inside its
transaction, and takes the rows kept for it (:mod:`mdb.ownership`), which is still the check on the
shard, in the session's transaction. Random rather than a counter: a file restored from a copy
and written again cannot come back to a token it had with other contents."""

CENTRAL_TABLE_MODULES: Final[tuple[str, ...]] = (
    "mdb.backends.sql",
    "mdb.maps.history",
    "mdb.maps.identity",
    "mdb.idgen",
    "mdb.central.indexes",
    "mdb.moves.journal",
    "mdb.moves.history",
    "mdb.hot.central_tables",
    "mdb.migrations.ledger",
)
"""Modules that define tables on ``central_metadata``; add yours here."""


def load_system_tables() -> tuple[MetaData, MetaData]:
    """Import every module that defines system tables, then return (shard, central) metadata."""
    for module in CENTRAL_TABLE_MODULES:
        importlib.import_module(module)
    return shard_metadata, central_metadata


MIGRATION_VERSION_PREFIX: Final = "alembic_version_"


def version_table(area: str) -> str:
    """The name of ``area``'s Alembic version table (``mdb migrate``): one per area, so areas on one server never share one."""
    return MIGRATION_VERSION_PREFIX + area
