"""BriefcaseSession: a SQLAlchemy Session confined to one briefcase.

Reads are filtered to the briefcase with ``with_loader_criteria`` on every mapped class of the
type (so a query cannot see a neighbour briefcase on the same shard), new rows get the
briefcase key filled in, and a flush that would write a row of another briefcase, or a table
that is not part of the type, is refused before any SQL is sent. Raw SQL (``text()``) is not
filtered: it is the application's explicit escape hatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import bindparam, event, inspect as sa_inspect
from sqlalchemy.orm import ORMExecuteState, Session, UOWTransaction, with_loader_criteria
from sqlalchemy.sql.base import ExecutableOption

from mdb.briefcase import BriefcaseType
from mdb.errors import CrossBriefcaseError, MdbError
from mdb.gdid import GDID
from mdb.router import Placement
from mdb.sqltypes import GDIDType

__all__ = ["BriefcaseContext", "BriefcaseSession"]

_INFO_KEY = "mdb.briefcase"


@dataclass(frozen=True)
class BriefcaseContext:
    btype: type[BriefcaseType]
    gdid: GDID
    placement: Placement
    readonly: bool


_KEY_PARAM = "mdb_briefcase_key"
"""Bound parameter that carries the session's GDID into the confining criteria."""


def _key_attr(model: type[Any], key: str) -> str:
    mapper = sa_inspect(model)
    return mapper.get_property_by_column(mapper.local_table.c[key]).key


@cache
def _criteria(btype: type[BriefcaseType]) -> tuple[ExecutableOption, ...]:
    """The confining options of a type, built once: the GDID travels as a bound parameter.

    Building eight ``with_loader_criteria`` options with the GDID inlined cost more than the
    query itself; built once with a placeholder, adding them to a statement is cheap and the
    compiled form is cached across briefcases. The placeholder is required: a statement that
    somehow missed the parameter fails instead of reading unfiltered.
    """
    placeholder = bindparam(_KEY_PARAM, type_=GDIDType(), required=True)
    return tuple(
        with_loader_criteria(model, getattr(model, _key_attr(model, btype.key)) == placeholder, include_aliases=True)
        for model in btype.models
    )


def _with_key(parameters: Any, gdid: GDID) -> Any:
    if isinstance(parameters, list):  # executemany-style ORM bulk UPDATE/DELETE
        return [{**p, _KEY_PARAM: gdid} for p in parameters]
    return {**(parameters or {}), _KEY_PARAM: gdid}


class BriefcaseSession(Session):
    """The Session handed out by ``Store.briefcase``; see the module docstring for its rules."""

    @property
    def briefcase(self) -> BriefcaseContext:
        return self.info[_INFO_KEY]  # type: ignore[no-any-return]

    @property
    def gdid(self) -> GDID:
        return self.briefcase.gdid

    @property
    def placement(self) -> Placement:
        return self.briefcase.placement


@event.listens_for(BriefcaseSession, "do_orm_execute")
def _confine_statements(state: ORMExecuteState) -> None:
    ctx: BriefcaseContext | None = state.session.info.get(_INFO_KEY)
    if ctx is None or not (state.is_select or state.is_update or state.is_delete):
        return
    if ctx.readonly and not state.is_select:
        raise MdbError(f"briefcase {ctx.btype.area}/{ctx.gdid}: a readonly session cannot update or delete")
    state.statement = state.statement.options(*_criteria(ctx.btype))
    state.parameters = _with_key(state.parameters, ctx.gdid)


@event.listens_for(BriefcaseSession, "before_flush")
def _confine_writes(session: Session, _flush: UOWTransaction, _instances: Any) -> None:
    ctx: BriefcaseContext | None = session.info.get(_INFO_KEY)
    if ctx is None:
        return
    pending = [*session.new, *session.dirty, *session.deleted]
    if ctx.readonly and pending:
        raise MdbError(f"briefcase {ctx.btype.area}/{ctx.gdid}: a readonly session cannot write")
    tables = {t.name for t in ctx.btype.tables}
    for obj in pending:
        model = type(obj)
        table = sa_inspect(model).local_table
        if table.name not in tables:
            raise CrossBriefcaseError(
                f"{model.__name__} (table {table.name!r}) is not part of briefcase type {ctx.btype.__name__}"
            )
        attr = _key_attr(model, ctx.btype.key)
        value = getattr(obj, attr)
        if value is None and obj in session.new:
            setattr(obj, attr, ctx.gdid)
        elif value != ctx.gdid:
            raise CrossBriefcaseError(
                f"{model.__name__} row with {attr}={value} cannot be written in the session of briefcase "
                f"{ctx.btype.area}/{ctx.gdid}: every row of a briefcase carries its key"
            )
