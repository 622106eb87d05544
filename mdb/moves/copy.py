"""Copying one briefcase's rows between two servers, inside transactions the caller owns.

PostgreSQL to PostgreSQL streams each table with ``COPY (SELECT ...) TO STDOUT (FORMAT
BINARY)`` into ``COPY ... FROM STDIN (FORMAT BINARY)`` through psycopg 3: no row is decoded in
Python. Anything else (SQLite on either side) goes through SQLAlchemy Core: select, then
executemany insert, with the column types doing the conversions. Tables are given parents
first; deletes run children first, so composite foreign keys hold at every statement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from psycopg import errors as pg_errors
from psycopg import sql
from sqlalchemy import Table, bindparam, delete, func, insert, literal_column, select, tuple_, union_all, update
from sqlalchemy.engine import Connection

from mdb.errors import SchemaError
from mdb.gdid import GDID
from mdb.moves.gate import CutoverGate

__all__ = ["AreaTable", "copy_batch", "count_batch", "copy_rows", "delete_batch", "delete_keys", "delete_rows", "is_postgres", "measure", "select_keys", "update_keys"]

BATCH = 2000
RELAY_BLOCK = 64 * 1024


@dataclass(frozen=True)
class AreaTable:
    """One table of an area's briefcase types, with its briefcase key column name."""

    table: Table
    key: str

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def columns(self) -> list[str]:
        return [c.name for c in self.table.columns]

    @property
    def pk(self) -> list[str]:
        return [c.name for c in self.table.primary_key.columns]


def is_postgres(conn: Connection) -> bool:
    return conn.dialect.name == "postgresql"


def _pg_literal(gdid: GDID) -> sql.Composable:
    return sql.SQL("'\\x{}'::bytea").format(sql.SQL(gdid.hex))


def _pg_relay(src: Connection, dst: Connection, out_stmt: sql.Composable, in_stmt: sql.Composable,
              on_streamed: Callable[[], None] | None = None, pace: Callable[[], None] | None = None) -> int:
    """Stream ``out_stmt`` (a COPY TO STDOUT on the source) into ``in_stmt`` (COPY FROM STDIN on the target); rows copied.

    ``pace`` is called before each block is passed on and may wait: while it does, the target
    has nothing to insert and the source stops once the socket is full (a batch's pre-copy
    yields the CPU to another batch's cutover, :class:`mdb.moves.gate.CutoverGate`).
    """
    src_raw: Any = src.connection.driver_connection
    dst_raw: Any = dst.connection.driver_connection
    with src_raw.cursor() as scur, dst_raw.cursor() as dcur:
        with scur.copy(out_stmt) as out, dcur.copy(in_stmt) as into:
            # The server sends one message per row; passing them on in blocks halves this
            # process's CPU per row (the bytes are relayed unchanged).
            block = bytearray()
            for chunk in out:
                block += chunk
                if len(block) >= RELAY_BLOCK:
                    if pace is not None:
                        pace()
                    into.write(block)
                    block = bytearray()
            if block:
                if pace is not None:
                    pace()
                into.write(block)
            if on_streamed is not None:
                on_streamed()  # the source is done; the target is still inserting and checking
        return int(dcur.rowcount)


def _pg_copy(src: Connection, dst: Connection, at: AreaTable, where: sql.Composable, on_streamed: Callable[[], None] | None = None,
             pace: Callable[[], None] | None = None) -> int:
    """One table's rows matching ``where`` (the briefcase key's condition), COPY to COPY, binary."""
    cols = sql.SQL(", ").join(sql.Identifier(c) for c in at.columns)
    out_stmt = sql.SQL("COPY (SELECT {cols} FROM {table} WHERE {key} {where}) TO STDOUT (FORMAT BINARY)").format(
        cols=cols, table=sql.Identifier(at.name), key=sql.Identifier(at.key), where=where
    )
    in_stmt = sql.SQL("COPY {table} ({cols}) FROM STDIN (FORMAT BINARY)").format(table=sql.Identifier(at.name), cols=cols)
    try:
        return _pg_relay(src, dst, out_stmt, in_stmt, on_streamed, pace)
    except pg_errors.DataError as exc:  # SQLSTATE class 22: e.g. a value wider than the target's column
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SchemaError(
            f"table {at.name!r}: the target refused a copied row ({first}): its columns differ from the source's "
            "(`mdb schema check MAP` lists them); nothing of this copy was committed"
        ) from None


def _pg_keys(gdids: Sequence[GDID]) -> sql.Composable:
    """``ARRAY['\\x..'::bytea, ...]``: the briefcase keys of a batch, inlined (hex only, nothing to escape)."""
    return sql.SQL("ARRAY[{}]").format(sql.SQL(", ").join(_pg_literal(g) for g in gdids))


def copy_batch(src: Connection, dst: Connection, tables: Sequence[AreaTable], gdids: Sequence[GDID],
               gate: CutoverGate | None = None, on_table: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Copy every row of the briefcases ``gdids``, one statement per table for all of them (parents first).

    What makes a batched cutover cheap: 8 tables cost 8 COPY streams whether the batch holds
    one briefcase or five hundred. ``gate``: each table's copy is one of its steps, passing its
    turn between blocks of rows (:class:`mdb.moves.gate.CutoverGate`); a copy under the caller's
    own write lock has none. ``on_table(table, rows)`` after each table (the CLI's progress).
    """
    both_pg = is_postgres(src) and is_postgres(dst)
    pace = gate.wait if gate is not None else None
    counts: dict[str, int] = {}
    for at in tables:
        with gate.step() if gate is not None else nullcontext():
            if both_pg:
                counts[at.name] = _pg_copy(src, dst, at, sql.SQL("= ANY({})").format(_pg_keys(gdids)), pace=pace)
            else:
                counts[at.name] = _generic_copy(src, dst, at, None, where=at.table.c[at.key].in_(list(gdids)), pace=pace)
        if on_table is not None:
            on_table(at.name, counts[at.name])
    return counts


def count_batch(conn: Connection, tables: Sequence[AreaTable], gdids: Sequence[GDID]) -> dict[str, int]:
    """Rows of the briefcases ``gdids`` per table on this server (one statement)."""
    wanted = list(gdids)
    selects: list[Any] = [select(literal_column(str(i)), func.count()).select_from(at.table).where(at.table.c[at.key].in_(wanted))
               for i, at in enumerate(tables)]
    rows = {int(i): int(n) for i, n in conn.execute(union_all(*selects)).all()} if selects else {}
    return {at.name: rows.get(i, 0) for i, at in enumerate(tables)}


def delete_batch(conn: Connection, tables: Sequence[AreaTable], gdids: Sequence[GDID]) -> dict[str, int]:
    """Delete every row of the briefcases ``gdids``; rows deleted per table.

    PostgreSQL: one statement for every table (data-modifying CTEs; foreign keys are checked at
    its end, when parents and children are gone alike): a batch's commit point runs under the
    write lock, where each round trip is pause. Elsewhere one DELETE per table, children first.
    """
    if not is_postgres(conn):
        return {at.name: conn.execute(delete(at.table).where(at.table.c[at.key].in_(list(gdids)))).rowcount for at in reversed(tables)}
    keys = _pg_keys(gdids)
    ctes = sql.SQL(", ").join(
        sql.SQL("{name} AS (DELETE FROM {table} WHERE {key} = ANY({keys}) RETURNING 1)").format(
            name=sql.Identifier(f"d{i}"), table=sql.Identifier(at.name), key=sql.Identifier(at.key), keys=keys)
        for i, at in enumerate(tables)
    )
    counts = sql.SQL(", ").join(sql.SQL("(SELECT count(*) FROM {})").format(sql.Identifier(f"d{i}")) for i in range(len(tables)))
    raw: Any = conn.connection.driver_connection
    with raw.cursor() as cur:
        cur.execute(sql.SQL("WITH {ctes} SELECT {counts}").format(ctes=ctes, counts=counts))
        row = cur.fetchone()
    return {at.name: int(row[i]) for i, at in enumerate(tables)}


def _generic_copy(src: Connection, dst: Connection, at: AreaTable, gdid: GDID | None, where: Any = None,
                  pace: Callable[[], None] | None = None) -> int:
    query = select(at.table)
    if gdid is not None:
        query = query.where(at.table.c[at.key] == gdid)
    if where is not None:
        query = query.where(where)
    result = src.execute(query.order_by(*at.table.primary_key.columns))
    copied = 0
    while True:
        rows = result.mappings().fetchmany(BATCH)
        if not rows:
            return copied
        if pace is not None:
            pace()
        dst.execute(insert(at.table), [dict(r) for r in rows])
        copied += len(rows)


def copy_rows(
    src: Connection,
    dst: Connection,
    tables: Sequence[AreaTable],
    gdid: GDID,
    *,
    on_table: Callable[[str, int], None] | None = None,
    on_streamed: Callable[[str], None] | None = None,
) -> dict[str, int]:
    """Copy every row of the briefcase, table by table (parents first); returns rows per table.

    ``on_streamed(table)`` is called once the source has sent a table's last row, while the
    target may still be busy with it (its inserts, index entries and foreign-key checks).
    """
    both_pg = is_postgres(src) and is_postgres(dst)
    counts: dict[str, int] = {}
    for at in tables:
        if both_pg:
            streamed = None if on_streamed is None else (lambda name=at.name: on_streamed(name))
            counts[at.name] = _pg_copy(src, dst, at, sql.SQL("= {}").format(_pg_literal(gdid)), streamed)
        else:
            counts[at.name] = _generic_copy(src, dst, at, gdid)
            if on_streamed is not None:
                on_streamed(at.name)
        if on_table is not None:
            on_table(at.name, counts[at.name])
    return counts


def select_keys(src: Connection, dst: Connection, at: AreaTable, gdid: GDID, keys: Sequence[tuple[Any, ...]]) -> int:
    """Copy the rows of ``at`` whose primary keys are ``keys`` (a re-sync after a pre-copy)."""
    copied = 0
    pk = tuple_(*at.table.primary_key.columns)
    for i in range(0, len(keys), 500):
        copied += _generic_copy(src, dst, at, gdid, where=pk.in_(list(keys[i : i + 500])))
    return copied


def update_keys(src: Connection, dst: Connection, at: AreaTable, gdid: GDID, keys: Sequence[tuple[Any, ...]]) -> int:
    """Overwrite, in place, the rows of ``at`` whose primary keys are ``keys`` with the source's
    (a re-sync of rows both sides hold: a parent deleted and inserted again would break its
    children's foreign keys). Returns the rows updated."""
    t = at.table
    pk_cols = list(t.primary_key.columns)
    others = [c for c in t.columns if c not in set(pk_cols)]
    if not keys or not others:
        return 0
    stmt = update(t).where(*(c == bindparam(f"mdb_k_{c.name}") for c in pk_cols)).values(
        {c.name: bindparam(f"mdb_v_{c.name}") for c in others})
    pk = tuple_(*pk_cols)
    updated = 0
    for i in range(0, len(keys), 500):
        rows = src.execute(select(t).where(t.c[at.key] == gdid, pk.in_(list(keys[i : i + 500])))).mappings().all()
        if rows:
            dst.execute(stmt, [{**{f"mdb_k_{c.name}": r[c.name] for c in pk_cols}, **{f"mdb_v_{c.name}": r[c.name] for c in others}}
                               for r in rows])
            updated += len(rows)
    return updated


def delete_keys(conn: Connection, at: AreaTable, gdid: GDID, keys: Sequence[tuple[Any, ...]]) -> None:
    pk = tuple_(*at.table.primary_key.columns)
    for i in range(0, len(keys), 500):
        conn.execute(delete(at.table).where(at.table.c[at.key] == gdid, pk.in_(list(keys[i : i + 500]))))


def delete_rows(conn: Connection, tables: Sequence[AreaTable], gdid: GDID) -> dict[str, int]:
    """Delete every row of the briefcase, children first; returns rows deleted per table.

    Per table, so the commit point can check that it deletes exactly the rows it verified.
    """
    return {at.name: conn.execute(delete(at.table).where(at.table.c[at.key] == gdid)).rowcount for at in reversed(tables)}


def measure(conn: Connection, tables: Sequence[AreaTable], gdid: GDID, *, with_bytes: bool = True) -> dict[str, tuple[int, int]]:
    """table -> (rows, bytes) of the briefcase on this server, counted exactly (for --dry-run and plans).

    ``with_bytes=False`` counts rows only (bytes 0): summing row sizes reads every row and costs
    a move several times the count, so a move measures bytes beside its copy instead. One
    statement for all tables: one round trip.
    """
    selects = []
    for i, at in enumerate(tables):
        t = at.table
        if not with_bytes:
            size: Any = literal_column("0")
        elif is_postgres(conn):
            size = func.coalesce(func.sum(func.pg_column_size(literal_column(f'"{t.name}".*'))), 0)
        else:
            size = func.coalesce(func.sum(sum((func.coalesce(func.length(c), 0) for c in t.columns), start=literal_column("0"))), 0)
        selects.append(select(literal_column(str(i)), func.count(), size).select_from(t).where(t.c[at.key] == gdid))
    rows = {int(i): (int(n), int(b)) for i, n, b in conn.execute(union_all(*selects)).all()} if selects else {}
    return {at.name: rows[i] for i, at in enumerate(tables)}
