"""The relocation directory: which briefcases live somewhere other than their default shard.

Kept in CENTRAL, one row per relocated briefcase, sharded over the CENTRAL shards by the
GDID's 12 bytes like any CENTRAL key. Stores load the whole directory into their router and
reload it when a session meets a fence; correctness never depends on that copy being fresh,
because every session checks ownership on the shard itself (docs/design.md invariant 2).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import Column, DateTime, String, Table, delete, func, insert, select, update
from sqlalchemy.engine import Connection

from mdb.gdid import GDID
from mdb.sqltypes import GDIDType
from mdb.system_tables import central_metadata

__all__ = ["clear_relocation", "load_relocations", "relocations", "set_relocation"]

relocations = Table(
    "mdb_relocations",
    central_metadata,
    Column("area", String(63), primary_key=True),
    Column("gdid", GDIDType, primary_key=True),
    Column("server", String(63), nullable=False),
    Column("changed_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)


def load_relocations(conn: Connection) -> Mapping[tuple[str, GDID], str]:
    """The directory entries on one CENTRAL shard: (area, gdid) -> server."""
    return {
        (area, gdid): server
        for area, gdid, server in conn.execute(select(relocations.c.area, relocations.c.gdid, relocations.c.server))
    }


def set_relocation(conn: Connection, area: str, gdid: GDID, server: str) -> None:
    """Upsert one entry on the CENTRAL shard that owns ``gdid`` (the caller picks ``conn``)."""
    changed = conn.execute(
        update(relocations)
        .where(relocations.c.area == area, relocations.c.gdid == gdid)
        .values(server=server, changed_at=func.current_timestamp())
    ).rowcount
    if not changed:
        conn.execute(insert(relocations).values(area=area, gdid=gdid, server=server))


def clear_relocation(conn: Connection, area: str, gdid: GDID) -> None:
    conn.execute(delete(relocations).where(relocations.c.area == area, relocations.c.gdid == gdid))
