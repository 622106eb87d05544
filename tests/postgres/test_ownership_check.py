"""The ownership check as the engines' BEGIN prelude: :class:`mdb.ownership.OwnershipCheck`.

The Store hands the engine an :class:`~mdb.ownership.OwnershipCheck` and needs no
``dialect.name`` branch: the engine's BEGIN calls the method of its own kind, which runs that
kind's rendering of the check (:func:`~mdb.ownership.ownership_prelude`). Its own module because
it borrows test_stale_routing's stamped clusters (tests/support/stale.py).
"""

from __future__ import annotations

import pytest
from support.stale import Cluster, stale_pg_cluster, stale_sqlite_cluster  # noqa: F401  (the fixtures)

from mdb import Store
from mdb.engines import set_prelude, take_result
from mdb.errors import StaleRouteError
from mdb.gdid import GDID
from mdb.ownership import OwnershipCheck, check_ownership, lock_key_sql
from mdb.router import Placement


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
@pytest.mark.parametrize(("lock", "exclusive"), [(False, False), (True, False), (True, True)])
def test_the_ownership_check_confirms_the_routed_shard_and_refuses_another(
    kind: str, lock: bool, exclusive: bool, request: pytest.FixtureRequest
) -> None:
    """:class:`~mdb.ownership.OwnershipCheck`, run by the engine's BEGIN, reads the stamp of the
    server it runs on: the shard the map routes to passes, another shard of the area is refused;
    on PostgreSQL it holds the briefcase's lock in the mode asked for (another session sees it)."""
    cluster: Cluster = request.getfixturevalue("stale_pg_cluster" if kind == "postgresql" else "stale_sqlite_cluster")
    store = cluster.store()
    placement = store.router.locate("user", GDID(0, 0, 7))
    other = next(s for s, layout in store.router.layouts()
                 if layout.area == "user" and layout.partition_start == placement.partition_start and s != placement.server)
    for server in (placement.server, other):
        with store.connect(server, not lock) as conn:
            assert conn.dialect.name == kind
            set_prelude(conn, OwnershipCheck(placement, lock, exclusive))
            conn.begin()
            rows = take_result(conn)
            if server == other:
                with pytest.raises(StaleRouteError, match="stamped"):
                    check_ownership(rows, placement, store.router.version)
            else:
                check_ownership(rows, placement, store.router.version)  # stamped as routed: no error
                if kind == "postgresql":
                    assert _others_may_lock(store, server, placement, exclusive=True) is not lock
                    assert _others_may_lock(store, server, placement, exclusive=False) is not (lock and exclusive)
            conn.rollback()


def _others_may_lock(store: Store, server: str, placement: Placement, *, exclusive: bool) -> bool:
    """Whether another session could take the briefcase's advisory lock now (in ``exclusive`` or shared mode)."""
    try_lock = "pg_try_advisory_xact_lock" if exclusive else "pg_try_advisory_xact_lock_shared"
    with store.connect(server) as conn, conn.begin():
        return bool(conn.exec_driver_sql(f"SELECT {try_lock}({lock_key_sql(placement.area, placement.gdid)})").scalar_one())
