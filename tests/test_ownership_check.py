"""The ownership check as the engines' BEGIN prelude: :class:`mdb.ownership.OwnershipCheck`.

The Store hands the engine an :class:`~mdb.ownership.OwnershipCheck` and needs no
``dialect.name`` branch: the engine's BEGIN calls the method of its own kind, which runs that
kind's rendering of the check (:func:`~mdb.ownership.ownership_prelude`). Its own module because
it borrows test_stale_routing's stamped clusters, whose ``pg_cluster`` fixture shadows conftest's.
"""

from __future__ import annotations

import pytest
from test_stale_routing import Cluster, pg_cluster, sqlite_cluster  # noqa: F401  (the fixtures)

from mdb.engines import set_prelude, take_result
from mdb.gdid import GDID
from mdb.ownership import OwnershipCheck, check_ownership, ownership_prelude


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
@pytest.mark.parametrize(("lock", "exclusive"), [(False, False), (True, False), (True, True)])
def test_ownership_check_runs_the_rendering_of_the_engines_kind(
    kind: str, lock: bool, exclusive: bool, request: pytest.FixtureRequest
) -> None:
    """:class:`~mdb.ownership.OwnershipCheck` returns, on each kind, the row its kind's rendering returns."""
    cluster: Cluster = request.getfixturevalue("pg_cluster" if kind == "postgresql" else "sqlite_cluster")
    store = cluster.store()
    placement = store.router.locate("user", GDID(0, 0, 7))
    readonly = not lock
    rows = []
    for prelude in (OwnershipCheck(placement, lock, exclusive), ownership_prelude(kind, placement, lock, exclusive)):
        with store.connect(placement.server, readonly) as conn:
            assert conn.dialect.name == kind
            set_prelude(conn, prelude)
            conn.begin()
            rows.append(take_result(conn))
            check_ownership(rows[-1], placement, store.router.version)  # stamped as routed: no error
            conn.rollback()
    assert rows[0] == rows[1] and rows[0] is not None and len(rows[0]) == 1
