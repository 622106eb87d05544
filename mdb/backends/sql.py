"""The SQL backend: PostgreSQL and SQLite servers through SQLAlchemy (the default kind).

mdb's own records are tables here: the layout stamp (``mdb_shard_layout``), briefcase states
(``mdb_briefcase_state``) and, on CENTRAL servers, the relocation directory (``mdb_relocations``,
one row per relocated briefcase, sharded over the CENTRAL shards by the GDID's 12 bytes like
any CENTRAL key). The row-level functions take a connection so a caller can make them part of
a larger transaction (schema apply creates tables and stamps in one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from sqlalchemy import Column, DateTime, Sequence, String, Table, and_, delete, func, insert, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import SchemaType, TypeDecorator

from mdb.backends.base import AreaData, AreaScan, Backend, BriefcaseStateRow, Holding, SchemaOutcome, Servers, ServerSchema
from mdb.errors import MapEditError, MdbError
from mdb.gdid import GDID
from mdb.ownership import APPLYING_PREFIX, FREEZE_GDID, install_pg_functions, install_sqlite_check_version, partition_lock_key_sql
from mdb.router import Reach, ShardLayout
from mdb.schema_diff import compare_tables
from mdb.sqltypes import GDIDType
from mdb.system_tables import STATE_FROZEN, STATE_RESIDENT, briefcase_state, central_metadata, shard_layout
from mdb.urls import SQL

__all__ = [
    "SqlBackend", "create_tables", "lock_layout", "read_layouts", "relocation_reach", "relocation_rows", "relocations", "stamp_layout",
    "write_layout", "write_relocations",
]

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


def relocation_reach(conn: Connection) -> dict[tuple[str, str], Reach]:
    """The directory on one CENTRAL shard summed up per (area, target server): one aggregate query.

    Grouped by the GDID's authority too: within one authority the 12 bytes sort like the
    sharding value (era, counter), so MIN and MAX of the bytes give the group's lowest and highest
    sharding value exactly; at most 16 rows per (area, server), whatever the number of entries.
    """
    # as hex text (PostgreSQL has no MIN/MAX of bytea): sorts like the bytes on both dialects
    hexed = func.lower(func.encode(relocations.c.gdid, "hex") if conn.dialect.name == "postgresql" else func.hex(relocations.c.gdid))
    authority = func.substr(hexed, 9, 1)
    out: dict[tuple[str, str], Reach] = {}
    query = (select(relocations.c.area, relocations.c.server, func.count(), func.min(hexed), func.max(hexed))
             .group_by(relocations.c.area, relocations.c.server, authority))
    for area, server, count, low, high in conn.execute(query):
        reach = Reach(count, GDID.from_bytes(bytes.fromhex(low)).sharding_value, GDID.from_bytes(bytes.fromhex(high)).sharding_value)
        seen = out.get((area, server))
        out[(area, server)] = reach if seen is None else seen.merge(reach)
    return out


def write_relocations(conn: Connection, area: str, targets: Mapping[GDID, str | None]) -> None:
    """Replace (or with a None target delete) entries on the CENTRAL shard ``conn`` is on.

    Set-based, two statements whatever the number: a batched cutover records hundreds of
    briefcases at once. The caller's transaction makes delete and insert one change; no other
    writer touches these entries meanwhile (only a move of the briefcase does, and the briefcase
    is locked by its move).
    """
    gdids = list(targets)
    for i in range(0, len(gdids), 1000):
        chunk = gdids[i : i + 1000]
        conn.execute(delete(relocations).where(relocations.c.area == area, relocations.c.gdid.in_(chunk)))
        rows = [{"area": area, "gdid": g, "server": targets[g]} for g in chunk if targets[g] is not None]
        if rows:
            conn.execute(insert(relocations), rows)


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
    elif conn.dialect.name == "sqlite":  # the version the ownership check's kept rows are checked against
        install_sqlite_check_version(conn)
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


def _freeze_marker(area: str, start: GDID) -> ColumnElement[bool]:
    """The freeze marker of partition ``start``: a 'frozen' state row under the zero GDID, the partition in ``peer``."""
    return and_(
        briefcase_state.c.area == area, briefcase_state.c.gdid == FREEZE_GDID,
        briefcase_state.c.state == STATE_FROZEN, briefcase_state.c.peer == str(start),
    )


def read_layouts(conn: Connection) -> dict[str, ShardLayout]:
    """The layout stamps on ``conn``'s server, by area (none before ``mdb schema apply`` made the table)."""
    if not sa_inspect(conn).has_table(shard_layout.name):
        return {}
    rows = conn.execute(select(shard_layout)).mappings()
    return {
        r["area"]: ShardLayout(r["area"], r["partition_start"], r["partition_end"], r["shard_index"], r["shard_count"])
        for r in rows
    }


def lock_layout(conn: Connection, lock_timeout: float) -> None:
    """Wait for every in-flight session on this shard, and hold off new ones until commit.

    Every session reads ``mdb_shard_layout`` in its ownership check, so on PostgreSQL it holds
    ACCESS SHARE on that table until it ends: ACCESS EXCLUSIVE waits for all of them and
    blocks the checks of new ones, which after our commit read the new stamp. On SQLite the
    transaction's BEGIN IMMEDIATE already serializes us with every writer.
    """
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'")
        conn.exec_driver_sql(f"LOCK TABLE {shard_layout.name} IN ACCESS EXCLUSIVE MODE")


def write_layout(conn: Connection, server: str, area: str, layout: ShardLayout | None, map_version: int) -> None:
    """Overwrite (or with None delete) the stamp of ``area`` on ``conn``'s server."""
    if layout is None:
        conn.execute(delete(shard_layout).where(shard_layout.c.area == area))
        return
    problem = stamp_layout(conn, layout, map_version, replace=True)
    if problem:  # replace=True never refuses; a problem here is a bug, not an operator error
        raise MapEditError(f"server {server!r}: {problem}")


class SqlBackend(Backend):
    """Servers reached through SQLAlchemy; every unit of work is one transaction on the server."""

    kind: ClassVar[str] = SQL
    follows_histories = keeps_records = has_identity = checks_drift = rechecks_shrink = takes_lease_fences = True
    pools_connections = batches_cutovers = replicas_on_engines = True

    def stamp_layout(
        self, cluster: Servers, server: str, layout: ShardLayout, map_version: int, *, replace: bool
    ) -> str | None:
        with cluster.transaction(server) as conn:
            return stamp_layout(conn, layout, map_version, replace=replace)

    def load_relocations(self, cluster: Servers, server: str) -> dict[tuple[str, GDID], str]:
        with cluster.transaction(server) as conn:
            return relocation_rows(conn)

    def relocation_of(self, cluster: Servers, server: str, area: str, gdid: GDID) -> str | None:
        with cluster.transaction(server) as conn:
            query = select(relocations.c.server).where(relocations.c.area == area, relocations.c.gdid == gdid)
            found: str | None = conn.execute(query).scalar_one_or_none()
            return found

    def relocation_reach(self, cluster: Servers, server: str) -> dict[tuple[str, str], Reach]:
        with cluster.transaction(server) as conn:
            return relocation_reach(conn)

    def set_relocations(self, cluster: Servers, server: str, area: str, targets: Mapping[GDID, str | None]) -> None:
        with cluster.transaction(server) as conn:
            write_relocations(conn, area, targets)

    def apply_schema(self, cluster: Servers, server: str, schema: ServerSchema) -> SchemaOutcome:
        outcome = SchemaOutcome()
        with cluster.transaction(server) as conn:
            outcome.created = create_tables(conn, schema.tables)
            already = set(conn.execute(select(shard_layout.c.area)).scalars())
            for layout in schema.layouts:
                outcome.record_stamp(layout.area, stamp_layout(conn, layout, schema.map_version, replace=False), already)
            outcome.differences = list(compare_tables(conn, schema.tables, known=schema.known_tables))
        return outcome

    def scan(self, cluster: Servers, server: str, data: AreaData) -> AreaScan:
        from mdb.backends.sqlscan import SqlAreaScan  # the fleet tools' reads, loaded when a tool runs

        return SqlAreaScan(cluster, server, data)

    def holds_area(self, cluster: Servers, server: str, data: AreaData) -> bool:
        if not data.tables:
            return False
        with cluster.transaction(server) as conn:
            present = set(sa_inspect(conn).get_table_names())
        return any(table.name in present for table, _ in data.tables)

    def holding(self, cluster: Servers, server: str, data: AreaData, gdid: GDID) -> Holding:
        from mdb.backends.sqlscan import briefcase_rows  # the fleet tools' reads, loaded when a tool runs

        with cluster.transaction(server) as conn:
            present = set(sa_inspect(conn).get_table_names())
            rows = briefcase_rows(conn, [(t, k) for t, k in data.tables if t.name in present], gdid)
            state = None
            if briefcase_state.name in present:
                row = conn.execute(select(briefcase_state).where(
                    briefcase_state.c.area == data.area, briefcase_state.c.gdid == gdid)).mappings().first()
                if row is not None:
                    state = BriefcaseStateRow(gdid, row["state"], row["peer"], row["move_id"], row["changed_at"])
        return Holding(rows, state)

    def translate(self, cluster: Servers, server: str, exc: Exception) -> MdbError | None:
        # Store.transaction already turned driver errors into mdb errors naming the server.
        return exc if isinstance(exc, MdbError) else None

    # -- resharding

    def freeze_partition(
        self, cluster: Servers, server: str, area: str, start: GDID, reshard_id: str, *, lock_wait: float
    ) -> None:
        # The partition's advisory key EXCLUSIVE waits for the writers inside (they hold it
        # SHARED from their BEGIN prelude); the committed marker turns later ones away. On
        # SQLite the transaction's BEGIN IMMEDIATE serializes it with every writer instead.
        with cluster.transaction(server) as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(1, int(lock_wait * 1000))}ms'")
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({partition_lock_key_sql(area, start)})")
            conn.execute(delete(briefcase_state).where(briefcase_state.c.area == area, briefcase_state.c.gdid == FREEZE_GDID))
            conn.execute(insert(briefcase_state).values(
                area=area, gdid=FREEZE_GDID, state=STATE_FROZEN, peer=str(start), move_id=reshard_id
            ))

    def unfreeze_partition(self, cluster: Servers, server: str, area: str, start: GDID) -> int:
        with cluster.transaction(server) as conn:
            return int(conn.execute(delete(briefcase_state).where(_freeze_marker(area, start))).rowcount)

    def mark_applying(self, cluster: Servers, server: str, area: str, start: GDID, mark: str) -> bool:
        with cluster.transaction(server) as conn:
            held = briefcase_state.c.area == area, briefcase_state.c.gdid == FREEZE_GDID
            if conn.execute(select(briefcase_state.c.move_id).where(*held)).first() is not None:
                return False
            conn.execute(insert(briefcase_state).values(area=area, gdid=FREEZE_GDID, state=STATE_FROZEN, peer=str(start), move_id=mark))
            return True

    def clear_applying(self, cluster: Servers, server: str) -> int:
        with cluster.transaction(server) as conn:
            return int(conn.execute(delete(briefcase_state).where(
                briefcase_state.c.gdid == FREEZE_GDID, briefcase_state.c.state == STATE_FROZEN,
                briefcase_state.c.move_id.startswith(APPLYING_PREFIX, autoescape=True),
            )).rowcount)

    def frozen_by(self, cluster: Servers, server: str, area: str, start: GDID) -> str | None:
        with cluster.transaction(server) as conn:
            found: str | None = conn.execute(select(briefcase_state.c.move_id).where(_freeze_marker(area, start))).scalar_one_or_none()
            return found

    def drop_residents(self, cluster: Servers, server: str, area: str, redundant: Callable[[GDID], bool]) -> int:
        resident = and_(briefcase_state.c.area == area, briefcase_state.c.state == STATE_RESIDENT)
        with cluster.transaction(server) as conn:
            gdids = [g for g in conn.execute(select(briefcase_state.c.gdid).where(resident)).scalars() if redundant(g)]
            for i in range(0, len(gdids), 1000):  # a reshard leaves one per briefcase it moved: set-based, like the relocations
                conn.execute(delete(briefcase_state).where(resident, briefcase_state.c.gdid.in_(gdids[i : i + 1000])))
        return len(gdids)

    def read_layouts(self, cluster: Servers, server: str) -> dict[str, ShardLayout]:
        with cluster.transaction(server) as conn:
            return read_layouts(conn)

    def replace_layout(
        self, cluster: Servers, server: str, area: str, layout: ShardLayout | None, map_version: int, *, lock_timeout: float
    ) -> None:
        with cluster.transaction(server) as conn:
            lock_layout(conn, lock_timeout)
            write_layout(conn, server, area, layout, map_version)
