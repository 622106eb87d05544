"""A test cluster's databases cloned from a template, built once per layout per test process.

A cluster fixture created 3-7 databases from PostgreSQL's ``template1``, applied mdb's schema
to each (a few dozen CREATE TABLEs, the layout stamps, a reflection of every table) and wrote
its briefcases through the Store, for every test. Here the first test of a layout builds it
that way once, into template databases on the same servers, and every test (the first too)
gets its own databases as ``CREATE DATABASE name TEMPLATE <built one>``: PostgreSQL copies
files instead of running DDL and transactions. ``pg_databases`` makes and drops them as usual.

What a clone must not share with its template or with another clone is its server identity
(:mod:`mdb.maps.identity`: a random UUID per database, recorded in CENTRAL with the URL that
reached it). A template keeps none, and each clone gets its own the way ``apply_schema`` adopts
a database CENTRAL has no record of (``ensure_on``, then ``record_identities``). Everything
else in a clone is what the build wrote; ``_strip`` checks that nothing else in a template
names its databases or identities. docs/dev/0020-cluster-templates.md says why.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Protocol

from sqlalchemy import String, delete, func, or_, select
from sqlalchemy import column as column_clause, inspect as sa_inspect, table as table_clause
from sqlalchemy.engine import Connection, make_url

from mdb.maps.identity import ensure_on, identity_table, record_identities, server_ids
from mdb.store import Store
from mdb.testing.postgres import PostgresServer

__all__ = ["Databases", "Seed", "adopt_identities", "clones", "strip"]

Seed = Callable[[Store], None]
"""Writes a cluster's data through a Store: a module-level function, part of its template's key."""


class Databases(Protocol):
    """The ``pg_databases`` fixture (tests/support/plugin.py)."""

    def __call__(self, n: int = 1, *, templates: Sequence[str] | None = None) -> list[str]: ...

    def servers(self, n: int) -> list[PostgresServer]: ...


_built: dict[Hashable, list[str]] = {}
"""key -> the template databases, in the order of the servers of ``calls``."""


def clones(pg_databases: Databases, calls: Sequence[int], key: Hashable, build: Callable[[list[str], Path], None], folder: Path) -> list[str]:
    """URLs of fresh databases, ``pg_databases(calls[0]) + pg_databases(calls[1]) + ...``, each a
    copy of what ``build(urls, folder)`` made of the same servers' databases once per ``key``."""
    servers = [server for n in calls for server in pg_databases.servers(n)]
    key = (key, tuple(server.port for server in servers))
    if key not in _built:
        names = [f"tpl_{uuid.uuid4().hex[:16]}" for _ in servers]
        try:
            urls = [server.create_database(name) for server, name in zip(servers, names)]
            folder.mkdir()
            build(urls, folder)
        except BaseException:
            for server, name in zip(servers, names):
                server.drop_database(name)
            raise
        _built[key] = names
    urls, offset = [], 0
    for n in calls:
        urls += pg_databases(n, templates=_built[key][offset:offset + n])
        offset += n
    return urls


def strip(store: Store) -> None:
    """Take the identities out of a built template (each clone gets its own), and check that no
    other row names one of its databases or identities: every clone would carry it."""
    own = [make_url(spec.primary).database or "" for spec in store.map.servers.values()]
    for server in store.map.servers:
        with store.transaction(server) as conn:
            own += [str(identity) for identity in conn.execute(select(identity_table.c.identity)).scalars()]
    for server in store.map.servers:
        with store.transaction(server) as conn:
            present = set(sa_inspect(conn).get_table_names())
            conn.execute(delete(identity_table))
            if server_ids.name in present:
                conn.execute(delete(server_ids))
            leaked = [f"{table}.{column}" for table in sorted(present) for column in _text_columns(conn, table)
                      if _mentions(conn, table, column, own)]
            assert not leaked, f"the template of {server!r} names its databases or identities in {leaked}: its clones would too"


def adopt_identities(store: Store) -> None:
    """Give every database of a cloned cluster its own identity, recorded in CENTRAL, as
    ``apply_schema`` does for databases CENTRAL has no record of."""
    record_identities(store, {name: (ensure_on(store, name), spec.masked_primary) for name, spec in store.map.servers.items()})


def _text_columns(conn: Connection, table: str) -> list[str]:
    return [c["name"] for c in sa_inspect(conn).get_columns(table) if isinstance(c["type"], String)]


def _mentions(conn: Connection, table: str, column: str, texts: list[str]) -> bool:
    c = column_clause(column)
    return bool(conn.execute(select(func.count()).select_from(table_clause(table, c)).where(or_(*(c.contains(t) for t in texts)))).scalar())
