"""The SQL side of :class:`~mdb.backends.base.AreaScan`: an area's briefcases on one PostgreSQL or SQLite server.

Per-briefcase figures are one grouped query per table, each read with a server-side cursor
(``yield_per``) and merged by key (GDID byte order = SQL byte order), so a shard's keys are never
all in memory at once. Bytes are the rows' own sizes (PostgreSQL ``pg_column_size`` of each
row, elsewhere the sum of column lengths), the same figure ``mdb move --dry-run`` shows: what a
move of that briefcase carries, unlike relation sizes, which keep dead rows until VACUUM.
Storage bytes are PostgreSQL relation sizes (incl. indexes and TOAST) or SQLite ``dbstat`` pages.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Table, func, literal_column, select, text
from sqlalchemy.engine import Connection

from mdb.backends.base import AreaData, AreaScan, BriefcaseSize, BriefcaseStateRow, Servers
from mdb.gdid import GDID
from mdb.system_tables import briefcase_state

__all__ = ["STREAM_BATCH", "SqlAreaScan", "briefcase_rows", "briefcase_sizes"]

STREAM_BATCH = 1000
"""Rows fetched from the server at a time by the streaming cursors."""


def _postgres(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql"


def _row_size(conn: Connection, table: Table) -> Any:
    if _postgres(conn):
        return func.coalesce(func.sum(func.pg_column_size(literal_column(f'"{table.name}".*'))), 0)
    return func.coalesce(func.sum(sum((func.coalesce(func.length(c), 0) for c in table.columns), start=literal_column("0"))), 0)


def _per_table(conn: Connection, table: Table, key_name: str) -> Iterator[tuple[bytes, str, int, int]]:
    key = table.c[key_name]
    query = select(key, func.count(), _row_size(conn, table)).group_by(key).order_by(key)
    for gdid, rows, size in conn.execution_options(yield_per=STREAM_BATCH).execute(query):
        yield bytes(gdid), table.name, int(rows), int(size)


def briefcase_sizes(conn: Connection, tables: Sequence[tuple[Table, str]]) -> Iterator[BriefcaseSize]:
    """Every briefcase with a row on ``conn``'s server (the caller's transaction), in GDID order."""
    merged = heapq.merge(*(_per_table(conn, t, k) for t, k in tables), key=lambda item: item[0])
    current: bytes | None = None
    rows = size = 0
    names: list[str] = []
    for key, name, n, b in merged:
        if key != current:
            if current is not None:
                yield BriefcaseSize(GDID.from_bytes(current), rows, size, tuple(names))
            current, rows, size, names = key, 0, 0, []
        rows += n
        size += b
        names.append(name)
    if current is not None:
        yield BriefcaseSize(GDID.from_bytes(current), rows, size, tuple(names))


def _keys(conn: Connection, tables: Sequence[tuple[Table, str]]) -> Iterator[GDID]:
    streams = (
        (bytes(g) for (g,) in conn.execution_options(yield_per=STREAM_BATCH).execute(
            select(t.c[k]).distinct().order_by(t.c[k])))
        for t, k in tables
    )
    last: bytes | None = None
    for key in heapq.merge(*streams):
        if key != last:
            last = key
            yield GDID.from_bytes(key)


def storage_bytes(conn: Connection, tables: Sequence[tuple[Table, str]]) -> int | None:
    """On-disk size of the tables on ``conn``'s server incl. indexes (None where the server cannot say)."""
    names = [t.name for t, _ in tables]
    if _postgres(conn):
        query = text("SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                     "WHERE c.relkind = 'r' AND c.relnamespace = 'public'::regnamespace AND c.relname = ANY(:names)")
        return int(conn.execute(query, {"names": names}).scalar_one())
    if conn.dialect.name == "sqlite":
        if conn.execute(text("SELECT count(*) FROM pragma_module_list WHERE name = 'dbstat'")).scalar_one() == 0:
            return None  # a SQLite built without the dbstat table: disk size unknown
        marks = ", ".join(f":n{i}" for i in range(len(names)))
        query = text(f"SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name IN "
                     f"(SELECT name FROM sqlite_master WHERE tbl_name IN ({marks}))")  # tables and their indexes
        return int(conn.execute(query.bindparams(**{f"n{i}": n for i, n in enumerate(names)})).scalar_one())
    return None


def briefcase_rows(conn: Connection, tables: Sequence[tuple[Table, str]], gdid: GDID) -> int:
    """Rows of one briefcase in ``tables`` on ``conn``'s server (one count per table)."""
    return sum(int(conn.execute(select(func.count()).select_from(t).where(t.c[k] == gdid)).scalar_one()) for t, k in tables)


class SqlAreaScan(AreaScan):
    """An area's tables on one SQL server; each method is one read transaction."""

    def __init__(self, cluster: Servers, server: str, data: AreaData) -> None:
        self.cluster = cluster
        self.server = server
        self.data = data

    def sizes(self) -> Iterator[BriefcaseSize]:
        with self.cluster.transaction(self.server) as conn:
            yield from briefcase_sizes(conn, self.data.tables)

    def keys(self) -> Iterator[GDID]:
        with self.cluster.transaction(self.server) as conn:
            yield from _keys(conn, self.data.tables)

    def rows_of(self, gdid: GDID) -> int:
        with self.cluster.transaction(self.server) as conn:
            return briefcase_rows(conn, self.data.tables, gdid)

    def storage_bytes(self) -> int | None:
        with self.cluster.transaction(self.server) as conn:
            return storage_bytes(conn, self.data.tables)

    def states(self) -> Iterator[BriefcaseStateRow]:
        query = select(briefcase_state).where(briefcase_state.c.area == self.data.area).order_by(briefcase_state.c.gdid)
        with self.cluster.transaction(self.server) as conn:
            for row in conn.execution_options(yield_per=STREAM_BATCH).execute(query).mappings():
                yield BriefcaseStateRow(row["gdid"], row["state"], row["peer"], row["move_id"], row["changed_at"])
