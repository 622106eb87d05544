"""The SQL backend: PostgreSQL and SQLite servers through SQLAlchemy (the default kind).

mdb's own records are tables here: the layout stamp (``mdb_shard_layout``), briefcase states
(``mdb_briefcase_state``) and, on CENTRAL servers, the relocation directory (``mdb_relocations``,
one row per relocated briefcase, sharded over the CENTRAL shards by the GDID's 12 bytes like
any CENTRAL key). The row-level functions take a connection so a caller can make them part of
a larger transaction (schema apply creates tables and stamps in one).
"""

from __future__ import annotations

from typing import ClassVar

from sqlalchemy import Column, DateTime, Sequence, String, Table, delete, func, insert, select, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.types import SchemaType, TypeDecorator

from mdb.backends.base import Backend, SchemaOutcome, Servers, ServerSchema
from mdb.errors import MdbError
from mdb.gdid import GDID
from mdb.ownership import install_pg_functions
from mdb.router import ShardLayout
from mdb.schema_diff import compare_tables
from mdb.sqltypes import GDIDType
from mdb.system_tables import central_metadata, shard_layout
from mdb.urls import SQL

__all__ = ["SqlBackend", "create_tables", "relocation_rows", "relocations", "stamp_layout", "write_relocation"]

relocations = Table(
    "mdb_relocations",
    central_metadata,
    Column("area", String(63), primary_key=True),
    Column("gdid", GDIDType, primary_key=True),
    Column("server", String(63), nullable=False),
    Column("changed_at", DateTime(timezone=True), nullable=False, server_default=func.current_timestamp()),
)


def relocation_rows(conn: Connection) -> dict[tuple[str, GDID], str]:
    """The directory entries on one CENTRAL shard: (area, gdid) -> server."""
    return {
        (area, gdid): server
        for area, gdid, server in conn.execute(select(relocations.c.area, relocations.c.gdid, relocations.c.server))
    }


def write_relocation(conn: Connection, area: str, gdid: GDID, target: str | None) -> None:
    """Upsert (or with ``target=None`` delete) one entry on the CENTRAL shard ``conn`` is on."""
    if target is None:
        conn.execute(delete(relocations).where(relocations.c.area == area, relocations.c.gdid == gdid))
        return
    changed = conn.execute(
        update(relocations)
        .where(relocations.c.area == area, relocations.c.gdid == gdid)
        .values(server=target, changed_at=func.current_timestamp())
    ).rowcount
    if not changed:
        conn.execute(insert(relocations).values(area=area, gdid=gdid, server=target))


def stamp_layout(conn: Connection, layout: ShardLayout, map_version: int, *, replace: bool) -> str | None:
    """Write the layout stamp for ``layout.area`` on ``conn``'s server; returns a problem text if refused."""
    row = conn.execute(select(shard_layout).where(shard_layout.c.area == layout.area)).mappings().first()
    values = dict(
        partition_start=layout.partition_start,
        partition_end=layout.partition_end,
        shard_index=layout.shard_index,
        shard_count=layout.shard_count,
        map_version=map_version,
    )
    if row is None:
        conn.execute(insert(shard_layout).values(area=layout.area, **values))
        return None
    current = (row["partition_start"], row["partition_end"], row["shard_index"], row["shard_count"])
    wanted = (layout.partition_start, layout.partition_end, layout.shard_index, layout.shard_count)
    if current == wanted:
        return None
    if not replace:
        return (
            f"area {layout.area!r} is stamped {current[0]}..{current[1] or 'open'} shard {current[2]} of {current[3]} "
            f"(map version {row['map_version']}) but this map says {wanted[0]}..{wanted[1] or 'open'} shard "
            f"{wanted[2]} of {wanted[3]}: a layout change is applied with `mdb map apply`"
        )
    conn.execute(shard_layout.update().where(shard_layout.c.area == layout.area).values(**values))
    return None


def create_tables(conn: Connection, tables: list[Table]) -> list[str]:
    """Create the missing ones of ``tables``; returns the names it created.

    The server's table names are read once; ``create_all`` then gets only the missing tables
    and asks the server nothing more (its ``checkfirst`` was one query per table, per shard)
    unless one of them creates a schema-level object of its own (an ENUM type, a sequence)
    that an existing table may have created already.
    """
    existing = set(sa_inspect(conn).get_table_names())
    missing = [t for t in tables if t.name not in existing]
    created = [t.name for t in missing]
    check = any(_creates_schema_objects(t) for t in missing)
    for metadata in {t.metadata for t in missing}:
        metadata.create_all(conn, tables=[t for t in missing if t.metadata is metadata], checkfirst=check)
    if conn.dialect.name == "postgresql":  # the ownership check behind a transaction pooler (docs/operations.md)
        install_pg_functions(conn)
    return created


def _creates_schema_objects(table: Table) -> bool:
    """Does creating ``table`` create a type or sequence besides it (which may exist already)?"""
    for column in table.columns:
        type_ = column.type
        if isinstance(type_, TypeDecorator):
            type_ = type_.impl_instance
        if isinstance(type_, SchemaType) or isinstance(column.default, Sequence):
            return True
    return False


class SqlBackend(Backend):
    """Servers reached through SQLAlchemy; every unit of work is one transaction on the server."""

    kind: ClassVar[str] = SQL

    def stamp_layout(
        self, cluster: Servers, server: str, layout: ShardLayout, map_version: int, *, replace: bool
    ) -> str | None:
        with cluster.transaction(server) as conn:
            return stamp_layout(conn, layout, map_version, replace=replace)

    def load_relocations(self, cluster: Servers, server: str) -> dict[tuple[str, GDID], str]:
        with cluster.transaction(server) as conn:
            return relocation_rows(conn)

    def set_relocation(self, cluster: Servers, server: str, area: str, gdid: GDID, target: str | None) -> None:
        with cluster.transaction(server) as conn:
            write_relocation(conn, area, gdid, target)

    def apply_schema(self, cluster: Servers, server: str, schema: ServerSchema) -> SchemaOutcome:
        outcome = SchemaOutcome()
        with cluster.transaction(server) as conn:
            outcome.created = create_tables(conn, schema.tables)
            already = set(conn.execute(select(shard_layout.c.area)).scalars())
            for layout in schema.layouts:
                outcome.record_stamp(layout.area, stamp_layout(conn, layout, schema.map_version, replace=False), already)
            outcome.differences = list(compare_tables(conn, schema.tables, known=schema.known_tables))
        return outcome

    def translate(self, cluster: Servers, server: str, exc: Exception) -> MdbError | None:
        # Store.transaction already turned driver errors into mdb errors naming the server.
        return exc if isinstance(exc, MdbError) else None
