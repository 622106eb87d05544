"""create_tables asks the server for its table names once and creates only what is missing
(issue 19: schema apply at 128 shards); an ENUM type shared with an existing table is still
checked first. Real PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from mdb.backends.sql import create_tables

pytestmark = pytest.mark.postgres


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(sa.make_url(url).set(drivername="postgresql+psycopg"))


def test_creates_the_missing_tables_only(pg_url: str) -> None:
    md = sa.MetaData()
    a = sa.Table("a", md, sa.Column("id", sa.Integer, primary_key=True), sa.Column("v", sa.String(5), index=True))
    b = sa.Table("b", md, sa.Column("id", sa.Integer, primary_key=True),
                 sa.Column("a_id", sa.ForeignKey("a.id")))
    engine = _engine(pg_url)
    try:
        with engine.begin() as conn:
            a.create(conn)
        statements: list[str] = []
        sa.event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
        with engine.begin() as conn:
            assert create_tables(conn, [a, b]) == ["b"]
        assert not [s for s in statements if "pg_catalog.pg_class" in s and "relname" in s and "= %(table_name)s" in s]
        with engine.begin() as conn:
            assert create_tables(conn, [a, b]) == []
            assert set(sa.inspect(conn).get_table_names()) >= {"a", "b"}
            assert {i["name"] for i in sa.inspect(conn).get_indexes("a")} == {"ix_a_v"}
    finally:
        engine.dispose()


def test_an_enum_type_that_exists_already_is_not_created_again(pg_url: str) -> None:
    md = sa.MetaData()
    color = sa.Enum("red", "green", name="color")
    first = sa.Table("first", md, sa.Column("id", sa.Integer, primary_key=True), sa.Column("c", color))
    second = sa.Table("second", md, sa.Column("id", sa.Integer, primary_key=True), sa.Column("c", color))
    engine = _engine(pg_url)
    try:
        with engine.begin() as conn:
            first.create(conn)  # creates the type too
        with engine.begin() as conn:
            assert create_tables(conn, [first, second]) == ["second"]
    finally:
        engine.dispose()


def test_create_tables_in_fresh_databases(pg_databases: Callable[[int], list[str]]) -> None:
    md = sa.MetaData()
    tables = [sa.Table(f"t{i}", md, sa.Column("id", sa.Integer, primary_key=True)) for i in range(3)]
    for url in pg_databases(2):
        engine = _engine(url)
        try:
            with engine.begin() as conn:
                assert create_tables(conn, tables) == ["t0", "t1", "t2"]
        finally:
            engine.dispose()
