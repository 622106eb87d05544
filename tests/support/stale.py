"""The stale-routing clusters (tests/postgres/test_stale_routing.py), shared with the async and
ownership-check suites: seven named databases, a map published in versions, moves by hand."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
import pytest
from support.mapfiles import write_map
from support.pgbouncer import Direct, Pooling
from sqlalchemy.engine import Connection
from sqlalchemy import delete, insert, func, select
from mdb.demo.models import Address, User, UserBriefcase
from mdb.errors import RetryableError
from mdb.gdid import GDID
from mdb.partition_map import load_map
from mdb.relocations import set_relocation
from mdb.retry import RoutedOpen, Step
from mdb.router import Placement, Router
from mdb.schema import apply_schema, stamp_layout
from mdb.store import Store
from mdb.system_tables import briefcase_state, STATE_GONE, STATE_RESIDENT

NAMES = ["central", "u1", "u2", "u3", "u4", "u5", "x"]
SHARDS = NAMES[1:]
V1 = [("0:0:0", ["u1", "u2"])]
V2 = [*V1, ("0:0:1000", ["u3", "u4", "u5"])]


@dataclass
class Cluster:
    """Named databases, the map file they are published in, and Stores opened on it."""

    urls: dict[str, str]
    directory: Path
    stores: list[Store]
    write: Callable[..., Path] = write_map
    """Writes the map: support.mapfiles.write_map, or a ``pg_route``'s (through PgBouncer)."""

    def publish(self, version: int, partitions: list[tuple[str, list[str]]]) -> Path:
        return self.write(self.directory, self.urls, central=["central"], partitions=partitions, version=version)

    @property
    def path(self) -> Path:
        return self.directory / "map.yaml"

    def store(self, **kwargs: Any) -> Store:
        """A Store on the current map; its relocation cache is loaded now, so it can go stale."""
        store = Store.from_yaml(self.path, types=[UserBriefcase], **kwargs)
        store.router  # noqa: B018 - loads the relocation directory now
        self.stores.append(store)
        return store


def _cluster(urls: list[str], tmp_path: Path, write: Callable[..., Path] = write_map) -> Iterator[Cluster]:
    cluster = Cluster(dict(zip(NAMES, urls)), tmp_path, [], write)
    cluster.publish(1, V1)
    admin = Store.from_yaml(cluster.path, types=[UserBriefcase])
    cluster.stores.append(admin)
    reports = apply_schema(admin)  # u3..u5 and x are spares in version 1: tables, no stamps
    assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    try:
        yield cluster
    finally:
        for store in cluster.stores:
            store.close()


@pytest.fixture
def stale_pg_cluster(pg_route: Direct | Pooling, tmp_path: Path) -> Iterator[Cluster]:
    # Seven databases over four PostgreSQL servers (directly, or through PgBouncer: pg_route).
    yield from _cluster(pg_route.databases(4) + pg_route.databases(3), tmp_path, pg_route.write_map)


@pytest.fixture
def stale_sqlite_cluster(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> Iterator[Cluster]:
    yield from _cluster(tmp_sqlite_urls(len(NAMES)), tmp_path)


def rows_on_every_shard(store: Store, gdid: GDID) -> dict[str, int]:
    """server -> number of briefcase rows carrying ``gdid`` (all tables), read directly."""
    out = {}
    for server in SHARDS:
        with store.transaction(server) as conn:
            out[server] = sum(
                conn.execute(select(func.count()).select_from(t).where(UserBriefcase.key_column(t) == gdid)).scalar_one()
                for t in UserBriefcase.tables
            )
    return out


def count_refreshes(store: Store, monkeypatch: pytest.MonkeyPatch, on_call: Callable[[int], None] | None = None) -> list[int]:
    calls: list[int] = []
    original = store.refresh

    def refresh() -> None:
        calls.append(1)
        original()
        if on_call is not None:
            on_call(len(calls))

    monkeypatch.setattr(store, "refresh", refresh)
    return calls


def count_waits(monkeypatch: pytest.MonkeyPatch, on_wait: Callable[[int], None]) -> list[float]:
    """The delays of every wait a session open takes (mdb.retry.RoutedOpen.refused), in this process."""
    delays: list[float] = []
    original = RoutedOpen.refused

    def refused(self: RoutedOpen, placement: Placement, exc: RetryableError) -> Step:
        step = original(self, placement, exc)
        if step.delay:
            delays.append(step.delay)
            on_wait(len(delays))
        return step

    monkeypatch.setattr(RoutedOpen, "refused", refused)
    return delays


def count_refusals(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The server of every refusal a session open meets (mdb.retry.RoutedOpen.refused), in this process."""
    servers: list[str] = []
    original = RoutedOpen.refused

    def refused(self: RoutedOpen, placement: Placement, exc: RetryableError) -> Step:
        servers.append(placement.server)
        return original(self, placement, exc)

    monkeypatch.setattr(RoutedOpen, "refused", refused)
    return servers


def create_user(store: Store, gdid: GDID) -> str:
    with store.briefcase(UserBriefcase, gdid) as session:
        session.add(User(user_id=gdid, email=f"{gdid}@example.com", name="u"))
        session.add(Address(address_id=GDID(0, 1, gdid.counter), line1="1 Main St", city="Springfield", country="US"))
        return session.placement.server


def restamp_for(cluster: Cluster, version: int) -> None:
    """Stamp every shard of the published map with its layout (what `mdb map apply` will do)."""
    pmap = load_map(cluster.path)
    admin = Store(pmap, types=[UserBriefcase])
    try:
        for server, layout in Router(pmap).layouts():
            with admin.transaction(server) as conn:
                assert stamp_layout(conn, layout, version, replace=True) is None
    finally:
        admin.close()


def move_by_hand(store: Store, gdid: GDID, source: str, target: str, target_state: str = STATE_RESIDENT) -> None:
    with store.transaction(source) as src, store.transaction(target) as dst:
        copy_briefcase(src, dst, gdid)
        set_state(dst, gdid, target_state)
    set_relocation(store, "user", gdid, target)
    with store.transaction(source) as src:
        delete_briefcase(src, gdid)
        set_state(src, gdid, STATE_GONE, peer=target)


def copy_briefcase(source: Connection, target: Connection, gdid: GDID) -> None:
    for table in UserBriefcase.tables:  # parents first: the type lists the root, then children in FK order
        rows = source.execute(select(table).where(UserBriefcase.key_column(table) == gdid)).mappings().all()
        if rows:
            target.execute(insert(table), [dict(r) for r in rows])


def delete_briefcase(conn: Connection, gdid: GDID) -> None:
    for table in reversed(UserBriefcase.tables):
        conn.execute(delete(table).where(UserBriefcase.key_column(table) == gdid))


def set_state(conn: Connection, gdid: GDID, state: str, peer: str | None = None) -> None:
    conn.execute(delete(briefcase_state).where(briefcase_state.c.area == "user", briefcase_state.c.gdid == gdid))
    conn.execute(insert(briefcase_state).values(area="user", gdid=gdid, state=state, peer=peer, move_id="test-move"))
