"""A batched cutover's verification (mdb.moves.batch) on real servers: it commits what is equal
and, when a briefcase still differs after its re-sync, names every differing key per table the
way a single move's report does (issue 30, step 2: a single move is to become a batch of one).

The copy is made wrong on purpose: after the real COPY has written a briefcase's rows (inside the
target transaction that commits them) the test drops, alters or adds one row, in the pre-copy and
again in the re-sync under the lock. Runs between two PostgreSQL servers (checksums in one SQL
statement), two SQLite files and PostgreSQL -> SQLite (checksums in Python on both sides).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.moves import Cluster, create_user, make_cluster, snapshot
from support.tamper import BUCKET, LINES, TAMPER
from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from mdb.errors import BatchAbortedError
from mdb.gdid import GDID
from mdb.moves import batch_sql
from mdb.moves.batch import BatchMove, BatchResult, hold_schemas
from mdb.moves.journal import ABORTED, DONE, Journal
from mdb.moves.move import area_tables
from mdb.store import Store
from mdb.system_tables import briefcase_state

SERVERS = ["u1", "u2"]
USERS = [GDID(0, 0, 7), GDID(0, 0, 8)]
TAMPERED = USERS[0]


@pytest.fixture(params=["postgres", "sqlite", "postgres-to-sqlite"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Cluster:
    if request.param == "postgres":
        urls = request.getfixturevalue("pg_databases")(3)
    elif request.param == "sqlite":
        urls = request.getfixturevalue("tmp_sqlite_urls")(3)
    else:
        urls = [*request.getfixturevalue("pg_databases")(2), *request.getfixturevalue("tmp_sqlite_urls")(1)]
    cluster = make_cluster(dict(zip(["c", *SERVERS], urls)), tmp_path, [("0:0:0", ["u1"])])
    with cluster.store() as store:
        for gdid in USERS:
            create_user(store, gdid, orders=2, lines=3)
    return cluster


def _run_batch(store: Store) -> BatchResult:
    """Both briefcases from u1 to u2 as one batch, inside the pass's schema hold (as a reshard runs it)."""
    tables = area_tables(store, "user")
    with hold_schemas(store, "user", SERVERS, tables) as hashed:
        return BatchMove(store, Journal(store), "user", USERS, "u1", "u2", reshard_id=None, tables=tables, hashed=hashed).run()


def _rows_on(store: Store, server: str) -> int:
    with store.transaction(server) as conn:
        return conn.execute(select(func.count()).select_from(LINES).where(LINES.c.user_id.in_(USERS))).scalar_one()


def test_a_batch_verifies_and_commits_on_every_pair_of_dialects(cluster: Cluster) -> None:
    """PostgreSQL -> SQLite sums in Python on both sides: a source summed by SQL digest would
    differ from every target sum, and every batch would be refused (split into single moves)."""
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
        result = _run_batch(store)
        assert sorted(result.rows) == USERS and result.rows_per_table["order_line_items"] == 12
        assert snapshot(store, SERVERS) == before
        assert _rows_on(store, "u1") == 0 and _rows_on(store, "u2") == 12
        store.refresh()
        assert {store.router.locate("user", g).server for g in USERS} == {"u2"}
        assert [e.status for e in Journal(store).entries()] == [DONE]


@pytest.mark.parametrize("kind", sorted(TAMPER))
def test_a_briefcase_still_different_after_its_resync_is_reported_key_by_key(
    cluster: Cluster, kind: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    tampered: list[GDID] = []

    def tampering(real: Callable[..., Any]) -> Callable[..., Any]:
        def copy(src: Connection, dst: Connection, *args: Any, **kwargs: Any) -> Any:
            out = real(src, dst, *args, **kwargs)
            tampered.append(TAMPER[kind](dst, TAMPERED))  # same target transaction: commits with the copy
            return out
        return copy

    monkeypatch.setattr(batch_sql, "copy_batch", tampering(batch_sql.copy_batch))  # the pre-copy
    monkeypatch.setattr(batch_sql, "apply_diffs", tampering(batch_sql.apply_diffs))  # the row-level re-sync under the lock
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
        with pytest.raises(BatchAbortedError) as caught:
            _run_batch(store)
        assert len(tampered) == 2, "the pre-copy and the re-sync did not both run"
        error = caught.value
        assert error.refused == [TAMPERED]
        bucket = BUCKET[kind]
        (line,) = error.mismatches
        assert line.startswith("order_line_items: ") and f"{bucket}: ['{TAMPERED},{tampered[0]}']" in line, line
        rows = {"dropped": (6, 5), "altered": (6, 6), "extra": (6, 7)}[kind]
        assert f"source {rows[0]} rows, target {rows[1]} rows" in line, line
        # rolled back with the source authoritative: nothing of the batch on the target, no fence
        assert snapshot(store, SERVERS) == before
        assert _rows_on(store, "u1") == 12 and _rows_on(store, "u2") == 0
        for server in SERVERS:
            with store.transaction(server) as conn:
                assert conn.execute(select(func.count()).select_from(briefcase_state)).scalar_one() == 0, server
        (entry,) = Journal(store).entries()
        assert entry.status == ABORTED and line in (entry.detail or ""), entry.detail
