"""``apply_map`` and ``mdb map diff/apply`` against real servers (PostgreSQL; one SQLite run).

Every check reads the shards directly: the stamps, the rows, the recorded map. The system
starts on map version 1 (CENTRAL + u1, u2 for area user); version 2 adds servers u3, u4 that
version 1 does not even name, as a partition above the high-water mark.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.mapfiles import write_map
from support.pgbouncer import THROUGH_PGBOUNCER, Direct, Pooling
from sqlalchemy import inspect as sa_inspect, select, text
from typer.testing import CliRunner

from mdb.cli import app
from mdb.demo.models import Address, User, UserBriefcase
from mdb.errors import MapEditError
from mdb.gdid import GDID
from mdb.maps.apply import apply_map
from mdb.maps.high_water import high_water_marks
from mdb.maps.history import maps_table
from mdb.partition_map import load_map
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.system_tables import shard_layout

ALL = ["central", "u1", "u2", "u3", "u4"]
V1 = [("0:0:0", ["u1", "u2"])]
V2 = [*V1, ("0:0:1000", ["u3", "u4"])]
ENV = "MDB_TEST_CENTRAL_URL"


@dataclass
class System:
    urls: dict[str, str]
    directory: Path
    stores: list[Store]
    writer: Callable[..., Path] = write_map
    """Writes a map file: support.mapfiles.write_map, or a ``pg_route``'s (through PgBouncer)."""

    def write(self, version: int, partitions: list[tuple[str, list[str]]], servers: list[str], name: str) -> Path:
        path = self.writer(self.directory, {s: self.urls[s] for s in servers}, central=["central"],
                         partitions=partitions, version=version, filename=name)
        # The CENTRAL URL comes from the environment: the recorded map must keep the reference.
        text_ = path.read_text().replace(self.urls["central"], "${" + ENV + "}")
        path.write_text(text_)
        return path

    def store(self, path: Path, **kwargs: Any) -> Store:
        store = Store.from_yaml(path, types=[UserBriefcase], **kwargs)
        store.router  # noqa: B018 - loads routing now, so it can go stale
        self.stores.append(store)
        return store

    def direct(self) -> Store:
        """A Store that names every server (for reading shards directly)."""
        return self.store(self.write(99, V2, ALL, "all.yaml"))


def _system(urls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: Callable[..., Path] = write_map) -> Iterator[System]:
    system = System(dict(zip(ALL, urls)), tmp_path, [], writer)
    monkeypatch.setenv(ENV, system.urls["central"])
    v1 = system.write(1, V1, ["central", "u1", "u2"], "v1.yaml")
    admin = Store.from_yaml(v1, types=[UserBriefcase])
    system.stores.append(admin)
    assert all(r.ok for r in apply_schema(admin))
    try:
        yield system
    finally:
        for store in system.stores:
            store.close()


@pytest.fixture
def pg_system(pg_route: Direct | Pooling, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[System]:
    """Five databases over three servers, reached directly or through PgBouncer (``pg_route``)."""
    yield from _system(pg_route.databases(3) + pg_route.databases(2), tmp_path, monkeypatch, pg_route.write_map)


@pytest.fixture
def sqlite_system(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[System]:
    yield from _system(tmp_sqlite_urls(len(ALL)), tmp_path, monkeypatch)


def create_user(store: Store, gdid: GDID) -> str:
    with store.briefcase(UserBriefcase, gdid) as session:
        session.add(User(user_id=gdid, email=f"{gdid}@example.com", name="u"))
        session.add(Address(address_id=GDID(0, 1, gdid.counter), line1="1 Main St", city="Springfield", country="US"))
        return session.placement.server


def users_on(direct: Store) -> dict[str, set[GDID]]:
    out = {}
    for server in ALL[1:]:
        with direct.transaction(server) as conn:
            has = sa_inspect(conn).has_table("users")
            out[server] = set(conn.execute(select(User.user_id)).scalars()) if has else set()
    return out


def stamps(direct: Store) -> dict[str, dict[str, tuple[Any, ...]]]:
    out = {}
    for server in ALL:
        with direct.transaction(server) as conn:
            if not sa_inspect(conn).has_table(shard_layout.name):
                out[server] = {}
                continue
            out[server] = {r.area: (r.partition_start, r.partition_end, r.shard_index, r.shard_count, r.map_version)
                           for r in conn.execute(select(shard_layout))}
    return out


def recorded(direct: Store) -> list[tuple[int, str]]:
    with direct.transaction("central") as conn:
        if not sa_inspect(conn).has_table(maps_table.name):
            return []
        return [tuple(r) for r in conn.execute(select(maps_table.c.version, maps_table.c.yaml).order_by(maps_table.c.version))]


def seed(store: Store) -> None:
    # GDID(0, 15, 7) sorts last by bytes, but 0:0:600 has the higher sharding value: the mark is 600.
    for gdid in (GDID(0, 0, 5), GDID(0, 3, 600), GDID(0, 15, 7), GDID(0, 0, 101)):
        create_user(store, gdid)


def _apply_new_partition(system: System) -> None:
    old_store = system.store(system.directory / "v1.yaml")
    seed(old_store)
    assert high_water_marks(old_store) == {"user": GDID(0, 0, 600)}
    v2 = system.write(2, V2, ALL, "v2.yaml")

    admin = system.store(system.directory / "v1.yaml")
    report = apply_map(admin, load_map(v2), yaml_text=v2.read_text())
    assert report.diff.ok and report.recorded_on == "central"
    assert set(report.prepared) == {"u3", "u4"} and "users" in report.prepared["u3"]
    assert admin.map.version == 2  # the applying Store adopted it

    direct = system.direct()
    s = stamps(direct)
    assert s["u1"]["user"] == (GDID.ZERO, GDID(0, 0, 1000), 0, 2, 2)
    assert s["u2"]["user"] == (GDID.ZERO, GDID(0, 0, 1000), 1, 2, 2)
    assert s["u3"]["user"] == (GDID(0, 0, 1000), None, 0, 2, 2)
    assert s["u4"]["user"] == (GDID(0, 0, 1000), None, 1, 2, 2)
    [(version, yaml_text)] = recorded(direct)
    assert version == 2 and "${" + ENV + "}" in yaml_text and system.urls["central"] not in yaml_text

    # The old Store still holds version 1 from its file: 0:0:1500 goes to u1 there, to u3 now.
    # u1's new stamp refuses it; the refresh finds version 2 in CENTRAL; the retry lands on u3.
    assert old_store.map.version == 1 and old_store.router.locate("user", GDID(0, 0, 1500)).server == "u1"
    before = users_on(direct)
    assert create_user(old_store, GDID(0, 0, 1500)) == "u3"
    assert old_store.map.version == 2
    after = users_on(direct)
    assert after == {**before, "u3": before["u3"] | {GDID(0, 0, 1500)}}
    # Existing briefcases are where they were, and reachable under the new map.
    with old_store.briefcase(UserBriefcase, GDID(0, 3, 600), readonly=True) as session:
        assert session.placement.server == "u1" and session.get(User, GDID(0, 3, 600)) is not None
    # A fresh Store opened on the version-1 file adopts version 2 at once.
    assert system.store(system.directory / "v1.yaml").map.version == 2


@THROUGH_PGBOUNCER
def test_apply_new_partition_above_the_mark_pg(pg_system: System) -> None:
    _apply_new_partition(pg_system)


def test_apply_new_partition_above_the_mark_sqlite(sqlite_system: System) -> None:
    _apply_new_partition(sqlite_system)


@THROUGH_PGBOUNCER
def test_apply_refuses_a_bad_edit_and_changes_nothing(pg_system: System) -> None:
    system = pg_system
    admin = system.store(system.directory / "v1.yaml")
    seed(admin)
    direct = system.direct()
    before_stamps, before_users = stamps(direct), users_on(direct)
    bad = [
        (system.write(2, [*V1, ("0:0:600", ["u3", "u4"])], ALL, "low.yaml"), "at or below the high-water mark 0:0:600"),
        (system.write(2, [("0:0:0", ["u2", "u1"])], ALL, "reorder.yaml"), "shard list of partition 0:0:0 is reordered"),
        (system.write(1, V2, ALL, "same-version.yaml"), "the version must increase"),
    ]
    for path, reason in bad:
        for dry_run in (True, False):  # the reshard tool's precheck relies on the dry run refusing too
            with pytest.raises(MapEditError, match=reason):
                apply_map(admin, load_map(path), yaml_text=path.read_text(), dry_run=dry_run)
    assert stamps(direct) == before_stamps and users_on(direct) == before_users
    assert recorded(direct) == []
    with direct.transaction("u3") as conn:
        assert sa_inspect(conn).get_table_names() == []  # new servers untouched


@THROUGH_PGBOUNCER
def test_write_after_the_mark_was_read_is_caught_under_the_lock_and_undone(
    pg_system: System, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session that passed its check on u1 before the apply, and writes 0:0:1200 while the
    apply waits for u1's lock: the apply must see the row and undo, not orphan it on u1."""
    system = pg_system
    admin = system.store(system.directory / "v1.yaml")
    seed(admin)
    direct = system.direct()
    before = stamps(direct)
    v2 = system.write(2, V2, ALL, "v2.yaml")
    writer = system.store(system.directory / "v1.yaml")
    gdid = GDID(0, 0, 1200)  # u1 under version 1 (1200 % 2 == 0)

    errors: list[BaseException] = []

    def run_apply() -> None:
        try:
            apply_map(admin, load_map(v2), yaml_text=v2.read_text(), lock_timeout=60)
        except BaseException as exc:  # handed to the main thread and asserted there
            errors.append(exc)

    with writer.briefcase(UserBriefcase, gdid) as session:
        assert session.placement.server == "u1"
        worker = threading.Thread(target=run_apply)
        worker.start()
        with direct.transaction("u1") as conn:  # wait until the apply queues for u1's layout lock
            deadline = time.monotonic() + 60
            while not conn.execute(text(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = 'mdb_shard_layout' AND l.mode = 'AccessExclusiveLock' AND NOT l.granted"
            )).scalar_one():
                assert time.monotonic() < deadline and worker.is_alive(), errors
                time.sleep(0.02)
        session.add(User(user_id=gdid, email="late@example.com", name="late"))
    worker.join(60)
    [error] = errors
    assert isinstance(error, MapEditError) and "stores GDID 0:0:1200" in str(error), error
    assert "restored" in str(error)
    assert stamps(direct) == before and recorded(direct) == []
    assert gdid in users_on(direct)["u1"]
    # With the row there, the live mark is 1200 and the same edit is refused up front.
    with pytest.raises(MapEditError, match="at or below the high-water mark 0:0:1200"):
        apply_map(admin, load_map(v2), yaml_text=v2.read_text())


@THROUGH_PGBOUNCER
def test_apply_reshard_restamps_and_drops_the_leaving_server(pg_system: System) -> None:
    system = pg_system
    admin = system.store(system.directory / "v1.yaml")
    new = system.write(2, [("0:0:0", ["u1", "u3", "u4"])], ["central", "u1", "u2", "u3", "u4"], "reshard.yaml")
    with pytest.raises(MapEditError, match="is changed"):
        apply_map(admin, load_map(new), yaml_text=new.read_text())
    report = apply_map(admin, load_map(new), yaml_text=new.read_text(), allow_reshard_of=("user", GDID.ZERO))
    assert {(c.server, c.action) for c in report.stamps} == {("u1", "changed"), ("u2", "removed"), ("u3", "added"), ("u4", "added")}
    s = stamps(system.direct())
    assert s["u1"]["user"][2:4] == (0, 3) and s["u2"] == {} and s["u3"]["user"][2:4] == (1, 3)


@pytest.mark.slow  # 25 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
@THROUGH_PGBOUNCER
def test_cli_diff_and_apply(pg_system: System) -> None:
    system = pg_system
    v1 = system.directory / "v1.yaml"
    seed(system.store(v1))
    v2 = system.write(2, V2, ALL, "v2.yaml")
    runner = CliRunner()
    models = ["--models", "mdb.demo.models"]

    offline = runner.invoke(app, ["map", "diff", str(v1), str(v2)])
    assert offline.exit_code == 2 and "refused" in offline.output and "unknown" in offline.output
    assert system.urls["central"] not in offline.output
    live = runner.invoke(app, ["map", "diff", str(v1), str(v2), "--live", *models, "--json"])
    assert live.exit_code == 0, live.output
    assert '"user": "0:0:600"' in live.output
    given = runner.invoke(app, ["map", "diff", str(v1), str(v2), "--high-water", "user=0:0:1000", "--json"])
    assert given.exit_code == 2 and "at or below the high-water mark 0:0:1000" in given.output

    dry = runner.invoke(app, ["map", "apply", str(v1), str(v2), "--dry-run", *models])
    assert dry.exit_code == 0, dry.output
    assert recorded(system.direct()) == []
    done = runner.invoke(app, ["map", "apply", str(v1), str(v2), *models])
    assert done.exit_code == 0, done.output
    assert "recorded on CENTRAL server central" in done.output
    again = runner.invoke(app, ["map", "apply", str(v1), str(v2), *models, "--json"])
    assert again.exit_code == 2 and "version must increase" in again.output
    history = runner.invoke(app, ["map", "history", str(v1), "--json"])
    assert history.exit_code == 0 and '"version": 2' in history.output
