"""``mdb fsck`` (issue 17 part B): every planted defect is found, only the provably safe ones are repaired.

Planted on a 4-shard fleet that also has a finished move (its fence and relocation are normal
and must not be reported): a row on the wrong shard that the owner lacks (misplaced: never
deleted, it may be the only copy), a verified leftover copy (repaired), the copy of a killed
move (left to `mdb moves resume`), a stale fence (repaired: the rows are on its server, the
peer holds none), a stale freeze marker (reported), an orphan CENTRAL entry (reported).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from support.fleet import ATTENTION, status
from support.moves import Cluster, create_user, locations, make_cluster, run_cli, snapshot
from sqlalchemy import insert, select, update

from mdb.backends import backend_of
from mdb.demo.models import User, UserBriefcase
from mdb.demo.repositories import EmailIndex
from mdb.fleet.fsck import RESUME, FsckReport, fsck
from mdb.gdid import GDID
from mdb.moves.copy import copy_rows
from mdb.moves.move import area_tables, move_briefcase
from mdb.moves.freeze import frozen_by
from mdb.ownership import FREEZE_GDID, applying_mark
from mdb.relocations import set_relocation
from mdb.store import Store
from mdb.system_tables import STATE_FROZEN, STATE_GONE, briefcase_state

SHARDS = ["u1", "u2", "u3", "u4"]
USERS = [GDID(0, 0, i) for i in range(1, 13)]
MOVED = GDID(0, 0, 1)  # default u2, moved to u3 by a finished move


def build(urls: list[str], tmp_path: Path) -> Cluster:
    cluster = make_cluster(dict(zip(["c", *SHARDS], urls)), tmp_path, [("0:0:0", SHARDS)])
    with cluster.store() as store:
        for g in USERS:
            create_user(store, g, orders=1, lines=2)
            store.central.add(EmailIndex, f"{g}@example.com", g)
        move_briefcase(store, "user", MOVED, "u3")
    data = yaml.safe_load(cluster.path.read_text(encoding="utf-8"))
    data["models"].append("mdb.demo.repositories")  # declares EmailIndex for the CLI's CENTRAL check
    cluster.path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return cluster


@pytest.fixture
def fleet(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Cluster:
    return build(pg_databases(1) + pg_databases(4), tmp_path)


def _found(report: FsckReport) -> set[tuple[str, str, str | None, str]]:
    return {(f.kind, f.server, None if f.gdid is None else str(f.gdid), f.action) for f in report.findings}


def _owner(store: Store, g: GDID) -> str:
    return store.router.locate("user", g).server


@pytest.mark.slow  # 54 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_clean_fleet_reports_clean(fleet: Cluster) -> None:
    with fleet.store() as store:
        report = fsck(store, "user")
    assert report.clean, [f.to_json() for f in report.findings]
    # Every CENTRAL index declared in this process for the area is checked: the demo's, plus any
    # other test module declared before this one ran.
    assert report.briefcases == len(USERS) and "user_email" in report.central_indexes
    run = run_cli(["fsck", str(fleet.path), "user"])
    assert run.returncode == 0 and "clean" in run.stdout, (run.stdout, run.stderr)


@pytest.mark.slow  # 45 s measured at load ~15 on 2 cores: docs/testing.md
def test_fsck_finds_every_planted_defect_and_repairs_only_the_safe_ones(fleet: Cluster) -> None:
    wrong, leftover, killed, fenced = GDID(0, 0, 4), GDID(0, 0, 5), GDID(0, 0, 6), GDID(0, 0, 7)
    ghost = GDID(0, 0, 999)
    # the killed move: copy committed on u4, then the mover dies (journal: running)
    run = run_cli(["move", str(fleet.path), "user", str(killed), "--to", "u4"], env={"MDB_FAULT_POINT": "batch.after_precopy"})
    assert run.returncode != 0
    with fleet.store() as store:
        assert [_owner(store, g) for g in (wrong, leftover, killed, fenced)] == ["u1", "u2", "u3", "u4"]
        tables = area_tables(store, "user")
        with store.transaction("u2") as conn:  # a row the owner (u1) does not hold
            conn.execute(insert(User).values(user_id=wrong, email="impostor@example.com", name="impostor"))
        with store.transaction("u2") as src, store.transaction("u3") as dst:  # a verified copy of u2's briefcase
            copy_rows(src, dst, tables, leftover)
        with store.transaction("u4") as conn:
            conn.execute(insert(briefcase_state).values(area="user", gdid=fenced, state=STATE_GONE, peer="u1", move_id="move-gone"))
            conn.execute(insert(briefcase_state).values(area="user", gdid=FREEZE_GDID, state=STATE_FROZEN, peer="0:0:0", move_id="reshard-gone"))
        store.central.add(EmailIndex, "ghost@example.com", ghost)
        before = snapshot(store, SHARDS)

        found = fsck(store, "user")
        unsafe = {
            ("misplaced", "u2", str(wrong), "reported"),
            ("unfinished_move", "u4", str(killed), RESUME),
            ("stale_freeze", "u4", None, "reported"),
            ("central_dangling", store.router.locate_central("ghost@example.com").server, str(ghost), "run `mdb central repair MAP`"),
        }
        assert _found(found) == unsafe | {("leftover_copy", "u3", str(leftover), "reported"), ("stale_fence", "u4", str(fenced), "reported")}
        assert snapshot(store, SHARDS) == before, "fsck without --repair changes nothing"

        repaired = fsck(store, "user", repair=True)
        assert _found(repaired) == unsafe | {("leftover_copy", "u3", str(leftover), "repaired"), ("stale_fence", "u4", str(fenced), "repaired")}
        holders = locations(store, SHARDS)
        assert holders[leftover] == ["u2"], "the leftover copy is gone, the owner's rows stay"
        assert sorted(holders[wrong]) == ["u1", "u2"] and sorted(holders[killed]) == ["u3", "u4"], "unsafe ones untouched"
        with store.briefcase(store.types_of("user")[0], fenced, readonly=True) as s:
            assert s.scalars(select(User).where(User.user_id == fenced)).one().user_id == fenced, "the fenced briefcase is reachable again"
        assert _found(fsck(store, "user")) == unsafe

    cli = run_cli(["fsck", str(fleet.path), "user", "--json"])
    assert cli.returncode == 1, cli.stderr
    (area,) = json.loads(cli.stdout)["areas"]
    assert not area["clean"] and {f["kind"] for f in area["findings"]} == {k for k, *_ in unsafe}


def test_fsck_on_sqlite_removes_a_verified_copy_and_keeps_a_differing_one(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = build(tmp_sqlite_urls(5), tmp_path)
    copied, altered = GDID(0, 0, 5), GDID(0, 0, 9)  # both owned by u2
    with cluster.store() as store:
        tables = area_tables(store, "user")
        for g in (copied, altered):
            with store.transaction("u2") as src, store.transaction("u4") as dst:
                copy_rows(src, dst, tables, g)
        with store.transaction("u4") as conn:
            conn.execute(update(User).where(User.user_id == altered).values(name="changed"))
        report = fsck(store, "user", repair=True)
        assert _found(report) == {("leftover_copy", "u4", str(copied), "repaired"), ("misplaced", "u4", str(altered), "reported")}
        holders = locations(store, SHARDS)
        assert holders[copied] == ["u2"] and sorted(holders[altered]) == ["u2", "u4"]


def test_a_relocation_entry_pointing_at_no_briefcase_is_reported_and_nothing_is_deleted(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = build(tmp_sqlite_urls(5), tmp_path)
    g = GDID(0, 0, 8)  # on u1
    with cluster.store() as store:
        set_relocation(store, "user", g, "u3")
        before = snapshot(store, SHARDS)
        report = fsck(store, "user", repair=True)
        assert _found(report) == {
            ("orphan_relocation", "u3", str(g), "reported"), ("misplaced", "u1", str(g), "reported"),
            ("central_dangling", "c", str(g), "run `mdb central repair MAP`"),  # its email entry, routed through the directory
        }
        assert snapshot(store, SHARDS) == before


def test_the_marker_of_a_map_apply_that_stopped_before_publishing_is_attention_and_repaired(
    tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path,
) -> None:
    """It turns no session away (unlike a reshard's freeze without its reshard: broken), so `mdb status`
    names it for attention and `mdb fsck --repair` removes it."""
    cluster = build(tmp_sqlite_urls(5), tmp_path)
    with cluster.store() as store:
        assert backend_of(store.map, "u1").mark_applying(store, "u1", "user", GDID.ZERO, applying_mark(7))
        with store.briefcase(UserBriefcase, GDID(0, 0, 4)) as session:  # u1's writers are not held by it
            session.execute(update(User).values(name="written"))
    code, out = status(cluster)
    assert code == ATTENTION, out["problems"]
    (problem,) = [p for p in out["problems"] if "map-apply-v7" in p["what"]]
    assert problem["level"] == "attention" and problem["fix"] == f"mdb fsck {cluster.path} --repair"
    with cluster.store() as store:
        assert _found(fsck(store, "user")) == {("stale_apply_marker", "u1", None, "reported")}
        assert _found(fsck(store, "user", repair=True)) == {("stale_apply_marker", "u1", None, "repaired")}
        assert frozen_by(store, "user", GDID.ZERO, "u1") is None and _found(fsck(store, "user")) == set()
