"""The ``mdb demo`` main job: a working folder of SQLite files, a map, users, and what happened.

The folder holds one SQLite file per server and ``map.yaml`` (CENTRAL + a ``user`` area with
two partitions of 2 and 3 shards; the second starts at counter 200, so the first run's ~300
users land in both). Running again on the same folder continues: the map and data are kept,
new users get new emails (numbered after the users already there) and an email that is
somehow already taken is skipped, never duplicated.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mdb.central.cache import CacheStats
from mdb.demo.models import UserBriefcase
from mdb.demo.repositories import LedgerRepository, LineItem, OrderRepository, UserRepository
from mdb.errors import DuplicateKeyError, MdbError
from mdb.gdid import GDID
from mdb.schema import apply_schema
from mdb.store import Store

__all__ = ["DemoReport", "run_demo", "shard_counts", "write_demo_map"]

SECOND_PARTITION = 200
DOMAIN = "demo.example"
SKUS = ("book", "lamp", "mug", "pen", "desk", "chair", "plant", "clock")


def demo_map_yaml(folder: Path) -> str:
    root = folder.resolve()

    def url(name: str) -> str:
        return f'"sqlite:///{(root / f"{name}.db").as_posix()}"'

    servers = "\n".join(f"  {name}: {{primary: {url(name)}}}" for name in ["central", *(f"user-{i}" for i in range(1, 6))])
    return (
        "# written by `mdb demo`: CENTRAL plus a user area of two partitions (2 and 3 shards)\n"
        "version: 1\n"
        "models: [mdb.demo.models, mdb.demo.repositories]\n"
        f"servers:\n{servers}\n"
        "areas:\n"
        "  central: {kind: central, shards: [central]}\n"
        "  user:\n"
        "    partitions:\n"
        '      - {start: "0:0:0", shards: [user-1, user-2]}\n'
        f'      - {{start: "0:0:{SECOND_PARTITION}", shards: [user-3, user-4, user-5]}}\n'
    )


def write_demo_map(folder: Path) -> tuple[Path, bool]:
    """``folder/map.yaml``, written unless it exists; returns (path, created)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "map.yaml"
    if path.exists():
        return path, False
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(demo_map_yaml(folder), encoding="utf-8")
    tmp.replace(path)
    return path, True


@dataclass(frozen=True)
class ShardCount:
    server: str
    url: str
    partition_start: GDID
    shard_index: int
    shard_count: int
    briefcases: int
    rows: int


@dataclass
class DemoReport:
    map_version: int
    registered: list[GDID] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    first_number: int = 1
    shards: list[ShardCount] = field(default_factory=list)
    reads: list[dict[str, object]] = field(default_factory=list)
    lookups: list[tuple[str, GDID | None, float]] = field(default_factory=list)
    cache: CacheStats | None = None
    seconds_schema: float = 0.0
    seconds_register: float = 0.0
    seconds_total: float = 0.0
    ledger_events_folded: int = 0
    """Ledger events the demo's snapshot pass folded (balances = snapshot + tail)."""


def email_for(number: int) -> str:
    return f"User{number:06d}@{DOMAIN}"


def shard_counts(store: Store) -> list[ShardCount]:
    """Briefcases (root rows) and rows of every table on every shard of the ``user`` area."""
    from sqlalchemy import func, select

    router = store.router
    out = []
    for start, _end, shards in router.partitions(UserBriefcase.area):
        for index, server in enumerate(shards):
            with store.transaction(server) as conn:
                counts = [conn.execute(select(func.count()).select_from(t)).scalar_one() for t in UserBriefcase.tables]
            out.append(ShardCount(server, store.engines.masked_url(server), start, index, len(shards), counts[0], sum(counts)))
    return out


def _populate(users: UserRepository, orders: OrderRepository, ledger: LedgerRepository, gdid: GDID, number: int) -> None:
    rng = random.Random(number)
    users.add_address(gdid, f"{rng.randint(1, 999)} Demo Street", rng.choice(["Berlin", "Lyon", "Austin"]), "DE")
    for _ in range(rng.randint(1, 3)):
        items = [LineItem(rng.choice(SKUS), rng.randint(1, 3), rng.randint(100, 5000)) for _ in range(rng.randint(1, 4))]
        orders.place_order(gdid, items)
    for k in range(rng.randint(2, 4)):
        ledger.record_transaction(gdid, rng.randint(-2000, 5000), f"demo {k}")


def run_demo(store: Store, n_users: int, *, progress: Callable[[int], None] | None = None) -> DemoReport:
    """Apply the schema, register ``n_users`` new users with their data, and measure what happened.

    ``progress(registered)`` is called every 100 users registered: the library reports, the
    caller (the CLI) decides how to show it, so the library never prints.
    """
    if n_users < 0:
        raise MdbError(f"--users must not be negative, got {n_users}")
    t0 = time.perf_counter()
    report = DemoReport(store.map.version)
    failed = [r for r in apply_schema(store) if not r.ok]
    if failed:
        raise MdbError("schema apply failed on " + "; ".join(f"{r.server}: {r.error or r.problems}" for r in failed))
    report.seconds_schema = time.perf_counter() - t0
    before = shard_counts(store)
    report.first_number = sum(s.briefcases for s in before) + 1
    users, orders, ledger = UserRepository(store), OrderRepository(store), LedgerRepository(store)
    t1 = time.perf_counter()
    for number in range(report.first_number, report.first_number + n_users):
        email = email_for(number)
        try:
            gdid = users.register(email, f"Demo User {number}")
        except DuplicateKeyError:
            report.skipped.append(email)
            continue
        _populate(users, orders, ledger, gdid, number)
        report.registered.append(gdid)
        if progress is not None and len(report.registered) % 100 == 0:
            progress(len(report.registered))
    report.seconds_register = time.perf_counter() - t1
    report.ledger_events_folded = ledger.snapshot_balances()
    report.shards = shard_counts(store)
    samples = _samples(report)
    for gdid in samples:
        placement = store.router.locate(UserBriefcase.area, gdid)
        view = users.get(gdid)
        report.reads.append({
            "gdid": gdid,
            "email": None if view is None else view.email,
            "partition_start": placement.partition_start,
            "shard": f"{placement.shard_index} of {placement.shard_count}",
            "server": placement.server,
            "orders": len(orders.list_orders(gdid)),
            "balance_cents": ledger.read_balance(gdid),
        })
    emails = [v["email"] for v in report.reads]
    probe = [e for e in emails if isinstance(e, str) and e][:3]  # None where the user was not found
    probe = [*(f" {e.upper()}" for e in probe), *probe, f"nobody@{DOMAIN}", f"nobody@{DOMAIN}"]
    for email in probe:
        t = time.perf_counter()
        report.lookups.append((email, users.find_by_email(email), time.perf_counter() - t))
    report.cache = store.central.cache_stats
    report.seconds_total = time.perf_counter() - t0
    return report


def _samples(report: DemoReport) -> list[GDID]:
    got = report.registered
    if not got:
        return []
    picks = {got[0], got[len(got) // 2], got[-1]}
    return sorted(picks)
