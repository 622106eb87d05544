"""Independent verification: row counts and checksums per table, computed on each side.

The checksums are computed by querying each server, not from the copy's own row stream, so a
copy that dropped, duplicated or altered a row is caught. Both sides use the same function:
between two PostgreSQL servers it runs in SQL (``md5`` over the text form of each row, in
primary-key order, with the session's output settings pinned so both servers print values
alike); otherwise rows are fetched through SQLAlchemy and hashed in Python over a canonical,
type-tagged encoding (so SQLite and PostgreSQL agree on the same values). In SQL a large table
may be summed as primary-key ranges (:class:`Part`), the same ranges on both sides, so that
the target can sum them on several connections at once; the ranges change where the work is
done, not what is compared (every row, by count and md5 of its text, in key order).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy import BindParameter, bindparam, func, literal_column, select, text, tuple_
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from mdb.gdid import GDID
from mdb.moves.copy import AreaTable, is_postgres

__all__ = [
    "PG_OUTPUT_CONFIG", "PG_OUTPUT_SETTINGS", "Method", "Part", "TableSum", "batch_sums", "compare", "describe_key", "describe_mismatch", "differing_keys", "hashable_tables", "method_for",
    "part_sums", "plan_parts", "row_digests", "sql_digest",
]

Method = Literal["sql", "python"]


@dataclass(frozen=True)
class TableSum:
    rows: int
    digest: str


def method_for(a: Connection, b: Connection) -> Method:
    return "sql" if is_postgres(a) and is_postgres(b) else "python"


_PG_OUTPUT = {"TimeZone": "UTC", "DateStyle": "ISO, YMD", "extra_float_digits": "3", "IntervalStyle": "postgres", "bytea_output": "hex"}
PG_OUTPUT_SETTINGS = "; ".join(f"SET LOCAL {name} = '{value}'" for name, value in _PG_OUTPUT.items())
"""Text forms depend on session settings; pinned so two servers print the same values alike."""
PG_OUTPUT_CONFIG = ", ".join(f"set_config('{name}', '{value}', true)" for name, value in _PG_OUTPUT.items())
""":data:`PG_OUTPUT_SETTINGS` as expressions of one SELECT (for a statement that sets them beside others)."""


def _pin_pg_output(conn: Connection) -> None:
    conn.exec_driver_sql(PG_OUTPUT_SETTINGS)


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
            value = value.astimezone(UTC).replace(tzinfo=None)
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


@dataclass(frozen=True)
class Part:
    """Rows of one table to checksum: the whole table, or a primary-key range ``[lo, hi)``.

    Both sides checksum the same parts, so a part's count and digest compare like a table's;
    a large table is cut into ranges only so that they can be summed on several connections
    of the target at once. ``rows`` is the expected row count (for spreading the work).
    """

    table: AreaTable
    lo: tuple[Any, ...] | None = None
    hi: tuple[Any, ...] | None = None
    rows: int = 0
    hashed: bool = False
    """Summed by row hash (:func:`sql_digest`): both sides sum the same parts, so they agree on it."""


def plan_parts(conn: Connection, tables: Sequence[AreaTable], gdid: GDID, rows: dict[str, int], *, block: int,
               hashed: frozenset[str] = frozenset()) -> list[Part]:
    """Every table as one part, or, past ``block`` rows, cut into primary-key ranges of about
    ``block`` rows (a re-sync compares ranges, then fetches rows only of those that differ).
    The bounds are keys read on this server (the locked source), one pass per table; any keys
    would do, the other side uses the same ones.
    """
    parts: list[Part] = []
    for at in tables:
        n = rows.get(at.name, 0)
        every = block if n > block else 0
        bounds = _bounds(conn, at, gdid, every) if every else []
        edges: list[tuple[Any, ...] | None] = [None, *bounds, None]
        size = n // (len(edges) - 1)
        parts.extend(Part(at, edges[i], edges[i + 1], size, at.name in hashed) for i in range(len(edges) - 1))
    return parts


def _bounds(conn: Connection, at: AreaTable, gdid: GDID, every: int) -> list[tuple[Any, ...]]:
    """The primary keys of rows number every+1, 2*every+1, ... in key order (one index scan)."""
    pk = [at.table.c[c] for c in at.pk]
    numbered = select(*pk, func.row_number().over(order_by=pk).label("mdb_rn")).where(at.table.c[at.key] == gdid).subquery()
    rn = numbered.c.mdb_rn
    query = select(*(numbered.c[c] for c in at.pk)).where(rn > 1, (rn - 1) % every == 0).order_by(rn)
    return [tuple(r) for r in conn.execute(query)]


def _sql_part(i: int, part: Part, gdid: GDID) -> tuple[str, list[BindParameter[Any]]]:
    """The SELECT of (i, count, checksum) of one part, with its bound parameters (named p{i}_*)."""
    at = part.table
    where = [f'"{at.key}" = :p{i}_g']
    params: list[BindParameter[Any]] = [bindparam(f"p{i}_g", bytes(gdid))]
    cols = ", ".join(f'"{c}"' for c in at.pk)
    for name, op, bound in (("lo", ">=", part.lo), ("hi", "<", part.hi)):
        if bound is not None:
            names = [f"p{i}_{name}{k}" for k in range(len(bound))]
            where.append(f"({cols}) {op} ({', '.join(':' + n for n in names)})")
            params += [bindparam(n, v, type_=at.table.c[c].type) for n, v, c in zip(names, bound, at.pk, strict=True)]
    query = f'SELECT {i}, count(*), coalesce({sql_digest(at, part.hashed)}, \'\') FROM "{at.name}" WHERE {" AND ".join(where)}'
    return query, params


def part_sums(conn: Connection, parts: Sequence[Part], gdid: GDID) -> list[TableSum]:
    """(row count, checksum) of each part on this server, in SQL (PostgreSQL; the caller's transaction).

    One statement for all parts (one round trip: most briefcases are small, and a move's
    pause is mostly round trips then). Each part is summed by :func:`sql_digest`, which needs no
    sort: an md5 of the rows' text in key order took 0.94 s for the ten parts of a 200,000-row
    briefcase, more than a third of its copy (docs/dev/measured-consolidation.md).
    """
    if not parts:
        return []
    _pin_pg_output(conn)
    queries, params = zip(*(_sql_part(i, part, gdid) for i, part in enumerate(parts)), strict=True)
    rows = conn.execute(text(" UNION ALL ".join(queries)).bindparams(*(p for ps in params for p in ps))).all()
    by_index = {int(r[0]): TableSum(int(r[1]), str(r[2])) for r in rows}
    return [by_index[i] for i in range(len(parts))]


def combine(parts: Sequence[Part], sums: Sequence[TableSum]) -> dict[str, TableSum]:
    """table -> TableSum from its parts' sums, given in :func:`plan_parts` order (rows added, digests joined)."""
    by_table: dict[str, list[TableSum]] = {}
    for part, summed in zip(parts, sums, strict=True):
        by_table.setdefault(part.table.name, []).append(summed)
    return {
        name: TableSum(sum(s.rows for s in pieces), pieces[0].digest if len(pieces) == 1 else ".".join(s.digest for s in pieces))
        for name, pieces in by_table.items()
    }


def sql_digest(at: AreaTable, hashed: bool = False) -> str:
    """The batch checksum of ``at``'s rows in a group (SQL): a sum of one 60- or 64-bit hash per row.

    A multiset hash (no sort of the rows): a changed, missing or extra row changes the sum or
    the count. ``hashed``: each row's ``hash_record_extended`` (PostgreSQL 14+, the columns'
    own hash functions, no text formed: about 40% cheaper), where :func:`hashable_tables` says
    both servers can; otherwise 60 bits of the md5 of its text form. Its columns are named
    unqualified, so it applies to the table and to rows a statement returns with the same
    columns (a batch's commit point sums the rows it deletes).
    """
    if hashed:
        cols = ", ".join(f'"{c}"' for c in at.columns)
        return f"sum(hash_record_extended(ROW({cols}), 0))::text"
    return f"sum(('x' || left({_sql_row_expr(at)}, 15))::bit(60)::bigint)::text"


def hashable_tables(conn: Connection, tables: Sequence[AreaTable]) -> frozenset[str]:
    """The tables whose rows this PostgreSQL server can hash with ``hash_record_extended``.

    Asked of the server, not guessed from the models: the function is PostgreSQL 14's, and a
    column type without a hash function (``json``, ``xml``, ``point``, ...) makes it fail when
    it meets the first row. The probe hashes one row of NULLs typed like the table's columns
    (the function looks every column's hash function up before it looks at the values), in a
    savepoint each, so a refusal costs nothing but the fallback to md5 for that table.
    Equal hashes mean equal values by each type's equality: ``1.0`` and ``1.00`` as ``numeric``,
    or strings equal under a nondeterministic collation, sum alike.
    """
    if not is_postgres(conn):
        return frozenset()
    found = set()
    for at in tables:
        cols = ", ".join(f't."{c}"' for c in at.columns)
        try:
            with conn.begin_nested():
                conn.exec_driver_sql(f'SELECT hash_record_extended(ROW({cols}), 0) FROM (SELECT 1) AS one LEFT JOIN "{at.name}" AS t ON false')
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) not in ("42883", "0A000"):  # undefined function, not supported
                raise
            continue
        found.add(at.name)
    return frozenset(found)


def batch_sums(
    conn: Connection, tables: Sequence[AreaTable], gdids: Sequence[GDID], method: Method, *, pinned: bool = False,
    hashed: frozenset[str] = frozenset(),
) -> dict[tuple[str, GDID], TableSum]:
    """(table, briefcase) -> (row count, checksum) for every briefcase of a batch on this server.

    Grouped by the briefcase key: one statement for every table and briefcase (SQL method), or
    one ordered read per table (Python method). A briefcase with no row in a table has no entry
    for it. The SQL checksum is :func:`sql_digest` (``hashed``: the tables summed by row hash);
    both sides of a batch use it with the same ``hashed``, so its sums are compared only with
    each other.
    """
    out: dict[tuple[str, GDID], TableSum] = {}
    if not gdids:
        return out
    if method == "sql":
        if not pinned:  # else the caller ran PG_OUTPUT_SETTINGS in this transaction already
            _pin_pg_output(conn)
        keys = "ARRAY[" + ", ".join(f"'\\x{g.hex}'::bytea" for g in gdids) + "]"
        queries = [
            f'SELECT {i}, "{at.key}", count(*), {sql_digest(at, at.name in hashed)} FROM "{at.name}" WHERE "{at.key}" = ANY({keys}) GROUP BY "{at.key}"'
            for i, at in enumerate(tables)
        ]
        for i, key, count, digest in conn.exec_driver_sql(" UNION ALL ".join(queries)).all():
            out[(tables[int(i)].name, GDID.from_bytes(bytes(key)))] = TableSum(int(count), str(digest))
        return out
    wanted = list(gdids)
    for at in tables:
        key_col = at.table.c[at.key]
        result = conn.execute(select(at.table).where(key_col.in_(wanted)).order_by(key_col, *at.table.primary_key.columns))
        index = at.columns.index(at.key)
        current: GDID | None = None
        digest = hashlib.md5(usedforsecurity=False)
        count = 0
        for row in result:
            gdid = row[index]
            if gdid != current:
                if current is not None:
                    out[(at.name, current)] = TableSum(count, digest.hexdigest())
                current, digest, count = gdid, hashlib.md5(usedforsecurity=False), 0
            digest.update(_row_hash(row).encode("ascii"))
            count += 1
        if current is not None:
            out[(at.name, current)] = TableSum(count, digest.hexdigest())
    return out


def row_digests(conn: Connection, at: AreaTable, gdid: GDID, method: Method, part: Part | None = None) -> dict[tuple[Any, ...], str]:
    """primary key -> row checksum, for finding which rows differ (mismatch reports, re-sync).

    ``part``: only the rows of that key range (its table must be ``at``).
    """
    pk_cols = [at.table.c[c] for c in at.pk]
    where = [at.table.c[at.key] == gdid]
    if part is not None:
        key = tuple_(*pk_cols)
        if part.lo is not None:
            where.append(key >= tuple_(*(bindparam(None, v, type_=c.type) for v, c in zip(part.lo, pk_cols, strict=True))))
        if part.hi is not None:
            where.append(key < tuple_(*(bindparam(None, v, type_=c.type) for v, c in zip(part.hi, pk_cols, strict=True))))
    if method == "sql":
        _pin_pg_output(conn)
        result = conn.execute(select(*pk_cols, literal_column(_sql_row_expr(at))).select_from(at.table).where(*where))
        return {tuple(r[:-1]): str(r[-1]) for r in result}
    result = conn.execute(select(at.table).where(*where))
    index = [at.columns.index(c) for c in at.pk]
    return {tuple(r[i] for i in index): _row_hash(r) for r in result}


def describe_mismatch(src: Connection, dst: Connection, at: AreaTable, gdid: GDID, method: Method, src_rows: int, dst_rows: int) -> str:
    """One table's line of a failed verification report: both counts and every differing key.

    Read again row by row on each side (the sums only say *that* the table differs); the same
    line for a single move and a batch, one per table and briefcase that differ.
    """
    only_src, only_dst, different = differing_keys(row_digests(src, at, gdid, method), row_digests(dst, at, gdid, method))
    return (
        f"{at.name}: source {src_rows} rows, target {dst_rows} rows; "
        f"missing on target: {[describe_key(k) for k in only_src]}; "
        f"extra on target: {[describe_key(k) for k in only_dst]}; "
        f"different: {[describe_key(k) for k in different]}"
    )


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

