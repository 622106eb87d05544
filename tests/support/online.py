"""Shared by test_moves_online and the suites beside it (moved out of test_moves_online, which used to be imported by other test modules)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
import pytest
from support.moves import Cluster, cloned_cluster, create_user
from support.templates import Databases
from sqlalchemy import select
from mdb.demo.models import Transaction
from mdb.gdid import GDID
from mdb.store import Store

SERVERS = ["u1", "u2", "x"]
USERS = [GDID(0, 0, i) for i in range(1, 9)]


def _users(store: Store) -> None:
    for g in USERS:
        create_user(store, g, orders=1, lines=2)


@pytest.fixture
def cluster(pg_databases: Databases, tmp_path: Path) -> Cluster:
    return cloned_cluster(pg_databases, ["c", *SERVERS], tmp_path, [("0:0:0", ["u1", "u2"])], seed=_users)


def _transactions(cluster: Cluster) -> Counter[tuple[str, GDID, int]]:
    out: Counter[tuple[str, GDID, int]] = Counter()
    with cluster.store() as store:
        for server in SERVERS:
            with store.transaction(server) as conn:
                for uid, tid in conn.execute(select(Transaction.__table__.c.user_id, Transaction.__table__.c.transaction_id)):
                    out[(server, uid, tid.counter)] += 1
    return out
