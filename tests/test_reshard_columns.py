"""A mover holding older models never drops a column a migration added between its passes (issue 28 item 3).

A reshard runs with the models it imported; between two of its passes (the first pass's schema
locks let go) every shard gets a new column, the application (new version) writes it for
briefcases created meanwhile, and the reshard's next pass would have copied those briefcases
with the old column list: the new values arrive as NULL. The pass now compares the live tables
with its models under its schema lock and refuses; the values stay where they were.
"""

from __future__ import annotations

import pytest
from movehelp import Cluster, add_transaction, create_user
from sqlalchemy import text
from test_reshard_batches import SERVERS, cluster  # noqa: F401

from mdb import faults
from mdb.errors import SchemaError
from mdb.gdid import GDID
from mdb.moves.reshard import reshard

OLD, NEW = ["u1", "u2"], ["u1", "u2", "x"]


def test_a_column_added_between_two_passes_is_refused_not_dropped(cluster: Cluster) -> None:  # noqa: F811
    newcomers = [GDID(0, 0, c) for c in range(100, 130) if OLD[c % 2] != NEW[c % 3]][:3]  # they move under 2 -> 3
    written: list[int] = []

    def migrate_between_passes(point: str) -> None:
        if point != "reshard.between_passes" or written:
            return
        for server in SERVERS:
            with admin.transaction(server) as conn:
                conn.execute(text("ALTER TABLE transactions ADD COLUMN note text"))
        for n, g in enumerate(newcomers):  # the new application version writes the new column
            create_user(admin, g, orders=1, lines=1)
            add_transaction(admin, g, 9_000_000 + n, n)
            with admin.transaction(admin.router.locate("user", g).server) as conn:
                conn.execute(text("UPDATE transactions SET note = 'kept' WHERE transaction_id = :t"),
                             {"t": bytes(GDID(0, 4, 9_000_000 + n))})
            written.append(n)

    with cluster.store() as store, cluster.store() as admin:
        faults.hook = migrate_between_passes
        try:
            with pytest.raises(SchemaError, match=r"reshard pass of area 'user'.*note"):
                reshard(store, "user", GDID(0, 0, 0), NEW, map_path=cluster.path)
        finally:
            faults.hook = None
        assert written, "the reshard never reached a second pass"
        kept = 0
        for server in SERVERS:
            with admin.transaction(server) as conn:
                kept += conn.execute(text("SELECT count(*) FROM transactions WHERE note = 'kept'")).scalar_one()
        assert kept == len(newcomers), f"{len(newcomers) - kept} value(s) of the new column lost"
