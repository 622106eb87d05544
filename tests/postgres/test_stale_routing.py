"""A stale router cannot lose data (docs/design.md invariant 2).

A Store caches the map and the relocation directory. These tests make that cache wrong on
purpose (an older map version, a re-stamped shard, a briefcase that moved away, a move in
progress) and check that the shard refuses the session, the Store refreshes and retries, and
nothing is ever written to the wrong shard: every shard is read directly afterwards.

Moves are simulated here with plain SQL (copy rows, 'resident' on the target, 'gone' fence on
the source, relocation directory entry): the move tool lives in its own issue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.engine import Connection

from mdb.demo.models import Address, User, UserBriefcase
from mdb.errors import BriefcaseMovingError, StaleRouteError
from mdb.gdid import GDID
from mdb.moves.freeze import freeze_partition, frozen_by, unfreeze_partition
from mdb.ownership import lock_key_sql, ownership_prelude
from mdb.maps import apply as apply_module
from mdb.maps.apply import apply_map
from mdb.maps.history import maps_server
from mdb.partition_map import PartitionMap, load_map
from mdb.relocations import set_relocation
from mdb.router import Router, ShardLayout
from mdb.schema import stamp_layout
from mdb.system_tables import STATE_GONE, STATE_INCOMING, STATE_RESIDENT, briefcase_state
from support.pgbouncer import THROUGH_PGBOUNCER, Pooling
from support.stale import Cluster, SHARDS, V2, _cluster, count_refreshes, count_waits, create_user, move_by_hand, stale_pg_cluster, restamp_for, rows_on_every_shard, stale_sqlite_cluster  # noqa: F401 (fixtures: stale_pg_cluster, stale_sqlite_cluster)
from support.stale import copy_briefcase, delete_briefcase, set_state



@pytest.fixture(params=["postgresql", "sqlite", "pgbouncer"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """The suite's cluster on PostgreSQL, on SQLite, and on PostgreSQL through a transaction-mode PgBouncer."""
    if request.param == "pgbouncer":
        pooling = Pooling(request.getfixturevalue("pg_databases"), request.getfixturevalue("pgbouncer"))
        yield from _cluster(pooling.databases(4) + pooling.databases(3), tmp_path, pooling.write_map)
        return
    yield request.getfixturevalue("stale_pg_cluster" if request.param == "postgresql" else "stale_sqlite_cluster")


def test_the_sqlite_check_is_one_text_for_every_briefcase(stale_sqlite_cluster: Cluster) -> None:
    """On SQLite the check's values are parameters, so sqlite3's statement cache parses the
    text once per connection (inlined, every briefcase was a new text: 24 µs instead of 9)."""
    router = stale_sqlite_cluster.store().router
    a, b = (router.locate("user", GDID(0, 0, n)) for n in (1, 2))
    for lock in (False, True):
        first, second = ownership_prelude("sqlite", a, lock), ownership_prelude("sqlite", b, lock)
        assert first.statements == second.statements
        assert "X'" not in first.statements[-1] and first.params["gdid"] == bytes(a.gdid) != second.params["gdid"]


# -- an older map ------------------------------------------------------------------------------


def test_store_with_an_older_map_is_refused_and_retried_on_the_right_shard(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_writer, old_reader = cluster.store(), cluster.store()
    assert old_writer.map.version == 1
    cluster.publish(2, V2)  # a partition above the high-water mark...
    restamp_for(cluster, 2)  # ...bounds the old last partition: u1 and u2 now own [0, 1000)

    gdid = GDID(0, 0, 1500)  # version 1: u1 (1500 % 2 = 0); version 2: u3 (1500 % 3 = 0)
    assert Router(load_map(cluster.path)).locate("user", gdid).server == "u3"
    assert old_writer.router.locate("user", gdid).server == "u1"
    refreshes = count_refreshes(old_writer, monkeypatch)
    assert create_user(old_writer, gdid) == "u3"
    assert len(refreshes) == 1 and old_writer.map.version == 2
    assert rows_on_every_shard(old_writer, gdid) == {s: (2 if s == "u3" else 0) for s in SHARDS}

    # A stale reader would find nothing on u1 and answer "no such user"; it is sent to u3.
    reads = count_refreshes(old_reader, monkeypatch)
    with old_reader.briefcase(UserBriefcase, gdid, readonly=True) as session:
        assert session.placement.server == "u3"
        assert session.scalars(select(User.user_id)).all() == [gdid]
    assert len(reads) == 1

    # Briefcases below the new partition keep routing to the same shards under both versions.
    assert create_user(cluster.store(), GDID(0, 0, 501)) == "u2"


def test_shard_restamped_with_another_layout_refuses_until_the_retries_run_out(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = cluster.store(max_stale_retries=2)
    with store.transaction("u1") as conn:
        assert stamp_layout(conn, ShardLayout("user", GDID.ZERO, None, 0, 3), 1, replace=True) is None
    gdid = GDID(0, 0, 8)  # u1 in the map
    refreshes = count_refreshes(store, monkeypatch)
    with pytest.raises(StaleRouteError, match=r"server 'u1': the server is stamped partition \[0:0:0, open\) shard 0 of 3 but map version 1 routed it to partition \[0:0:0, open\) shard 0 of 2"):
        create_user(store, gdid)
    assert len(refreshes) == 2  # three attempts: the first and max_stale_retries retries
    assert rows_on_every_shard(store, gdid) == {s: 0 for s in SHARDS}
    # The other shard of the partition is unaffected.
    assert create_user(store, GDID(0, 0, 9)) == "u2"


# -- a briefcase that moved --------------------------------------------------------------------


def test_fence_and_relocation_send_a_stale_store_to_the_new_shard(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    gdid = GDID(0, 0, 4)
    stale = cluster.store()
    stale_reader = cluster.store()
    assert create_user(stale, gdid) == "u1"
    move_by_hand(cluster.store(), gdid, "u1", "x")
    assert rows_on_every_shard(stale, gdid) == {s: (2 if s == "x" else 0) for s in SHARDS}

    refreshes = count_refreshes(stale, monkeypatch)
    with stale.briefcase(UserBriefcase, gdid) as session:
        assert (session.placement.server, session.placement.relocated) == ("x", True)
        assert session.placement.default_server == "u1"
        assert session.get(User, gdid) is not None
        session.add(Address(address_id=GDID(0, 2, 4), line1="2 Side St", city="Shelbyville", country="US"))
    # the fence on u1 named x: the retry went there directly, no refresh, and x is remembered
    assert refreshes == [] and stale.routes.get("user", gdid) == "x"
    assert not stale.router.directory_loaded  # routed without the relocation directory
    assert rows_on_every_shard(stale, gdid) == {s: (3 if s == "x" else 0) for s in SHARDS}

    with stale_reader.briefcase(UserBriefcase, gdid, readonly=True) as session:
        assert session.placement.server == "x"
        assert len(session.scalars(select(Address)).all()) == 2


def test_a_relocation_without_resident_record_is_refused(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A location hint alone is not trusted: the target must say the briefcase lives there."""
    gdid = GDID(0, 0, 6)
    store = cluster.store(max_stale_retries=0)
    store.routes.learn("user", gdid, "x")  # a wrong hint (as a directory entry without its move would be)
    set_relocation(store, "user", gdid, "x")
    with pytest.raises(StaleRouteError, match=r"routed here away from its default shard \(a fence or the relocation directory\) but the server holds no resident record"):
        create_user(store, gdid)
    assert rows_on_every_shard(store, gdid) == {s: 0 for s in SHARDS}

    # with a retry left, the hint is forgotten and the briefcase is created where the map puts it
    store = cluster.store(max_stale_retries=1)
    store.routes.learn("user", gdid, "x")
    refreshes = count_refreshes(store, monkeypatch)
    assert create_user(store, gdid) == "u1"
    assert len(refreshes) == 1 and store.routes.get("user", gdid) is None
    assert rows_on_every_shard(store, gdid) == {s: (2 if s == "u1" else 0) for s in SHARDS}


@pytest.mark.slow  # 28 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_incoming_copy_makes_sessions_wait(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    gdid = GDID(0, 0, 12)
    admin = cluster.store()
    assert create_user(admin, gdid) == "u1"
    move_by_hand(admin, gdid, "u1", "x", target_state=STATE_INCOMING)

    impatient = cluster.store(move_wait_seconds=0.2)
    with pytest.raises(BriefcaseMovingError, match=r"briefcase user/0:0:12 on server 'x': a move into this server is not finished yet"):
        create_user(impatient, GDID(0, 0, 12))

    # A patient session waits; once the move finalizes (incoming -> resident) it proceeds on x.
    waiting = threading.Event()
    patient = cluster.store(move_wait_seconds=60)
    count_waits(monkeypatch, on_wait=lambda n: waiting.set() if n >= 2 else None)
    outcome: list[Any] = []

    def session() -> None:
        try:
            with patient.briefcase(UserBriefcase, gdid) as s:
                outcome.append(s.placement.server)
                s.add(Address(address_id=GDID(0, 2, 12), line1="3 Far Rd", city="Ogdenville", country="US"))
        except BaseException as exc:  # handed to the test thread, which re-raises it
            outcome.append(exc)

    worker = threading.Thread(target=session)
    worker.start()
    assert waiting.wait(60), "the session never retried while the briefcase was incoming"
    assert outcome == []  # still waiting
    with admin.transaction("x") as conn:
        conn.execute(update(briefcase_state).where(briefcase_state.c.gdid == gdid).values(state=STATE_RESIDENT))
    worker.join(60)
    if outcome and isinstance(outcome[0], BaseException):
        raise outcome[0]
    assert outcome == ["x"]
    assert rows_on_every_shard(admin, gdid) == {s: (3 if s == "x" else 0) for s in SHARDS}


# -- concurrency with a move's exclusive lock (PostgreSQL) -------------------------------------


def _waiting_advisory_locks(conn: Connection) -> int:
    return conn.execute(
        text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    ).scalar_one()


@THROUGH_PGBOUNCER
def test_session_waits_for_a_moves_lock_then_follows_the_fence(stale_pg_cluster: Cluster) -> None:
    cluster = stale_pg_cluster
    gdid = GDID(0, 0, 14)
    admin = cluster.store()
    stale = cluster.store()
    assert create_user(admin, gdid) == "u1"

    outcome: list[Any] = []
    started = threading.Event()

    def session() -> None:
        try:
            started.set()
            with stale.briefcase(UserBriefcase, gdid) as s:
                outcome.append(s.placement.server)
                s.add(Address(address_id=GDID(0, 2, 14), line1="4 Lock Ln", city="Capital City", country="US"))
        except BaseException as exc:  # handed to the test thread, which re-raises it
            outcome.append(exc)

    move = admin.engine("u1").connect()
    probe = admin.engine("u1").connect()
    try:
        with move.begin():
            move.execute(text(f"SELECT pg_advisory_xact_lock({lock_key_sql('user', gdid)})"))
            worker = threading.Thread(target=session)
            worker.start()
            started.wait(10)
            deadline = time.monotonic() + 30
            while _waiting_advisory_locks(probe) == 0:  # the session queues behind the move's lock
                assert time.monotonic() < deadline, "the session never waited for the move's lock"
                assert worker.is_alive(), outcome
                time.sleep(0.01)
            assert outcome == []
            # The move, under its lock: copy to x, directory entry, fence + delete on the source.
            with admin.transaction("x") as dst:
                copy_briefcase(move, dst, gdid)
                set_state(dst, gdid, STATE_RESIDENT)
            set_relocation(admin, "user", gdid, "x")
            delete_briefcase(move, gdid)
            set_state(move, gdid, STATE_GONE, peer="x")
        # committed: the waiting session gets its lock, its check sees the fence (fresh snapshot)
        worker.join(60)
    finally:
        move.close()
        probe.close()
    if outcome and isinstance(outcome[0], BaseException):
        raise outcome[0]
    assert outcome == ["x"]
    assert rows_on_every_shard(admin, gdid) == {s: (3 if s == "x" else 0) for s in SHARDS}


# -- a reshard's freeze and map apply (issue 31) -------------------------------------------------


def test_a_reshards_freeze_pauses_only_the_briefcases_still_to_move(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The freeze marker of 0:0:0 on [u1, u2] -> [u1, u2, x]: writes of briefcases that stay on
    their shard under the new list go on (creating one included), writes of those whose shard
    changes wait (bounded), and the holder reads back as the reshard id. Then u1 is re-stamped
    for the new list while frozen (what the map apply does before it publishes the map): a
    writer with the old map waits and re-reads the map until the new one is there, instead of
    running out of stale retries (before: every writer of the partition waited for the whole
    final sweep and map apply, 0.6 s at 100k briefcases in every process of reshard_impact)."""
    admin = cluster.store()
    freeze_partition(admin, "user", GDID.ZERO, ["u1", "u2"], "reshard-test", new_shards=["u1", "u2", "x"])
    assert [frozen_by(admin, "user", GDID.ZERO, s) for s in ("u1", "u2")] == ["reshard-test", "reshard-test"]
    stays, moves = GDID(0, 0, 6), GDID(0, 0, 8)  # 6: u1 under both lists; 8: u1 now, x under the new list
    app = cluster.store(move_wait_seconds=0.2, max_stale_retries=1)
    assert create_user(app, stays) == "u1"
    with pytest.raises(BriefcaseMovingError, match="frozen for writes by reshard reshard-test$"):
        create_user(app, moves)
    assert rows_on_every_shard(admin, moves) == {s: 0 for s in SHARDS}
    with app.briefcase(UserBriefcase, moves, readonly=True) as s:  # still to move: readable while frozen
        assert s.placement.server == "u1" and s.scalar(select(User.name)) is None

    with admin.transaction("u1") as conn:  # the map apply's re-stamp, before it publishes the map
        assert stamp_layout(conn, ShardLayout("user", GDID.ZERO, None, 0, 3), 2, replace=True) is None
    with pytest.raises(BriefcaseMovingError, match="reshard-test is applying partition 0:0:0's new map"):
        create_user(app, GDID(0, 0, 12))  # u1 under both lists: waits, never a StaleRouteError
    with pytest.raises(BriefcaseMovingError, match="reshard-test is applying partition 0:0:0's new map"):
        with app.briefcase(UserBriefcase, stays, readonly=True) as s:  # a reader too (never refused for the freeze itself)
            s.scalar(select(User.name))

    patient = cluster.store(move_wait_seconds=30, max_stale_retries=1)
    refreshes = count_refreshes(patient, monkeypatch, lambda n: n == 3 and cluster.publish(2, [("0:0:0", ["u1", "u2", "x"])]))
    assert create_user(patient, GDID(0, 0, 12)) == "u1"
    assert len(refreshes) >= 3  # each wait re-read the map, past max_stale_retries; the third found the new one
    assert rows_on_every_shard(admin, GDID(0, 0, 12))["u1"] == 2
    assert unfreeze_partition(admin, "user", GDID.ZERO, ["u1", "u2"]) == 2


def test_a_plain_map_apply_is_a_wait_for_old_map_sessions_never_a_stale_route(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """`mdb map apply` of V2 (a partition after 0:0:0) re-stamps u1 and u2 (0:0:0 gets an end) before
    it publishes the map. A reader or writer with V1 that meets a new stamp meanwhile waits and
    re-reads the map (the apply's marker, ADR 0012), where it used to get StaleRouteError once its
    stale retries ran out; once the map is published it is routed by V2, and no marker is left."""
    admin = cluster.store()
    app = cluster.store(move_wait_seconds=0.2, max_stale_retries=1)
    assert create_user(app, GDID(0, 0, 4)) == "u1"
    (tmp_path / "next").mkdir()
    v2 = cluster.write(tmp_path / "next", cluster.urls, central=["central"], partitions=V2, version=2)
    caught: list[BriefcaseMovingError] = []

    def before_publishing(pmap: PartitionMap) -> str:  # every stamp rewritten, the map not recorded yet
        assert [frozen_by(admin, "user", GDID.ZERO, s) for s in ("u1", "u2")] == ["map-apply-v2"] * 2  # the holder (frozen_by strips the slot)
        with pytest.raises(BriefcaseMovingError, match="map-apply-v2 is applying partition 0:0:0's new map") as write:
            create_user(app, GDID(0, 0, 6))
        with pytest.raises(BriefcaseMovingError, match="map-apply-v2 is applying partition 0:0:0's new map") as read:
            with app.briefcase(UserBriefcase, GDID(0, 0, 4), readonly=True) as s:
                s.scalar(select(User.name))
        caught.extend([write.value, read.value])
        return maps_server(pmap)

    monkeypatch.setattr(apply_module, "maps_server", before_publishing)
    apply_map(admin, load_map(v2), yaml_text=v2.read_text())
    assert [e.refresh for e in caught] == [True, True]
    assert [frozen_by(admin, "user", GDID.ZERO, s) for s in ("u1", "u2")] == [None, None]
    assert create_user(app, GDID(0, 0, 6)) == "u1"  # the stamp differs, no marker: a stale route, refreshed to V2
    assert app.router.version == 2
