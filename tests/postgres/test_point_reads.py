"""A point read that names its own briefcase runs as written; every other statement is confined.

``select(Model).where(Model.<key> == <the session's GDID>)`` and nothing else already selects
this briefcase's rows and no other, so a briefcase session sends it without the confining
criterion (:func:`mdb.session._names_its_briefcase`). These tests pin the boundary: which
statements take that way, on both backends, and that no statement reads differently for it (a
hypothesis property over statements of every shape the rule looks at, against the same
statements confined).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import ForeignKeyConstraint, String, event, func, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.orm import DeclarativeBase, Mapped, aliased, column_property, mapped_column, relationship, selectinload
from support.briefcase import pg_store, sqlite_store, store  # noqa: F401  (fixtures)

import mdb.session
from mdb.briefcase import BriefcaseType
from mdb.demo.models import Address, Order, PayAccount, Transaction, User, UserBriefcase
from mdb.gdid import GDID
from mdb.registry import Registry
from mdb.session import _point_read_models
from mdb.sqltypes import GDIDType
from mdb.store import Store

MINE, NEIGHBOUR = GDID(0, 0, 60), GDID(0, 0, 62)  # both on u1


def _fill(store: Store) -> None:
    for n, gdid in enumerate((MINE, NEIGHBOUR)):
        with store.briefcase(UserBriefcase, gdid) as session:
            session.add(User(user_id=gdid, email=f"{gdid}@example.com", name=f"user {n}"))
            session.add_all([Order(order_id=GDID(0, 1, 100 * n + i), total_cents=i) for i in range(3)])
            session.add(Address(address_id=GDID(0, 1, 100 * n + 50), line1="1 Main St", city="Springfield", country="US"))


@contextmanager
def _sent(store: Store) -> Iterator[list[str]]:
    """The SQL texts sent on u1's reader engine inside the block."""
    texts: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        texts.append(statement)

    engine = store.engine("u1", True)
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield texts
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _as_written(store: Store, sent: str, statement: Any) -> bool:
    """Whether ``sent`` is ``statement``'s own SQL, with no criterion added."""
    return sent == str(statement.compile(dialect=store.engine("u1", True).dialect))


def test_which_statements_run_as_written(store: Store) -> None:
    _fill(store)
    as_written = {
        "the root by its key": select(User).where(User.user_id == MINE),
        "a child table by the key": select(Order).where(Order.user_id == MINE),
        "filter_by": select(User).filter_by(user_id=MINE),
    }
    confined = {
        "another briefcase's key": select(User).where(User.user_id == NEIGHBOUR),
        "the key as text": select(User).where(User.user_id == str(MINE)),
        "a column, not the entity": select(User.user_id).where(User.user_id == MINE),
        "a second condition": select(Order).where(Order.user_id == MINE, Order.total_cents >= 0),
        "a limit": select(Order).where(Order.user_id == MINE).limit(10),
        "an order": select(Order).where(Order.user_id == MINE).order_by(Order.order_id),
        "an option": select(User).where(User.user_id == MINE).options(selectinload(User.orders)),
        "an alias": select(alias := aliased(Order)).where(alias.user_id == MINE),
        "another column": select(Order).where(Order.order_id == MINE),
        "no condition": select(Order),
    }
    with store.briefcase(UserBriefcase, MINE, readonly=True) as session:
        for what, statement in {**as_written, **confined}.items():
            with _sent(store) as texts:
                rows = session.scalars(statement).all()
            assert rows and all(getattr(row, "user_id", row) == MINE for row in rows) or what in (
                "another briefcase's key", "another column"), (what, rows)
            assert _as_written(store, texts[0], statement) is (what in as_written), (what, texts)
        with _sent(store) as texts:  # parameters could rebind the value: confined
            statement = select(User).where(User.user_id == MINE)
            session.scalars(statement, {}).all()
        assert not _as_written(store, texts[0], statement), texts


# -- the rule's precondition on the models ----------------------------------------------------

REGISTRY = Registry()


class Base(DeclarativeBase):
    type_annotation_map = {GDID: GDIDType}


class Shelf(Base):
    __tablename__ = "pr_shelf"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String(20))
    books: Mapped[list[Book]] = relationship(lazy="joined")


class Book(Base):
    __tablename__ = "pr_book"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    book_id: Mapped[GDID] = mapped_column(primary_key=True)
    __table_args__ = (ForeignKeyConstraint(["owner_id"], ["pr_shelf.owner_id"]),)


class Note(Base):
    __tablename__ = "pr_note"
    owner_id: Mapped[GDID] = mapped_column(primary_key=True)
    note_id: Mapped[GDID] = mapped_column(primary_key=True)
    __table_args__ = (ForeignKeyConstraint(["owner_id"], ["pr_shelf.owner_id"]),)


# Every book of the shelf's table, whatever its owner, counted by a correlated subquery.
Note.books_anywhere = column_property(select(func.count()).select_from(Book.__table__).scalar_subquery())


class ShelfBriefcase(BriefcaseType, registry=REGISTRY):
    area = "pr"
    key = "owner_id"
    root = Shelf
    children = (Book, Note)


def test_models_whose_load_reads_another_table_are_always_confined() -> None:
    """A relationship loaded in the same statement (``lazy="joined"``) or a column over a subquery
    reads rows the key condition does not pin: such a model never skips its criterion."""
    eligible = {mapper.class_ for mapper in _point_read_models(ShelfBriefcase)}
    assert eligible == {Book}
    assert {mapper.class_ for mapper in _point_read_models(UserBriefcase)} == set(UserBriefcase.models)


# -- no statement reads differently -----------------------------------------------------------

_ENTITIES = {"user": User, "order": Order, "address": Address, "account": PayAccount, "transaction": Transaction}
_statements = st.tuples(
    st.sampled_from(sorted(_ENTITIES)),
    st.lists(st.sampled_from(["mine", "neighbour", "mine as text", "mine and a column", "not the key"]), max_size=2),
    st.sampled_from(["", "limit", "order", "alias", "column"]),
    st.booleans(),  # with parameters
)


def _statement(spec: tuple[str, list[str], str, bool]) -> tuple[Any, dict[str, Any] | None]:
    name, conditions, extra, with_params = spec
    model = _ENTITIES[name]
    entity = aliased(model) if extra == "alias" else model
    statement = select(entity.user_id) if extra == "column" else select(entity)
    for condition in conditions:
        statement = statement.where({
            "mine": entity.user_id == MINE,
            "neighbour": entity.user_id == NEIGHBOUR,
            "mine as text": entity.user_id == str(MINE),
            "mine and a column": (entity.user_id == MINE) & (entity.user_id != NEIGHBOUR),
            "not the key": entity.user_id != MINE,
        }[condition])
    if extra == "limit":
        statement = statement.limit(5)
    elif extra == "order":
        statement = statement.order_by(entity.user_id)
    return statement, ({} if with_params else None)


def _keys(rows: list[Any]) -> list[tuple[GDID, Any]]:
    return sorted((row, None) if isinstance(row, GDID) else (row.user_id, sa_inspect(row).identity) for row in rows)


def test_no_statement_reads_differently_for_running_as_written(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fill(store)
    taken = 0

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_statements)
    def run(spec: tuple[str, list[str], str, bool]) -> None:
        nonlocal taken
        results = []
        for rule in (mdb.session._names_its_briefcase, lambda ctx, statement: False):
            monkeypatch.setattr(mdb.session, "_names_its_briefcase", rule)
            statement, params = _statement(spec)  # built for each run, as an application does
            with store.briefcase(UserBriefcase, MINE, readonly=True) as session:
                with _sent(store) as texts:
                    rows = session.execute(statement, params).scalars().all()
                results.append(_keys(rows))
                taken += _as_written(store, texts[0], statement)
        assert results[0] == results[1], spec
        assert all(key == MINE for key, _ in results[0]), spec
        monkeypatch.undo()

    run()
    assert taken > 0  # some statements ran as written: the property was not only about confined ones
