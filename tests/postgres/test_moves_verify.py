"""Verification catches a bad copy, and the commit point deletes only what was verified.

A single move is a batch of one (docs/dev/0017): a pre-copy outside the lock, then a row-level
re-sync of what differs under it. The copy is made wrong on purpose, on real servers: after the
real pre-copy and again after the re-sync has written the target rows (inside the target
transaction that commits them), the test drops one, alters one or adds one that the source does
not have. Verification queries both servers independently of the copy stream, so each must
abort the move naming the key, leave the source untouched and authoritative, and leave nothing
of the briefcase on the target. A write that slips past the briefcase's lock on the source
between its checksums and the delete must abort the move too, instead of being deleted
uncopied. A tampered pre-copy alone is repaired by the re-sync under the lock.
Runs between two PostgreSQL servers (checksums in SQL), two SQLite files and PostgreSQL ->
SQLite (checksums in Python).
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
from support.moves import Cluster, create_user, make_cluster, snapshot
from support.tamper import BUCKET, EXTRA_LINE, LINES, TAMPER, line_key
from sqlalchemy import func, insert, select
from sqlalchemy.engine import Connection

from mdb.gdid import GDID
from mdb.errors import MoveAbortedError
from mdb.moves import batch as batch_module, batch_sql, move_briefcase
from mdb.moves.journal import ABORTED, Journal
from mdb.system_tables import briefcase_state

SERVERS = ["u1", "u2"]
USER = GDID(0, 0, 7)




def _cluster(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> Cluster:
    if kind == "postgres":
        urls = request.getfixturevalue("pg_databases")(3)
    elif kind == "sqlite":
        urls = request.getfixturevalue("tmp_sqlite_urls")(3)
    else:
        urls = [*request.getfixturevalue("pg_databases")(2), *request.getfixturevalue("tmp_sqlite_urls")(1)]
    cluster = make_cluster(dict(zip(["c", *SERVERS], urls)), tmp_path, [("0:0:0", ["u1"])])
    with cluster.store() as store:
        create_user(store, USER, orders=2, lines=3)
    return cluster


@pytest.fixture(params=["postgres", "sqlite", "postgres-to-sqlite"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Cluster:
    return _cluster(request, tmp_path, str(request.param))


@pytest.fixture(params=["postgres", "postgres-to-sqlite"])
def pg_source_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Cluster:
    """A SQLite source is left out: its move holds the database's write lock, nothing slips past."""
    return _cluster(request, tmp_path, str(request.param))


def _briefcase_rows(conn: Connection) -> int:
    return conn.execute(select(func.count()).select_from(LINES).where(LINES.c.user_id == USER)).scalar_one()


def _assert_source_authoritative(cluster: Cluster, before: dict[str, Any]) -> None:
    with cluster.store() as store:
        assert snapshot(store, SERVERS) == before, "the source lost or gained rows, or the target kept some"
        with store.transaction("u2") as conn:
            assert _briefcase_rows(conn) == 0
            assert conn.execute(select(func.count()).select_from(briefcase_state)).scalar_one() == 0
        with store.transaction("u1") as conn:
            assert conn.execute(select(func.count()).select_from(briefcase_state)).scalar_one() == 0, "a fence was left"
        assert store.router.locate("user", USER).server == "u1"
        entries = Journal(store).entries()
        assert [e.status for e in entries] == [ABORTED]


@pytest.fixture(params=["whole", "blocks"])
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """'blocks': the pre-copy sums key ranges of 2 rows (normally 20,000) and the re-sync compares
    them first, fetching rows only of the ranges that differ (between PostgreSQL servers)."""
    if request.param == "blocks":
        monkeypatch.setattr(batch_sql, "RESYNC_BLOCK", 2)
    return str(request.param)


def _tamper_copies(monkeypatch: pytest.MonkeyPatch, tamper: Callable[[Connection], None], *, resync: bool = True) -> list[str]:
    """Run ``tamper(dst)`` after the pre-copy's COPY (and, with ``resync``, after the re-sync's
    rows) in the target transaction that commits them; returns which of them ran."""
    ran: list[str] = []
    real_copy, real_apply = batch_sql.copy_batch, batch_sql.apply_diffs

    def bad_copy(src: Connection, dst: Connection, *args: Any, **kwargs: Any) -> dict[str, int]:
        counts = real_copy(src, dst, *args, **kwargs)
        tamper(dst)
        ran.append("precopy")
        return counts

    def bad_apply(src: Connection, dst: Connection, *args: Any, **kwargs: Any) -> int:
        redone = real_apply(src, dst, *args, **kwargs)
        tamper(dst)
        ran.append("resync")
        return redone

    monkeypatch.setattr(batch_sql, "copy_batch", bad_copy)
    if resync:
        monkeypatch.setattr(batch_sql, "apply_diffs", bad_apply)
    return ran


@pytest.mark.parametrize("kind", sorted(TAMPER))
def test_a_copy_that_dropped_altered_or_added_a_row_is_caught(cluster: Cluster, blocks: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tampered: list[GDID] = []
    ran = _tamper_copies(monkeypatch, lambda dst: tampered.append(TAMPER[kind](dst, USER)))
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
        with pytest.raises(MoveAbortedError, match=r"aborted and rolled back, 'u1' is still authoritative: verification failed") as caught:
            move_briefcase(store, "user", USER, "u2")
    assert ran == ["precopy", "resync"], "the pre-copy and the re-sync did not both run"
    error = caught.value
    assert any(m.startswith("order_line_items:") and str(tampered[0]) in m for m in error.mismatches), error.mismatches
    bucket = BUCKET[kind]
    line = next(m for m in error.mismatches if m.startswith("order_line_items:"))
    assert f"{bucket}: ['{USER},{tampered[0]}']" in line, line
    _assert_source_authoritative(cluster, before)


def test_a_write_past_the_lock_is_not_deleted_uncopied(pg_source_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Something writes to the source without the briefcase lock after the checksums were taken
    (the move deletes only after both sides' checksums exist): the commit point's delete would
    remove a row that was never copied, so the move aborts. Between PostgreSQL servers the
    source's sums are those of the rows its one statement deletes, so there is no such gap:
    a row written before that statement is summed, differs from the target, and is re-synced."""
    rogue = GDID(0, 3, 77)
    real_delete, real_cut = batch_sql.delete_batch, batch_module.fence_and_delete

    def rogue_write() -> None:
        with pg_source_cluster.store() as other, other.transaction("u1") as rogue_conn:  # no briefcase lock
            row = rogue_conn.execute(select(LINES).where(LINES.c.user_id == USER).limit(1)).mappings().one()
            rogue_conn.execute(insert(LINES).values({**row, "line_id": rogue}))

    def delete_after_a_rogue_write(conn: Connection, *args: Any, **kwargs: Any) -> dict[str, int]:
        rogue_write()
        return real_delete(conn, *args, **kwargs)

    def cut_after_a_rogue_write(*args: Any, **kwargs: Any) -> Any:
        if not wrote:
            wrote.append(True)
            rogue_write()
        return real_cut(*args, **kwargs)

    wrote: list[bool] = []
    with pg_source_cluster.store() as store:
        with store.transaction("u2") as conn:
            in_one_statement = conn.dialect.name == "postgresql"  # else a SQLite target: the cut is several statements
        if in_one_statement:
            monkeypatch.setattr(batch_module, "fence_and_delete", cut_after_a_rogue_write)
            result = move_briefcase(store, "user", USER, "u2")
            assert result.status == "done" and result.tables["order_line_items"][0] == 7
            rows, rogue_on = {"u1": 0, "u2": 7}, "u2"
        else:
            monkeypatch.setattr(batch_sql, "delete_batch", delete_after_a_rogue_write)
            with pytest.raises(MoveAbortedError, match=r"order_line_items: 7 deleted, 6 verified") as caught:
                move_briefcase(store, "user", USER, "u2")
            assert "the commit point would delete rows that were not verified" in str(caught.value)
            rows, rogue_on = {"u1": 7, "u2": 0}, "u1"
        for server in SERVERS:
            with store.transaction(server) as conn:
                assert _briefcase_rows(conn) == rows[server], server
                found = conn.execute(select(func.count()).select_from(LINES).where(LINES.c.line_id == rogue)).scalar_one()
                assert found == (1 if server == rogue_on else 0), server


def test_a_tampered_precopy_is_repaired_under_the_lock(
    cluster: Cluster, blocks: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The pre-copy runs outside the lock; whatever differs afterwards is re-synced and verified:
    exactly the 3 differing rows are redone (by key ranges first with 'blocks')."""
    def every_tamper(dst: Connection) -> None:
        for tamper in TAMPER.values():
            tamper(dst, USER)

    ran = _tamper_copies(monkeypatch, every_tamper, resync=False)
    caplog.set_level(logging.INFO, logger="mdb.moves")
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
        result = move_briefcase(store, "user", USER, "u2")
        assert result.precopied and result.status == "done" and ran == ["precopy"]
        assert snapshot(store, SERVERS) == before
        with store.transaction("u2") as conn:
            assert _briefcase_rows(conn) == 6
        with store.transaction("u1") as conn:
            assert _briefcase_rows(conn) == 0
    assert any("re-synced 3 changed row(s) under the lock" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_writes_between_the_precopy_and_the_lock_are_resynced(
    cluster: Cluster, blocks: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The application changes the source after the pre-copy (before the lock): an added, an
    altered and a deleted row all arrive, and nothing else is redone."""
    real_fault_point = batch_module.fault_point

    def writes_after_the_precopy(name: str) -> None:
        if name == "batch.after_precopy":  # the pre-copy is committed, the lock not yet taken
            with cluster.store() as app, app.transaction("u1") as conn:
                for tamper in TAMPER.values():
                    tamper(conn, USER)
        real_fault_point(name)

    monkeypatch.setattr(batch_module, "fault_point", writes_after_the_precopy)
    caplog.set_level(logging.INFO, logger="mdb.moves")
    with cluster.store() as store:
        result = move_briefcase(store, "user", USER, "u2")
        assert result.precopied and result.status == "done"
        with store.transaction("u2") as conn:
            lines = {r.line_id: r.quantity for r in conn.execute(select(LINES).where(LINES.c.user_id == USER))}
        with store.transaction("u1") as conn:
            assert _briefcase_rows(conn) == 0
    expected = {line_key(USER, o, i): i + 1 for o in range(2) for i in range(3)}
    del expected[line_key(USER, 0, 1)]
    expected[line_key(USER, 1, 0)] = 999
    expected[EXTRA_LINE] = 1
    assert lines == expected
    assert any("re-synced 3 changed row(s)" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_statement_that_would_outlast_max_pause_is_cancelled_and_the_move_aborted(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--max-pause bounds the pause (PostgreSQL): every statement under the lock gets the time
    left as its ``statement_timeout``. A source that takes 30 s over its cut (here a sleep in the
    locked source transaction) is cancelled at the bound instead of being waited for, and the
    move is aborted with the source authoritative."""
    cluster = _cluster(request, tmp_path, "postgres")
    real_cut = batch_module.fence_and_delete
    finished: list[bool] = []

    def slow_source(src: Connection, *args: Any, **kwargs: Any) -> Any:
        cut = real_cut(src, *args, **kwargs)
        src.exec_driver_sql("SELECT pg_sleep(30)")
        finished.append(True)
        return cut

    monkeypatch.setattr(batch_module, "fence_and_delete", slow_source)
    with cluster.store() as store:
        before = snapshot(store, SERVERS)
        with pytest.raises(MoveAbortedError, match=r"cancelled at --max-pause 0\.50s \(canceling statement due to statement timeout\)"):
            move_briefcase(store, "user", USER, "u2", max_pause=0.5)
    assert finished == [], "the slow statement ran to its end instead of being cancelled at the bound"
    _assert_source_authoritative(cluster, before)
