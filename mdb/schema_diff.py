"""The one comparison of a server's live tables with the tables the models declare.

Used by ``mdb schema apply`` (after creating what was missing), ``mdb schema check`` and a
move's prechecks on both servers. Without it a column added to a model stays invisible until a
write fails with a raw driver error, or a move crashes half-way through its copy: drift must be
seen before anything relies on the tables.

Types are compared by their generic affinity (binary, integer, string, datetime, ...), not by
their spelling: the same model is BYTEA on PostgreSQL and BLOB on SQLite, INTEGER and BIGINT
hold the same ids, and a VARCHAR's length is the application's business. Nullability, the
primary key, plain indexes and unique keys (a unique constraint or a unique index: both
enforce the same thing) are compared by their columns, not by their names. Expression indexes
are not compared. Everything is read with SQLAlchemy's multi-table inspection: a few catalog
queries for the whole server, whatever the number of tables.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Index, Table, UniqueConstraint
from sqlalchemy import inspect as sa_inspect
from sqlalchemy import types as sqltypes
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import CompileError, SAWarning

from mdb.dialects import sql_dialect

__all__ = ["Difference", "compare_tables", "format_differences"]

KINDS: Final = (
    "missing table",
    "extra table",
    "missing column",
    "extra column",
    "type",
    "width",
    "nullable",
    "primary key",
    "missing index",
    "extra index",
    "missing unique",
    "extra unique",
)
"""Every ``Difference.kind``, in the order a report lists them."""

# Order matters: Boolean before Integer (some dialects subclass), Float before Numeric, Text
# and Enum are Strings.
_AFFINITIES: Final[tuple[tuple[type[sqltypes.TypeEngine[Any]], str], ...]] = (
    (sqltypes.Boolean, "boolean"),
    (sqltypes.Integer, "integer"),
    (sqltypes.Float, "float"),
    (sqltypes.Numeric, "numeric"),
    (sqltypes.String, "string"),
    (sqltypes._Binary, "binary"),
    (sqltypes.DateTime, "datetime"),
    (sqltypes.Date, "date"),
    (sqltypes.Time, "time"),
    (sqltypes.Interval, "interval"),
    (sqltypes.JSON, "json"),
    (sqltypes.Uuid, "uuid"),
)


@dataclass(frozen=True)
class Difference:
    """One way a server's table differs from its model; ``detail`` says what, for a person."""

    table: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.table}: {self.detail}"

    def to_json(self) -> dict[str, str]:
        return {"table": self.table, "kind": self.kind, "detail": self.detail}


def format_differences(differences: Sequence[Difference], limit: int = 20) -> str:
    """Differences as one line each, ``limit`` at most (a report says how many were left out)."""
    lines = [str(d) for d in differences[:limit]]
    if len(differences) > limit:
        lines.append(f"... and {len(differences) - limit} more")
    return "; ".join(lines)


def affinity(type_: sqltypes.TypeEngine[Any], dialect: Dialect) -> str | None:
    """The generic family of a column type as stored by ``dialect``; None when unknown.

    A TypeDecorator (GDIDType) is judged by what it stores; a UUID on a dialect without a native
    one is stored, and reflected, as a string.
    """
    if isinstance(type_, sqltypes.TypeDecorator):
        type_ = type_.load_dialect_impl(dialect)
    if isinstance(type_, sqltypes.Uuid) and not (type_.native_uuid and dialect.supports_native_uuid):
        return "string"
    if isinstance(type_, sqltypes.Enum) and not (type_.native_enum and dialect.supports_native_enum):
        return "string"
    for cls, name in _AFFINITIES:
        if isinstance(type_, cls):
            return name
    return None


def _type_name(type_: sqltypes.TypeEngine[Any], dialect: Dialect) -> str:
    try:
        return type_.compile(dialect=dialect)
    except CompileError:  # a type the dialect cannot render (NullType of an unknown reflected type)
        return type(type_).__name__


def _model_keys(table: Table) -> tuple[set[tuple[str, ...]], set[tuple[str, ...]]]:
    """(plain indexes, unique keys) of a model table, each as its column names."""
    plain: set[tuple[str, ...]] = set()
    unique: set[tuple[str, ...]] = set()
    for index in table.indexes:
        names = _index_columns(index)
        if names is not None:
            (unique if index.unique else plain).add(names)
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint):
            unique.add(tuple(c.name for c in constraint.columns))
    return plain, unique


def _index_columns(index: Index) -> tuple[str, ...] | None:
    """An index's column names, or None for an expression index (not compared)."""
    names: list[str] = []
    for expression in index.expressions:
        name = getattr(expression, "name", None)
        if not isinstance(name, str) or index.table is None or name not in index.table.c:
            return None
        names.append(name)
    return tuple(names)


def _live_keys(indexes: list[dict[str, Any]], uniques: list[dict[str, Any]]) -> tuple[set[tuple[str, ...]], set[tuple[str, ...]]]:
    plain: set[tuple[str, ...]] = set()
    unique: set[tuple[str, ...]] = set()
    for index in indexes:
        names = index.get("column_names") or []
        if not names or any(n is None for n in names):
            continue  # an expression index
        (unique if index.get("unique") else plain).add(tuple(names))
    for constraint in uniques:
        unique.add(tuple(constraint["column_names"]))
    return plain, unique


def _fmt_cols(cols: tuple[str, ...]) -> str:
    return "(" + ", ".join(cols) + ")"


def _int_width(t: Any) -> int | None:
    """2, 4 or 8 bytes for an integer type, None for any other."""
    for kind, width in ((sqltypes.BigInteger, 8), (sqltypes.SmallInteger, 2), (sqltypes.Integer, 4)):
        if isinstance(t, kind):
            return width
    return None


def _narrower(live: Any, model: Any) -> bool:
    """The live column holds less than the model's: a shorter string length, or a smaller integer."""
    if isinstance(live, sqltypes.String) and isinstance(model, sqltypes.String):
        return live.length is not None and (model.length is None or live.length < model.length)
    have, want = _int_width(live), _int_width(model)
    return have is not None and want is not None and have < want


def _compare_table(model: Table, live: dict[str, Any], dialect: Dialect) -> list[Difference]:
    name = model.name
    out: list[Difference] = []
    columns = {c["name"]: c for c in live["columns"]}
    for column in model.columns:
        if column.name not in columns:
            out.append(Difference(name, "missing column", f"column {column.name!r} ({_type_name(column.type, dialect)}) is missing"))
            continue
        found = columns[column.name]
        want, have = affinity(column.type, dialect), affinity(found["type"], dialect)
        if want is not None and have is not None and want != have:
            out.append(Difference(
                name, "type",
                f"column {column.name!r} is {_type_name(found['type'], dialect)} ({have}), the model says "
                f"{_type_name(column.type, dialect)} ({want})",
            ))
        elif sql_dialect(dialect).enforces_widths and _narrower(found["type"], column.type):
            out.append(Difference(
                name, "width",
                f"column {column.name!r} is {_type_name(found['type'], dialect)}, narrower than the model's "
                f"{_type_name(column.type, dialect)} (a move or write of a wider value fails there)",
            ))
        if bool(found["nullable"]) != bool(column.nullable) and not column.primary_key:
            state = "nullable" if found["nullable"] else "NOT NULL"
            wanted = "nullable" if column.nullable else "NOT NULL"
            out.append(Difference(name, "nullable", f"column {column.name!r} is {state}, the model says {wanted}"))
    for extra in [c for c in columns if c not in model.c]:
        nullable = "nullable" if columns[extra]["nullable"] else "NOT NULL"
        out.append(Difference(name, "extra column", f"column {extra!r} ({nullable}) is not in the model"))
    want_pk = tuple(c.name for c in model.primary_key.columns)
    have_pk = tuple(live["pk"].get("constrained_columns") or ())
    if want_pk and set(want_pk) != set(have_pk):
        out.append(Difference(name, "primary key", f"primary key is {_fmt_cols(have_pk)}, the model says {_fmt_cols(want_pk)}"))
    want_plain, want_unique = _model_keys(model)
    have_plain, have_unique = _live_keys(live["indexes"], live["uniques"])
    have_unique.discard(have_pk)
    out += _key_differences(name, "index", want_plain, have_plain)
    out += _key_differences(name, "unique", want_unique, have_unique)
    return out


def _key_differences(table: str, kind: str, want: set[tuple[str, ...]], have: set[tuple[str, ...]]) -> list[Difference]:
    missing = [Difference(table, f"missing {kind}", f"{kind} on {_fmt_cols(c)} is missing") for c in sorted(want - have)]
    extra = [Difference(table, f"extra {kind}", f"{kind} on {_fmt_cols(c)} is not in the model") for c in sorted(have - want)]
    return missing + extra


def compare_tables(conn: Connection, tables: Sequence[Table], *, known: Collection[str] = ()) -> list[Difference]:
    """How the tables on ``conn``'s server differ from ``tables`` (the ones it should have).

    ``known`` names every table mdb knows of (any area's briefcase tables, mdb's own); a table
    on the server that is in neither ``tables`` nor ``known`` is reported as extra. Without
    ``known``, extra tables are not looked for (a move's precheck only cares about its area).
    """
    inspector = sa_inspect(conn)
    live = _reflect(inspector, [t.name for t in tables])
    out = [Difference(t.name, "missing table", f"table {t.name!r} is missing") for t in tables if t.name not in live]
    if known:
        wanted = {t.name for t in tables} | set(known)
        present = set(inspector.get_table_names())
        out += [Difference(n, "extra table", f"table {n!r} is not declared by any model") for n in sorted(present - wanted)]
    for table in tables:
        if table.name in live:
            out += _compare_table(table, live[table.name], conn.dialect)
    return out


def _reflect(inspector: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """Columns, primary key, indexes and unique constraints of those of ``names`` that exist.

    One catalog query each on PostgreSQL, whatever the number of tables; a table without
    columns in the answer does not exist.
    """
    def by_name(found: dict[tuple[str | None, str], Any]) -> dict[str, Any]:
        return {name: value for (_, name), value in found.items()}

    columns = by_name(inspector.get_multi_columns(filter_names=names))
    names = [n for n in names if n in columns]
    if not names:
        return {}
    pks = by_name(inspector.get_multi_pk_constraint(filter_names=names))
    with warnings.catch_warnings():
        # SQLite cannot reflect expression indexes and says so on stderr; they are not compared.
        warnings.filterwarnings("ignore", "Skipped unsupported reflection of expression-based index", SAWarning)
        indexes = by_name(inspector.get_multi_indexes(filter_names=names))
        uniques = by_name(inspector.get_multi_unique_constraints(filter_names=names))
    return {
        name: {"columns": columns.get(name, []), "pk": pks.get(name) or {}, "indexes": indexes.get(name, []),
               "uniques": uniques.get(name, [])}
        for name in names
    }
