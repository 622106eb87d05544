"""Shared by the move and reshard tests: a cluster on real servers, demo data, snapshots."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from support import forkserver
from support import templates
from support.mapfiles import map_dict
from support.templates import Databases, Seed
from sqlalchemy import select

from mdb.demo.models import Address, Order, OrderLineItem, Transaction, User, UserBriefcase
from mdb.gdid import GDID
from mdb.moves.verify import _row_hash
from mdb.schema import apply_schema
from mdb.store import Store

ROOT = Path(__file__).resolve().parents[2]
FAST_LEASE = {"MDB_LEASE_STALE_SECONDS": "2", "MDB_LEASE_BEAT_SECONDS": "0.5"}
"""A lease a paused driver loses within seconds (the takeover tests' hosts)."""


@dataclass
class Cluster:
    urls: dict[str, str]
    path: Path
    central: list[str]

    def write(self, partitions: Sequence[tuple[str, Sequence[str]]], version: int) -> Path:
        data = map_dict(self.urls, central=self.central, partitions=partitions, version=version)
        data["models"] = ["mdb.demo.models"]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        tmp.replace(self.path)
        return self.path

    def store(self) -> Store:
        return Store.from_yaml(self.path, types=[UserBriefcase])


def make_cluster(
    urls: dict[str, str], tmp_path: Path, partitions: Sequence[tuple[str, Sequence[str]]], central: Sequence[str] = ("c",),
    *, seed: Seed | None = None,
) -> Cluster:
    """A map of ``urls`` (version 1) with the schema applied, then ``seed``'s data written through a Store."""
    cluster = Cluster(dict(urls), tmp_path / "map.yaml", list(central))
    cluster.write(partitions, 1)
    with cluster.store() as store:
        reports = apply_schema(store)
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    if seed is not None:
        with cluster.store() as store:
            seed(store)
    return cluster


def cloned_cluster(
    pg_databases: Databases, names: Sequence[str], tmp_path: Path, partitions: Sequence[tuple[str, Sequence[str]]],
    central: Sequence[str] = ("c",), *, seed: Seed | None = None, calls: Sequence[int] | None = None,
) -> Cluster:
    """What ``make_cluster(dict(zip(names, pg_databases(len(names)))), ...)`` followed by ``seed(store)``
    gives, each test in databases of its own, copied from a template built that way once per
    layout, seed and servers (support.templates). ``calls``: how ``pg_databases`` is called for
    the names in turn (``[1, 4]``: CENTRAL on the first server, four shards on all four)."""
    key = (tuple(names), tuple(central), tuple((start, tuple(shards)) for start, shards in partitions), seed)

    def build(urls: list[str], folder: Path) -> None:
        template = make_cluster(dict(zip(names, urls)), folder, partitions, central, seed=seed)
        with template.store() as store:
            templates.strip(store)

    urls = templates.clones(pg_databases, calls or [len(names)], key, build, tmp_path / "template")
    cluster = Cluster(dict(zip(names, urls)), tmp_path / "map.yaml", list(central))
    cluster.write(partitions, 1)
    with cluster.store() as store:
        templates.adopt_identities(store)
    return cluster


def create_user(store: Store, gdid: GDID, orders: int = 2, lines: int = 3) -> None:
    with store.briefcase(UserBriefcase, gdid) as s:
        s.add(User(user_id=gdid, email=f"{gdid}@example.com", name=f"user {gdid.counter}"))
        s.add(Address(address_id=GDID(0, 1, gdid.counter), line1="1 Main St", city="Springfield", country="US"))
        for o in range(orders):
            oid = GDID(0, 2, gdid.counter * 1000 + o)
            s.add(Order(order_id=oid, status="placed", total_cents=100 * o))
            s.flush()
            for li in range(lines):
                s.add(OrderLineItem(line_id=GDID(0, 3, gdid.counter * 100000 + o * 100 + li), order_id=oid, sku=f"sku-{li}", quantity=li + 1, price_cents=99))


def add_transaction(store: Store, gdid: GDID, tid: int, amount: int) -> None:
    with store.briefcase(UserBriefcase, gdid) as s:
        s.add(Transaction(transaction_id=GDID(0, 4, tid), amount_cents=amount, memo=f"t{tid}"))


def snapshot(store: Store, servers: Sequence[str]) -> dict[str, Counter[tuple[Any, ...]]]:
    """table -> multiset of (row hash) over every server: equal snapshots = nothing lost, nothing doubled."""
    out: dict[str, Counter[tuple[Any, ...]]] = {}
    for table in UserBriefcase.tables:
        counter: Counter[tuple[Any, ...]] = Counter()
        for server in servers:
            with store.transaction(server) as conn:
                for row in conn.execute(select(table)):
                    counter[(_row_hash(row),)] += 1
        out[table.name] = counter
    return out


def locations(store: Store, servers: Sequence[str]) -> dict[GDID, list[str]]:
    """user_id -> servers holding its root row."""
    out: dict[GDID, list[str]] = {}
    for server in servers:
        with store.transaction(server) as conn:
            for (uid,) in conn.execute(select(User.__table__.c.user_id)):
                out.setdefault(uid, []).append(server)
    return out


def run_cli(args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + full.get("PYTHONPATH", "")
    return forkserver.run(
        [sys.executable, "-c", "from mdb.cli import main; main()", *args],
        capture_output=True, text=True, env=full, timeout=timeout, cwd=str(ROOT),
    )


def process_state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped, e.g. by ``MDB_FAULT_ACTION=stop``); "" once it is gone.

    A process that exits between the open and the read of its stat file makes the read fail with
    ESRCH (ProcessLookupError), not ENOENT: both mean gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    return text.rsplit(")", 1)[1].split()[0]
