"""BriefcaseSession: a SQLAlchemy Session confined to one briefcase.

Reads are filtered to the briefcase with ``with_loader_criteria`` on every mapped class of the
type (so a query cannot see a neighbour briefcase on the same shard), new rows get the
briefcase key filled in, and a flush that would write a row of another briefcase, or a table
that is not part of the type, is refused before any SQL is sent. Raw SQL (``text()``) is not
filtered: it is the application's explicit escape hatch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

from sqlalchemy import BindParameter, Column, ColumnElement, bindparam, event
from sqlalchemy.engine import Dialect
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import Mapper, Session, UOWTransaction
from sqlalchemy.orm.util import LoaderCriteriaOption
from sqlalchemy.sql import Delete, Select, Update, coercions, roles
from sqlalchemy.sql import util as sql_util
from sqlalchemy.sql.elements import BinaryExpression
from sqlalchemy.sql import visitors
from sqlalchemy.types import UserDefinedType

from mdb.briefcase import BriefcaseType
from mdb.dialects import sql_dialect
from mdb.errors import CrossBriefcaseError, MdbError
from mdb.gdid import GDID
from mdb.router import Placement

__all__ = ["BriefcaseContext", "BriefcaseSession"]

@dataclass(frozen=True)
class BriefcaseContext:
    btype: type[BriefcaseType]
    gdid: GDID
    placement: Placement
    readonly: bool

    @cached_property
    def key(self) -> bytes:
        """The GDID as its column stores it (:class:`~mdb.sqltypes.GDIDType`): the value of the
        confining parameter, made once per context (a kept route keeps its context)."""
        return bytes(self.gdid)


_KEY_PARAM = "mdb_briefcase_key"
"""Bound parameter that carries the session's GDID, as its 12 bytes, into the confining criteria."""


class _StoredKey(UserDefinedType[bytes]):
    """The confining parameter's type: the key's stored bytes, sent as they are.

    The column's own type (:class:`~mdb.sqltypes.GDIDType`) would turn the GDID into bytes and
    those into the driver's binary again on every statement (8 Python calls per confined
    statement, measured); the context holds the bytes already (:attr:`BriefcaseContext.key`),
    and both drivers send bytes as a binary value (``bytea``, ``BLOB``) without help. No bind
    processor, no cast: SQLAlchemy leaves the value alone. Inlined (``literal_binds``), it is the
    binary literal the column type renders.
    """

    cache_ok = True

    def literal_processor(self, dialect: Dialect) -> Callable[[bytes], str]:
        render = sql_dialect(dialect).gdid_literal
        return lambda value: render(value.hex())


def _key_attr(model: type[Any], key: str) -> str:
    mapper = sa_inspect(model)
    return mapper.get_property_by_column(mapper.local_table.c[key]).key


class _BriefcaseCriteria(LoaderCriteriaOption):
    """``with_loader_criteria`` for every mapped class of a briefcase type, as ONE option.

    One ``with_loader_criteria`` per class works too, but each statement then carries one
    option per class of the type, and coercing them and walking them for the statement's cache
    key cost more than the whole query (about 100 µs for the demo's ten classes, measured; this
    option: about 20 µs). So the option names the mappers itself and gives each its own key
    criterion, and its cache key is the briefcase type alone: the criteria are fixed per type
    and the GDID travels as the bound parameter ``mdb_briefcase_key``, never in the statement.
    It hooks the same two methods the ORM calls on every loader criteria option.

    It does not propagate to loaders (``propagate_to_loaders``, on for ``with_loader_criteria``):
    a lazy, selectin, subquery or refresh load of a briefcase session is an execution of that
    session, confined in :meth:`BriefcaseSession._execute_internal` like any other, so
    propagating only made the ORM carry the option on every loaded row (~1 µs per statement,
    docs/dev/measured-sessions.md, "Ninth pass").
    """

    __slots__ = ("_by_mapper",)
    _traverse_internals = [("root_entity", visitors.ExtendedInternalTraversal.dp_plain_obj)]  # noqa: RUF012 (as the base declares it)

    def __init__(self, btype: type[BriefcaseType], placeholder: BindParameter[Any]) -> None:
        # The base __init__ resolves one entity or base class; we hold a set of mappers instead.
        self.root_entity = btype
        self.entity = None
        self.deferred_where_criteria = False
        self.where_criteria = None  # type: ignore[assignment]
        self._where_crit_orig = None
        self.include_aliases = True
        self.propagate_to_loaders = False
        self._by_mapper: dict[Mapper[Any], ColumnElement[bool]] = {
            sa_inspect(model): getattr(model, _key_attr(model, btype.key)) == placeholder for model in btype.models
        }

    def _all_mappers(self) -> Iterator[Mapper[Any]]:
        return iter(self._by_mapper)

    def _resolve_where_criteria(self, ext_info: Any) -> ColumnElement[bool]:
        # As the base class does: the annotation tells the ORM the criterion came from this option.
        return sql_util._deep_annotate(
            self._by_mapper[ext_info.mapper], {"for_loader_criteria": self},
            detect_subquery_cols=True, ind_cols_on_fromclause=True,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_criteria, (self.root_entity,))


@cache
def _criteria(btype: type[BriefcaseType]) -> _BriefcaseCriteria:
    """The confining option of a type, built once. The placeholder is required: a statement
    that somehow missed the parameter fails instead of reading unfiltered."""
    return _BriefcaseCriteria(btype, bindparam(_KEY_PARAM, type_=_StoredKey(), required=True))


_POINT_READ: frozenset[str] = frozenset({"_propagate_attrs", "_raw_columns", "_label_style", "_where_criteria"})
"""All that ``select(Model).where(<condition>)``, built for one execution, holds of its own: any
other clause (a join, an option, an ordering, a limit, a hint, a memoized cache key...) sets one
more attribute, so a statement with exactly these has no part but its entity and its condition."""


@cache
def _point_read_models(btype: type[BriefcaseType]) -> dict[Mapper[Any], Column[Any]]:
    """The mappers of ``btype`` whose point reads need no confining criterion, with their key column.

    A mapper qualifies when loading it reads its own table and nothing else: no inheritance, a
    mapped table of its own, every column attribute a column of that table (no ``column_property``
    over a subquery), no relationship loaded in the same statement (``lazy="joined"``; the other
    loads are executions of the session, confined there).
    """
    models: dict[Mapper[Any], Column[Any]] = {}
    for model in btype.models:
        mapper = sa_inspect(model)
        table = mapper.local_table
        if (
            mapper.inherits is not None or mapper.polymorphic_on is not None or mapper.persist_selectable is not table
            or any(column.table is not table for prop in mapper.column_attrs for column in prop.columns)
            or any(rel.lazy == "joined" for rel in mapper.relationships)
        ):
            continue
        models[mapper] = table.c[btype.key]
    return models


def _names_its_briefcase(ctx: BriefcaseContext, statement: Select[Any]) -> bool:
    """Whether ``statement`` is ``select(Model).where(Model.<key> == <the session's GDID>)`` and nothing else.

    Such a point read selects rows of this briefcase and no other already: the criterion
    confinement adds would be the same comparison again. So it runs as it is, with the plain
    read's SQL, its cache key and no option for the ORM to process: the most common read of all
    costs what it costs in a plain Session (~5-8 µs less per read on SQLite, measured:
    docs/dev/measured-sessions.md, "Ninth pass"). Anything else, a value that is not this
    session's GDID (text included) or a call with parameters (which could rebind the value), is
    confined as usual.
    """
    if statement.__dict__.keys() != _POINT_READ:
        return False
    entities, where = statement._raw_columns, statement._where_criteria
    if len(entities) != 1 or len(where) != 1:
        return False
    entity = entities[0]
    mapper = entity._annotations.get("parententity")
    key = _point_read_models(ctx.btype).get(mapper)  # type: ignore[arg-type]  # python/mypy#11470, as below
    condition = where[0]
    if (
        key is None or entity.__visit_name__ != "table"  # the entity itself, not an expression annotated with it
        or condition.__class__ is not BinaryExpression or condition.operator is not operator.eq
    ):
        return False
    column, value = condition.left, condition.right
    return (
        column.__visit_name__ == "column" and column.table is key.table and column.name == key.name
        and column._annotations.get("parententity") is mapper
        and value.__class__ is BindParameter and value.callable is None and value.type is column.type
        and ((gdid := value.value) is ctx.gdid or (gdid.__class__ is GDID and gdid == ctx.gdid))
    )


_CONFINED = "_mdb_confined"
"""The attribute a select keeps its confined copy in: (the select's id, briefcase type, the copy)."""


def _with_key(parameters: Any, key: bytes) -> Any:
    if isinstance(parameters, list):  # executemany-style ORM bulk UPDATE/DELETE
        return [{**p, _KEY_PARAM: key} for p in parameters]
    return {**(parameters or {}), _KEY_PARAM: key}


def _confined(ctx: BriefcaseContext, statement: Any, params: Any) -> tuple[Any, Any]:
    """``statement`` with the type's confining option and ``params`` with the key, if it reads or changes ORM rows.

    Which statements: those the ORM loads or changes rows with (a select of any kind, an ORM
    ``update()``/``delete()``); a Core ``insert()`` or ``text()`` passes as it came (not confined:
    docs/briefcases.md, "What is not confined"). A readonly session refuses an update or delete.
    """
    kind = statement.__class__
    if kind is Select:
        if params is None and _names_its_briefcase(ctx, statement):
            return statement, params
    elif kind is Update or kind is Delete:
        if ctx.readonly:
            raise MdbError(f"briefcase {ctx.btype.area}/{ctx.gdid}: a readonly session cannot update or delete")
    else:
        # As the ORM sees it (a legacy Query or a lambda statement coerced to its statement),
        # then the same test the ORM's execute state makes (is_select / is_update / is_delete).
        statement = coercions.expect(roles.StatementRole, statement)
        if statement.is_dml and (statement.is_update or statement.is_delete):
            if ctx.readonly:
                raise MdbError(f"briefcase {ctx.btype.area}/{ctx.gdid}: a readonly session cannot update or delete")
        elif not statement.is_select:
            return statement, params
        # A class is hashable, but mypy checks type[X] against Hashable with the instance's
        # __hash__ (python/mypy#11470), so it rejects this call into the functools.cache wrapper.
        return statement.options(_criteria(ctx.btype)), _with_key(params, ctx.key)  # type: ignore[arg-type]
    # The common case: what ``Executable.options`` does (a copy of the statement with the option
    # appended), minus its generative decorator and the option's coercion (it is one already).
    # The copy holds no GDID (the key is a parameter), so it is kept on the statement for the
    # next session of the same type that executes it: a statement the application builds once
    # and executes again keeps its cache key, which a new copy computes again (~14 µs).
    btype = ctx.btype
    kept = statement.__dict__.get(_CONFINED)
    if kept is not None and kept[0] == id(statement) and kept[1] is btype:
        confined = kept[2]
    elif (options := statement._with_options) and any(option is _criteria(btype) for option in options):  # type: ignore[arg-type]
        # Confined already (by identity: an option's == is its own business): a selectin or
        # subquery load's statement carries its parent's options, ours among them.
        confined = statement
    else:
        confined = statement._generate()
        confined._with_options = (*options, _criteria(btype))  # type: ignore[arg-type]
        # A memoized attribute, as SQLAlchemy keeps the cache key: a statement derived from this
        # one (``.where()``, ``.options()``) is a copy that leaves it behind. The id is for a
        # copy that took it anyway (two threads memoizing at once can drop a name from the
        # memoized set): the copy is another object, so it builds its own.
        statement._set_memoized_attribute(_CONFINED, (id(statement), btype, confined))
    return confined, {_KEY_PARAM: ctx.key} if params is None else _with_key(params, ctx.key)


class BriefcaseSession(Session):
    """The Session handed out by ``Store.briefcase``; see the module docstring for its rules.

    ``briefcase``: the briefcase it is confined to (a session made without one is a plain
    Session). Confinement happens where every ORM execution passes (``Session.execute``,
    ``scalars``, ``scalar``, ``get``, lazy and eager loads, ORM update/delete all end in
    ``_execute_internal``), not in a ``do_orm_execute`` listener: with a listener the ORM builds
    an execute state per statement and runs its pre-execution step twice (~45 Python calls per
    statement, the largest part of what a routed read cost over a plain Session: docs/dev/measured-sessions.md,
    "Third pass", and docs/dev/0018).
    """

    _mdb_briefcase: BriefcaseContext | None = None

    def __init__(self, bind: Any = None, *, briefcase: BriefcaseContext | None = None, **kw: Any) -> None:
        Session.__init__(self, bind, **kw)  # (not super(): one object fewer per session)
        self._mdb_briefcase = briefcase

    def _execute_internal(self, statement: Any, params: Any = None, **kw: Any) -> Any:
        # Every execution: the application's, the ORM's own loads (lazy, selectin, subquery,
        # refresh), a listener's invoke_statement() (which may hand over a new statement).
        ctx = self._mdb_briefcase
        if ctx is not None:
            statement, params = _confined(ctx, statement, params)
        return Session._execute_internal(self, statement, params, **kw)

    @property
    def briefcase(self) -> BriefcaseContext:
        ctx = self._mdb_briefcase
        if ctx is None:
            raise MdbError("this BriefcaseSession was made without a briefcase (Store.briefcase makes confined ones)")
        return ctx

    @property
    def gdid(self) -> GDID:
        return self.briefcase.gdid

    @property
    def placement(self) -> Placement:
        return self.briefcase.placement


@cache
def _row_key_attr(btype: type[BriefcaseType], model: type[Any]) -> str | None:
    """The attribute carrying the briefcase key on ``model``, or None when its table is not in the type."""
    table = sa_inspect(model).local_table
    if table.name not in {t.name for t in btype.tables}:
        return None
    return _key_attr(model, btype.key)


def _confine_row(ctx: BriefcaseContext, obj: Any, is_new: bool) -> None:
    """Refuse a row that is not of the type or carries another key; give a new row without a key ours."""
    model = type(obj)
    attr = _row_key_attr(ctx.btype, model)  # type: ignore[arg-type]  # python/mypy#11470, as above
    if attr is None:
        table = sa_inspect(model).local_table
        raise CrossBriefcaseError(
            f"{model.__name__} (table {table.name!r}) is not part of briefcase type {ctx.btype.__name__}"
        )
    value = getattr(obj, attr)
    if value is None and is_new:
        setattr(obj, attr, ctx.gdid)
    elif not isinstance(value, GDID):
        # GDID columns parse text when it is assigned (mdb.sqltypes); anything else reaching here
        # is not a GDID at all, and comparing it with one would report a bogus "other briefcase".
        raise CrossBriefcaseError(
            f"{model.__name__}.{attr}: expected a GDID, got {type(value).__name__} {value!r} "
            f"(in the session of briefcase {ctx.btype.area}/{ctx.gdid})"
        )
    elif value != ctx.gdid:
        raise CrossBriefcaseError(
            f"{model.__name__} row with {attr}={value} cannot be written in the session of briefcase "
            f"{ctx.btype.area}/{ctx.gdid}: every row of a briefcase carries its key"
        )


@event.listens_for(BriefcaseSession, "before_flush")
def _confine_writes(session: Session, _flush: UOWTransaction, _instances: Any) -> None:
    """Check every pending row once: O(N) per flush.

    ``session.new``, ``.dirty`` and ``.deleted`` each build a new set at every access, so they
    are read once here; asking ``obj in session.new`` per object made a flush of N new rows
    quadratic (8,000 rows: 5.4 s against 0.58 s for a plain Session).
    """
    ctx = session._mdb_briefcase if isinstance(session, BriefcaseSession) else None
    if ctx is None:
        return
    new, dirty, deleted = session.new, session.dirty, session.deleted
    if ctx.readonly and (new or dirty or deleted):
        raise MdbError(f"briefcase {ctx.btype.area}/{ctx.gdid}: a readonly session cannot write")
    for obj in new:
        _confine_row(ctx, obj, is_new=True)
    for obj in (*dirty, *deleted):
        _confine_row(ctx, obj, is_new=False)
