"""A server behind PgBouncer (transaction pooling) whose map entry lacks ``pooler: transaction`` (issue 29).

mdb then prepares its ownership-check statements per client connection, and PgBouncer hands
two client connections the same server session: the second prepare meets the first's
statement (or a statement prepared elsewhere is missing). That used to surface as a raw
DuplicatePreparedStatement with the hint "run `mdb schema apply MAP`"; it is one MapError line
naming the server and the missing ``pooler: transaction``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from support.pgbouncer import pooled_servers

from mdb.demo.models import User, UserBriefcase
from mdb.errors import MapError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store


def test_an_undeclared_transaction_pooler_is_named_in_one_line(
    pg_databases: Callable[[int], list[str]], pgbouncer: Callable[..., Any], tmp_path: Path,
) -> None:
    direct = dict(zip(["c", "u1"], pg_databases(2)))
    direct_map = write_map(tmp_path, direct, central=["c"], partitions=[("0:0:0", ["u1"])], filename="direct.yaml")
    with Store.from_yaml(direct_map, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
    _, pooled = pooled_servers(pgbouncer, direct, pool_size=1)  # one server session behind every client connection
    undeclared = write_map(tmp_path, pooled, central=["c"], partitions=[("0:0:0", ["u1"])], filename="pooled.yaml")
    # Two applications (two pools of client connections), one server session behind both.
    with Store.from_yaml(undeclared, types=[UserBriefcase]) as one, Store.from_yaml(undeclared, types=[UserBriefcase]) as two:
        with pytest.raises(MapError, match=r"server 'u1': .*add `pooler: transaction` to this server in the map"):
            for n in range(1, 20):  # the ownership check prepares its statements on each connection's first use
                g = GDID(0, 0, n)
                for store in (one, two):
                    with store.briefcase(UserBriefcase, g, readonly=True) as s:
                        s.get(User, g)
