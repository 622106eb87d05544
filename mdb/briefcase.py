"""Briefcase types: a root table and its child tables, all keyed by the root's GDID.

A briefcase type is declared as a subclass naming its area, its key column and its SQLAlchemy
mapped classes. Declaration is where invariant 1 is enforced: every table must carry the key
column as a GDID, every primary key column must be a GDID, and nothing may auto-increment,
because a briefcase must be movable to another server without renumbering anything.

    class UserBriefcase(BriefcaseType):
        area = "user"
        key = "user_id"
        root = User
        children = (Address, Order, OrderLineItem)
        id_sequence = "ids"      # the default: root GDIDs come from CENTRAL sequence "user/ids"

Root GDIDs (the briefcase keys) come from ONE CENTRAL sequence per area,
``{area}/{id_sequence}``, drawn through ``store.ids(Type)`` / ``store.new_gdid(Type)`` (also by
``central.create`` and ``Repository.new_root_id``); see docs/gdid.md. Every type of an area
must name the same sequence: briefcases of one area share the GDID space (one lock key, one
relocation entry per GDID).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from sqlalchemy import Column, Identity, Integer, Sequence as SqlSequence, Table, inspect as sa_inspect
from sqlalchemy.exc import NoInspectionAvailable

from mdb.errors import GDIDError, SchemaError
from mdb.gdid import sequence_key
from mdb.registry import Kind, Registry, default_registry
from mdb.sqltypes import GDIDType

__all__ = ["BriefcaseType", "registered_types", "types_by_area"]


class BriefcaseType:
    """Declare a briefcase type by subclassing; validation runs at class creation.

    The type joins the registry named by the class keyword (``class Users(BriefcaseType,
    registry=reg)``), :data:`mdb.registry.default_registry` otherwise.
    """

    area: ClassVar[str]
    key: ClassVar[str]
    root: ClassVar[type[Any]]
    children: ClassVar[Sequence[type[Any]]] = ()
    id_sequence: ClassVar[str] = "ids"
    """Name of the CENTRAL sequence (scope = the area) that root GDIDs of this type come from."""

    # Filled in at declaration.
    models: ClassVar[tuple[type[Any], ...]]
    tables: ClassVar[tuple[Table, ...]]

    @classmethod
    def clash_with(cls, other: type[BriefcaseType]) -> str | None:
        """Two types of one area share its GDID space (so one sequence) and may not share a table."""
        if cls.id_sequence != other.id_sequence:
            return (
                f"briefcase types {cls.__name__} and {other.__name__} of area {cls.area!r} draw root GDIDs "
                f"from different sequences ({cls.id_sequence!r}, {other.id_sequence!r}): they share the area's "
                "GDID space, so they must share one sequence"
            )
        shared = {t.name for t in other.tables} & {t.name for t in cls.tables}
        if shared:
            return f"briefcase types {cls.__name__} and {other.__name__} of area {cls.area!r} share tables {sorted(shared)}"
        return None

    def __init_subclass__(cls, registry: Registry | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__name__
        for attr in ("area", "key", "root"):
            if not hasattr(cls, attr):
                raise SchemaError(f"briefcase type {name} must set {attr!r}")
        try:
            sequence_key(cls.area, cls.id_sequence)
        except GDIDError as exc:
            raise SchemaError(f"briefcase type {name}: {exc}") from None
        models = (cls.root, *cls.children)
        tables: list[Table] = []
        for model in models:
            try:
                mapper = sa_inspect(model)
            except NoInspectionAvailable:
                raise SchemaError(f"briefcase type {name}: {model!r} is not a SQLAlchemy mapped class") from None
            table = mapper.local_table
            if not isinstance(table, Table):
                raise SchemaError(f"briefcase type {name}: {model.__name__} is not mapped to a plain table")
            _check_table(name, cls.key, table, is_root=model is cls.root)
            tables.append(table)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise SchemaError(f"briefcase type {name}: a table is listed twice ({', '.join(names)})")
        cls.models = models
        cls.tables = tuple(tables)
        (registry or default_registry).add(BRIEFCASE_TYPES, f"{cls.__module__}.{cls.__qualname__}", cls)

    @classmethod
    def key_column(cls, table: Table) -> Column[Any]:
        return table.c[cls.key]

    @classmethod
    def model_for_table(cls, table_name: str) -> type[Any]:
        for model in cls.models:
            if sa_inspect(model).local_table.name == table_name:
                return model
        raise SchemaError(f"table {table_name!r} is not part of briefcase type {cls.__name__}")


def _check_table(type_name: str, key: str, table: Table, is_root: bool) -> None:
    where = f"briefcase type {type_name}, table {table.name!r}"
    if key not in table.c:
        raise SchemaError(f"{where}: missing the briefcase key column {key!r} (every table of a briefcase carries it)")
    if not isinstance(table.c[key].type, GDIDType):
        raise SchemaError(f"{where}: briefcase key column {key!r} must be a GDIDType column")
    pk = list(table.primary_key.columns)
    if not pk:
        raise SchemaError(f"{where}: has no primary key; primary keys are GDIDs")
    for column in table.columns:
        if isinstance(column.default, (Identity, SqlSequence)) or column.identity is not None:
            raise SchemaError(f"{where}: column {column.name!r} auto-increments; briefcase tables use GDID keys")
    for column in pk:
        if isinstance(column.type, Integer) or column.autoincrement is True:
            raise SchemaError(f"{where}: primary key column {column.name!r} auto-increments; use a GDIDType key")
        if not isinstance(column.type, GDIDType):
            raise SchemaError(f"{where}: primary key column {column.name!r} must be a GDIDType column")
    if is_root and [c.name for c in pk] != [key]:
        raise SchemaError(f"{where}: the root table's primary key must be exactly the briefcase key {key!r}")


BRIEFCASE_TYPES: Kind[type[BriefcaseType]] = Kind("briefcase type")


def registered_types(registry: Registry | None = None) -> list[type[BriefcaseType]]:
    """Every briefcase type declared so far in ``registry`` (the default one: the CLI's set)."""
    return (registry or default_registry).items(BRIEFCASE_TYPES)


class AreaType(Protocol):
    """A declared type of some area (a SQL briefcase type, a document briefcase type)."""

    area: ClassVar[str]

    @classmethod
    def clash_with(cls, other: Any) -> str | None:
        """Why this type and ``other``, of the same area, cannot be served together (None: they can)."""
        ...


T = TypeVar("T", bound=AreaType)


def types_by_area(types: Sequence[type[T]]) -> dict[str, list[type[T]]]:
    """Group types by area, refusing two types of one area that clash (:meth:`BriefcaseType.clash_with`).

    One grouping for SQL and document briefcase types: each kind says itself what makes two of
    its types of one area incompatible (shared tables or collections, different id sequences).
    """
    out: dict[str, list[type[T]]] = {}
    for btype in types:
        for other in out.get(btype.area, []):
            problem = other.clash_with(btype)
            if problem is not None:
                raise SchemaError(problem)
        out.setdefault(btype.area, []).append(btype)
    return out
