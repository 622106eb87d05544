"""The backend seam: one call for the relocation directory and layout stamps, whatever the server kind.

The same assertions run against a SQL (SQLite) and a MongoDB CENTRAL / shard, so the two
backends are held to one behaviour.
"""

from __future__ import annotations

import pytest
from support.mongo import MongoEnv

from mdb import GDID
from mdb.backends import backend_of
from mdb.backends.mongo import MongoBackend
from mdb.backends.sql import SqlBackend
from mdb.ownership import applying_mark
from mdb.relocations import load_relocation_reach, load_relocations, set_relocation, set_relocations
from mdb.router import Reach, ShardLayout, reach_of
from mdb.system_tables import briefcase_state


@pytest.mark.parametrize("central_on_mongo", [0, 2], ids=["sql-central", "mongo-central"])
def test_the_relocation_directory_is_set_loaded_and_cleared_through_the_central_backend(
    mongo_env: MongoEnv, central_on_mongo: int
) -> None:
    store = mongo_env.store(2, central_on_mongo=central_on_mongo)
    central = store.router.central_servers()[0]
    expected = MongoBackend if central_on_mongo else SqlBackend
    assert isinstance(backend_of(store.map, central), expected)
    moved, other = GDID(0, 0, 7), GDID(0, 0, 1234567)
    set_relocation(store, "docs", moved, "m1")
    set_relocation(store, "docs", other, "m2")
    set_relocation(store, "docs", moved, "m2")  # a second move of one briefcase replaces its entry
    assert load_relocations(store) == {("docs", moved): "m2", ("docs", other): "m2"}
    set_relocation(store, "docs", moved, None)  # back on its default shard
    assert load_relocations(store) == {("docs", other): "m2"}
    store.refresh()
    assert store.router.relocations == {("docs", other): "m2"}


RELOCATED = {
    GDID(0, 15, 5): "m2", GDID(0, 0, 7): "m2", GDID(0, 3, 100): "m2",  # authorities sort before counters in the bytes
    GDID(1, 0, 2): "m1", GDID(0, 0, 9): "m1",
}


@pytest.mark.parametrize("central_on_mongo", [0, 2], ids=["sql-central", "mongo-central"])
def test_the_directory_summary_per_target_server_counts_and_bounds_by_sharding_value(
    mongo_env: MongoEnv, central_on_mongo: int
) -> None:
    store = mongo_env.store(2, central_on_mongo=central_on_mongo)
    set_relocations(store, "docs", RELOCATED)
    set_relocation(store, "other", GDID(0, 0, 1), "m1")
    reach = load_relocation_reach(store)
    assert reach == {
        ("docs", "m2"): Reach(3, 5, 100),
        ("docs", "m1"): Reach(2, 9, GDID(1, 0, 2).sharding_value),
        ("other", "m1"): Reach(1, 1, 1),
    }
    assert reach == reach_of(load_relocations(store))  # what a router holding the directory derives
    store.refresh()
    assert store.router.relocation_reach == reach and not store.router.directory_loaded
    assert not reach[("docs", "m2")].overlaps(101, None) and reach[("docs", "m2")].overlaps(0, 6)


@pytest.mark.parametrize("server", ["c", "m1"], ids=["sql", "mongo"])
def test_a_layout_stamp_is_refused_when_it_differs_unless_replaced(mongo_env: MongoEnv, server: str) -> None:
    store = mongo_env.store(2)
    backend = backend_of(store.map, server)
    first = ShardLayout("probe", GDID.ZERO, None, 0, 2)
    moved = ShardLayout("probe", GDID.ZERO, None, 1, 2)
    assert backend.stamp_layout(store, server, first, 5, replace=False) is None
    assert backend.stamp_layout(store, server, first, 6, replace=False) is None  # the same layout: kept
    problem = backend.stamp_layout(store, server, moved, 6, replace=False)
    assert problem is not None and "mdb map apply" in problem and "'probe'" in problem
    assert backend.stamp_layout(store, server, moved, 6, replace=True) is None
    assert backend.stamp_layout(store, server, moved, 7, replace=False) is None  # now stamped as replaced


@pytest.mark.parametrize("server", ["c", "m1"], ids=["sql", "mongo"])
def test_a_map_applys_marker_never_replaces_a_reshards_freeze_and_is_cleared_alone(mongo_env: MongoEnv, server: str) -> None:
    store = mongo_env.store(2)
    if server == "c":  # a SQL server with shard tables (CENTRAL here has none of its own)
        with store.transaction(server) as conn:
            briefcase_state.create(conn, checkfirst=True)
    backend = backend_of(store.map, server)
    mark = applying_mark(3)
    assert backend.mark_applying(store, server, "probe", GDID.ZERO, mark)
    assert not backend.mark_applying(store, server, "probe", GDID.ZERO, mark)  # already marked
    assert backend.frozen_by(store, server, "probe", GDID.ZERO) == mark
    backend.freeze_partition(store, server, "held", GDID.ZERO, "reshard-x@2:0", lock_wait=5)
    assert not backend.mark_applying(store, server, "held", GDID.ZERO, mark)  # a reshard's freeze stays as it is
    assert backend.clear_applying(store, server) == 1
    assert backend.frozen_by(store, server, "probe", GDID.ZERO) is None
    assert backend.frozen_by(store, server, "held", GDID.ZERO) == "reshard-x@2:0"
