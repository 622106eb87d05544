"""Bulk write: 50,000 child rows added and flushed in ONE briefcase session vs a plain Session.

Both sides write the same table of the same database, through the same kind of connection. The
routed side adds routing, the ownership check and the ``before_flush`` guard that confines every
pending row to the briefcase; that guard must cost O(N) (issue 11 item 1: it used to ask
``obj in session.new`` per object, and ``session.new`` builds a new set at every access, so a
flush of N rows was quadratic: 8,000 rows took 5.4 s against 0.58 s for a plain Session).

``MDB_BULK_ROWS`` overrides the row count (the "before" figures in docs/briefcases.md were
taken with smaller counts on the old code, which could not finish 50,000).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone

from sqlalchemy import create_engine, insert
from sqlalchemy.orm import Session

from benchmarks import BenchContext, Result
from benchmarks.briefcase import _store
from mdb.demo.models import Transaction, User, UserBriefcase
from mdb.gdid import GDID

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _rows(user: GDID | None, ids: Iterator[int], n: int) -> list[Transaction]:
    """``user=None`` leaves the key for the session to fill in, as briefcase code usually does."""
    return [
        Transaction(user_id=user, transaction_id=GDID(0, 0, next(ids)), amount_cents=k, memo="bulk", at=NOW)
        for k in range(n)
    ]


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(ctx: BenchContext, backend: str, central: str, shard: str, n: int) -> Result:
    store = _store(ctx.tmpdir / f"bulk-{backend}", central, shard)
    routed_user, plain_user = GDID(0, 0, 1), GDID(0, 0, 2)
    with store.transaction("u1") as conn:
        conn.execute(
            insert(User),
            [{"user_id": g, "email": f"{g}@example.com", "name": "bulk", "created_at": NOW} for g in (routed_user, plain_user)],
        )
    plain = create_engine(shard)
    ids = itertools.count(1_000_000)

    def routed() -> None:
        rows = _rows(None, ids, n)  # the guard fills in user_id
        with store.briefcase(UserBriefcase, routed_user) as session:
            session.add_all(rows)
            session.flush()

    def direct() -> None:
        rows = _rows(plain_user, ids, n)
        with Session(plain) as session, session.begin():
            session.add_all(rows)
            session.flush()

    rounds = ctx.iterations(3, 1)
    try:
        routed_times, plain_times = [], []
        for _ in range(rounds):  # alternating, so both share what else the machine does
            routed_times.append(_seconds(routed))
            plain_times.append(_seconds(direct))
    finally:
        plain.dispose()
        store.close()
    return Result(
        "bulk", f"{backend}: {n:,} child rows added + flushed in one session", min(routed_times), "s",
        "plain Session on the same shard", min(plain_times), f"best of {rounds} alternating rounds",
    )


def run(ctx: BenchContext) -> list[Result]:
    n = int(os.environ.get("MDB_BULK_ROWS") or ctx.iterations(50_000, 2_000))
    central, shard = ctx.pg_urls(2)
    results = [_measure(ctx, "postgresql", central, shard, n)]
    sqlite_dir = ctx.tmpdir / "bulk-sqlite-files"
    sqlite_dir.mkdir(parents=True, exist_ok=True)
    results.append(_measure(ctx, "sqlite", f"sqlite:///{sqlite_dir / 'central.db'}", f"sqlite:///{sqlite_dir / 'u1.db'}", n))
    return results
