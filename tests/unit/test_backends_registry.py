"""The backend registry: a server's kind (from its URL scheme) picks one backend per kind."""

from __future__ import annotations

import pytest

from mdb import backends
from mdb.backends.mongo import MongoBackend
from mdb.backends.sql import SqlBackend
from mdb.urls import MONGO, SQL, kind_of_url


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@h/db", "sqlite:///x.db", "weird+driver://h/x", "no-scheme-at-all"])
def test_an_unknown_or_sql_scheme_is_served_by_the_sql_backend(url: str) -> None:
    assert kind_of_url(url) == SQL
    assert isinstance(backends.backend_for(kind_of_url(url)), SqlBackend)


@pytest.mark.parametrize("url", ["mongodb://h/x", "mongodb+srv://cluster.example/x", " MongoDB://h/x"])
def test_mongodb_schemes_are_served_by_the_mongo_backend(url: str) -> None:
    backend = backends.backend_for(kind_of_url(url))
    assert isinstance(backend, MongoBackend)
    assert backend.kind == MONGO


def test_one_instance_per_kind() -> None:
    assert backends.backend_for(SQL) is backends.backend_for(SQL)


def test_a_second_backend_for_a_kind_fails() -> None:
    with pytest.raises(ValueError, match="already has a backend"):
        backends.register_backend(SQL, SqlBackend)
    with pytest.raises(ValueError, match="already has a backend"):
        backends.register_backend(MONGO, MongoBackend)
    assert isinstance(backends.backend_for(SQL), SqlBackend)  # the first registration stands


def test_a_kind_without_a_backend_is_refused_by_name() -> None:
    from mdb.errors import RoutingError

    with pytest.raises(RoutingError, match="no backend serves servers of kind 'cassandra'"):
        backends.backend_for("cassandra")


CAPABILITY_MAP = """\
version: 1
servers:
  c: {primary: "sqlite:///c.db"}
  docs: {primary: "mongodb://h/docs"}
  s: {primary: "postgresql+psycopg://u@h/s"}
areas:
  central: {kind: central, shards: [c]}
  user:
    partitions: [{start: "0:0:0", shards: [s]}]
"""


def test_servers_are_picked_by_what_their_backend_can_do_in_map_order() -> None:
    from mdb.partition_map import parse_map

    pmap = parse_map(CAPABILITY_MAP)
    assert backends.servers_where(pmap, lambda b: b.follows_histories) == ["c", "s"]
    assert backends.servers_where(pmap, lambda b: b.has_identity) == ["c", "s"]
    assert backends.servers_where(pmap, lambda b: b.holds_documents) == ["docs"]
    assert backends.servers_where(pmap, lambda b: b.declares_indexes, ["s", "docs"]) == ["docs"]
    assert not backends.backend_of(pmap, "docs").keeps_records  # no map history or ledger on a MongoDB CENTRAL
