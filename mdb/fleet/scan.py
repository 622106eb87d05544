"""Streaming every briefcase of an area on one server: (gdid, rows, bytes), in GDID order.

One grouped query per table, each read with a server-side cursor (``yield_per``), merged by
key (GDID byte order = SQL byte order), so a shard's keys are never all in memory at once.
Bytes are the rows' own sizes (PostgreSQL ``pg_column_size`` of each row, elsewhere the sum of
column lengths), the same figure ``mdb move --dry-run`` shows: what a move of that briefcase
carries, unlike relation sizes, which keep dead rows until VACUUM.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, literal_column, select
from sqlalchemy.engine import Connection

from mdb.gdid import GDID
from mdb.moves.copy import AreaTable, is_postgres

__all__ = ["BriefcaseSize", "STREAM_BATCH", "briefcase_sizes"]

STREAM_BATCH = 1000
"""Rows fetched from the server at a time by the streaming cursors."""


@dataclass(frozen=True)
class BriefcaseSize:
    gdid: GDID
    rows: int
    bytes: int
    tables: tuple[str, ...]
    """Tables holding at least one row of the briefcase on this server."""


def _row_size(conn: Connection, at: AreaTable) -> Any:
    t = at.table
    if is_postgres(conn):
        return func.coalesce(func.sum(func.pg_column_size(literal_column(f'"{t.name}".*'))), 0)
    return func.coalesce(func.sum(sum((func.coalesce(func.length(c), 0) for c in t.columns), start=literal_column("0"))), 0)


def _per_table(conn: Connection, at: AreaTable) -> Iterator[tuple[bytes, str, int, int]]:
    key = at.table.c[at.key]
    query = select(key, func.count(), _row_size(conn, at)).group_by(key).order_by(key)
    for gdid, rows, size in conn.execution_options(yield_per=STREAM_BATCH).execute(query):
        yield bytes(gdid), at.name, int(rows), int(size)


def briefcase_sizes(conn: Connection, tables: Sequence[AreaTable]) -> Iterator[BriefcaseSize]:
    """Every briefcase with a row on this server (the caller's transaction), in GDID order."""
    merged = heapq.merge(*(_per_table(conn, at) for at in tables), key=lambda item: item[0])
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
