"""Independent verification: row counts and checksums per table, computed on each side.

The checksums are computed by querying each server, not from the copy's own row stream, so a
copy that dropped, duplicated or altered a row is caught. Both sides use the same function:
between two PostgreSQL servers it runs in SQL (``md5`` over the text form of each row, in
primary-key order, with the session's output settings pinned so both servers print values
alike); otherwise rows are fetched through SQLAlchemy and hashed in Python over a canonical,
type-tagged encoding (so SQLite and PostgreSQL agree on the same values).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy import literal_column, select, text
from sqlalchemy.engine import Connection

from mdb.gdid import GDID
from mdb.moves.copy import AreaTable, is_postgres

__all__ = ["Method", "TableSum", "compare", "describe_key", "differing_keys", "method_for", "row_digests", "table_sums"]

Method = Literal["sql", "python"]


@dataclass(frozen=True)
class TableSum:
    rows: int
    digest: str


def method_for(a: Connection, b: Connection) -> Method:
    return "sql" if is_postgres(a) and is_postgres(b) else "python"


def _pin_pg_output(conn: Connection) -> None:
    # Text forms depend on session settings; pin them so two servers print the same values alike.
    conn.exec_driver_sql(
        "SET LOCAL TimeZone = 'UTC'; SET LOCAL DateStyle = 'ISO, YMD'; SET LOCAL extra_float_digits = 3; "
        "SET LOCAL IntervalStyle = 'postgres'; SET LOCAL bytea_output = 'hex'"
    )


def _canon(value: Any) -> str:
    if value is None:
        return "N"
    if isinstance(value, GDID):
        return "G" + value.hex
    if isinstance(value, bool):
        return "B1" if value else "B0"
    if isinstance(value, int):
        return f"I{value}"
    if isinstance(value, Decimal):
        return "D" + format(value.normalize(), "f") if value == value.to_integral_value() else "D" + str(value.normalize())
    if isinstance(value, float):
        return "F" + repr(value)
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return "T" + value.isoformat()
    if isinstance(value, date):
        return "d" + value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "X" + bytes(value).hex()
    text_ = str(value)
    return f"S{len(text_)}:{text_}"


def _row_hash(values: Iterable[Any]) -> str:
    return hashlib.md5("\x1f".join(_canon(v) for v in values).encode("utf-8"), usedforsecurity=False).hexdigest()


def _sql_row_expr(at: AreaTable) -> str:
    cols = ", ".join(f'"{c}"' for c in at.columns)
    return f"md5(ROW({cols})::text)"


def _order(at: AreaTable) -> str:
    return ", ".join(f'"{c}"' for c in at.pk)


def table_sums(conn: Connection, tables: Sequence[AreaTable], gdid: GDID, method: Method) -> dict[str, TableSum]:
    """table -> (row count, checksum) of the briefcase on this server (the caller's transaction)."""
    out: dict[str, TableSum] = {}
    if method == "sql":
        _pin_pg_output(conn)
        for at in tables:
            row = conn.execute(
                text(
                    f"SELECT count(*), coalesce(md5(string_agg({_sql_row_expr(at)}, '' ORDER BY {_order(at)})), '') "
                    f'FROM "{at.name}" WHERE "{at.key}" = :g'
                ),
                {"g": bytes(gdid)},
            ).one()
            out[at.name] = TableSum(int(row[0]), str(row[1]))
        return out
    for at in tables:
        digest = hashlib.md5(usedforsecurity=False)
        count = 0
        result = conn.execute(
            select(at.table).where(at.table.c[at.key] == gdid).order_by(*at.table.primary_key.columns)
        )
        for row in result:
            digest.update(_row_hash(row).encode("ascii"))
            count += 1
        out[at.name] = TableSum(count, digest.hexdigest() if count else "")
    return out


def row_digests(conn: Connection, at: AreaTable, gdid: GDID, method: Method) -> dict[tuple[Any, ...], str]:
    """primary key -> row checksum, for finding which rows differ (mismatch reports, re-sync)."""
    pk_cols = [at.table.c[c] for c in at.pk]
    if method == "sql":
        _pin_pg_output(conn)
        result = conn.execute(
            select(*pk_cols, literal_column(_sql_row_expr(at)))
            .select_from(at.table).where(at.table.c[at.key] == gdid)
        )
        return {tuple(r[:-1]): str(r[-1]) for r in result}
    result = conn.execute(select(at.table).where(at.table.c[at.key] == gdid))
    index = [at.columns.index(c) for c in at.pk]
    return {tuple(r[i] for i in index): _row_hash(r) for r in result}


def compare(source: dict[str, TableSum], target: dict[str, TableSum]) -> list[str]:
    """Tables whose count or checksum differ (empty list: equal)."""
    return [
        name for name in source
        if name not in target or source[name] != target[name]
    ] + [name for name in target if name not in source]


def describe_key(key: tuple[Any, ...]) -> str:
    return ",".join(str(k) for k in key)


def differing_keys(src: dict[tuple[Any, ...], str], dst: dict[tuple[Any, ...], str]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(only on source, only on target, different) primary keys."""
    only_src = sorted((k for k in src if k not in dst), key=repr)
    only_dst = sorted((k for k in dst if k not in src), key=repr)
    changed = sorted((k for k in src if k in dst and src[k] != dst[k]), key=repr)
    return only_src, only_dst, changed

