"""Moves: throughput of ``mdb move`` vs raw COPY between the same servers.

Throughput: one large briefcase (order line items) moved from server A to server B, in rows
per second, next to two raw ``COPY (SELECT ...) TO STDOUT`` pipes into ``COPY ... FROM STDIN``
of the same line items in the same run:

- into a TEMP table ``LIKE order_line_items`` on B: no index, no foreign key, no WAL, relayed
  row by row in Python. The original baseline; it measures the pipe, not what storing the
  rows costs;
- into the real ``order_line_items`` of an empty database on a third server X (same
  settings), with its primary key and its composite foreign key to ``orders`` (the user and
  order rows copied first in the same transaction, untimed), committed, relayed in blocks
  like a move's copy: the work a move's copy has to do too. On PostgreSQL 15 the foreign-key
  check per row is most of it.

The move adds prechecks, journal, lock, the other tables, verification on both sides and the
commit point. The source is settled with VACUUM ANALYZE after the bulk fill, before anything
is timed, so that autovacuum's pass over the 200k fresh rows cannot land inside one of the
timed runs (it cost a move about 0.2 s when it did). The write pause of a briefcase while a
partition reshards is the ``reshard`` section's (each batch's lock time, from the reshard's
history row); this section measured it by wrapping ``move_briefcase``, which a reshard's
batches no longer call, so it had no pause to report and failed.
"""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import yaml
from sqlalchemy import insert
from sqlalchemy.engine import make_url

from benchmarks import BenchContext, Result
from mdb.demo.models import Order, OrderLineItem, User, UserBriefcase
from mdb.gdid import GDID
from mdb.moves import move_briefcase
from mdb.moves.copy import RELAY_BLOCK
from mdb.schema import apply_schema
from mdb.store import Store

SECTION = "moves"


def _map(directory: Path, urls: dict[str, str], shards: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "map.yaml"
    data = {
        "version": 1,
        "servers": {name: {"primary": url} for name, url in urls.items()},
        "areas": {"central": {"kind": "central", "shards": ["c"]}, "user": {"partitions": [{"start": "0:0:0", "shards": shards}]}},
        "models": ["mdb.demo.models"],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _fill(store: Store, server: str, users: list[GDID], lines: int) -> None:
    with store.transaction(server) as conn:
        conn.execute(insert(User), [{"user_id": g, "email": f"{g}@x", "name": "n"} for g in users])
        conn.execute(insert(Order), [{"user_id": g, "order_id": GDID(0, 2, g.counter), "status": "placed", "total_cents": 1} for g in users])
        rows = [
            {"user_id": g, "line_id": GDID(0, 3, g.counter * 1_000_000 + i), "order_id": GDID(0, 2, g.counter), "sku": f"sku-{i}", "quantity": 1, "price_cents": i}
            for g in users for i in range(lines)
        ]
        for i in range(0, len(rows), 5000):
            conn.execute(insert(OrderLineItem), rows[i : i + 5000])


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _settle(url: str) -> None:
    """VACUUM ANALYZE the database: hint bits, visibility map and statistics of fresh rows."""
    with psycopg.connect(_dsn(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def _raw_copy(src_url: str, dst_url: str, gdid: GDID) -> float:
    with psycopg.connect(_dsn(src_url)) as src, psycopg.connect(_dsn(dst_url)) as dst:
        dst.execute("CREATE TEMP TABLE raw_lines (LIKE order_line_items)")
        start = time.perf_counter()
        with src.cursor().copy(f"COPY (SELECT * FROM order_line_items WHERE user_id = '\\x{gdid.hex}'::bytea) TO STDOUT (FORMAT BINARY)") as out, \
                dst.cursor().copy("COPY raw_lines FROM STDIN (FORMAT BINARY)") as into:
            for chunk in out:
                into.write(chunk)
        dst.commit()
        return time.perf_counter() - start


def _raw_copy_into_table(src_url: str, dst_url: str, gdid: GDID) -> float:
    """The same pipe into the real, indexed ``order_line_items`` of an empty database (timed: the line items)."""
    key = f"'\\x{gdid.hex}'::bytea"
    with psycopg.connect(_dsn(src_url)) as src, psycopg.connect(_dsn(dst_url)) as dst:

        def pipe(table: str) -> None:
            with src.cursor().copy(f"COPY (SELECT * FROM {table} WHERE user_id = {key}) TO STDOUT (FORMAT BINARY)") as out, \
                    dst.cursor().copy(f"COPY {table} FROM STDIN (FORMAT BINARY)") as into:
                block = bytearray()  # relayed in blocks like mdb.moves.copy does, not per row
                for chunk in out:
                    block += chunk
                    if len(block) >= RELAY_BLOCK:
                        into.write(block)
                        block = bytearray()
                if block:
                    into.write(block)

        pipe("users")
        pipe("orders")
        start = time.perf_counter()
        pipe("order_line_items")
        dst.commit()
        return time.perf_counter() - start


def run(ctx: BenchContext) -> list[Result]:
    urls = dict(zip(["c", "a", "b", "x"], ctx.pg_urls(4)))
    results: list[Result] = []

    # -- throughput ---------------------------------------------------------------------------
    lines = ctx.iterations(200_000, 20_000)
    path = _map(ctx.tmpdir / "moves-throughput", urls, ["a"])
    big = GDID(0, 0, 1)
    with Store.from_yaml(path, types=[UserBriefcase]) as store:
        assert all(r.ok for r in apply_schema(store))
        _fill(store, "a", [big], lines)
        _settle(urls["a"])
        raw = _raw_copy(urls["a"], urls["b"], big)
        raw_table = _raw_copy_into_table(urls["a"], urls["x"], big)
        start = time.perf_counter()
        result = move_briefcase(store, "user", big, "b")
        moved = time.perf_counter() - start
    rows = result.rows
    name = f"mdb move, one briefcase of {rows} rows"
    note = f"write pause {result.pause_seconds * 1000:.0f} ms"
    results.append(Result(SECTION, name, rows / moved, "rows/s",
                          "raw COPY TO STDOUT -> FROM STDIN into a TEMP table (no index, no FK, no WAL)", lines / raw,
                          note=f"{note}; aim: at least 0.5x raw"))
    results.append(Result(SECTION, name, rows / moved, "rows/s",
                          "raw COPY TO STDOUT -> FROM STDIN into the real table (PK + FK, empty database)", lines / raw_table,
                          note=note))
    return results
