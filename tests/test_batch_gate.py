"""Cutovers before copies: the gate parallel reshard workers share (mdb.moves.batch.CutoverGate).

A batch's write pause must not be stretched by another worker's pre-copy on the same cores, so
while any batch holds its locks, copies wait between two blocks of rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from movehelp import create_user, make_cluster
from sqlalchemy import func, select

from mdb.demo.models import OrderLineItem
from mdb.gdid import GDID
from mdb.moves.batch import CutoverGate
from mdb.moves.copy import RELAY_BLOCK, copy_batch
from mdb.moves.sql_steps import area_tables


def test_a_copy_waits_while_a_cutover_holds_its_locks_and_goes_on_after() -> None:
    gate = CutoverGate()
    events: list[str] = []
    inside = threading.Event()

    def cutover() -> None:
        with gate.cutting():
            events.append("cutover holds its locks")
            inside.set()
            time.sleep(0.2)
            events.append("cutover committed")

    def copy() -> None:
        inside.wait()
        gate.wait()
        events.append("copy goes on")

    threads = [threading.Thread(target=cutover), threading.Thread(target=copy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert events == ["cutover holds its locks", "cutover committed", "copy goes on"]
    started = time.monotonic()
    gate.wait()  # no cutover: no wait
    assert time.monotonic() - started < 0.1


def test_nested_cutovers_release_the_gate_only_when_the_last_one_ends() -> None:
    gate = CutoverGate()
    waited = threading.Event()
    with gate.cutting():
        with gate.cutting():
            pass
        waiter = threading.Thread(target=lambda: (gate.wait(), waited.set()))
        waiter.start()
        assert not waited.wait(0.1), "a copy went on while a cutover still held its locks"
    waiter.join(10)
    assert waited.is_set()


def test_a_batch_copy_is_paced_between_blocks_of_rows(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """Between two PostgreSQL servers the relay calls ``pace`` before every block it passes on."""
    cluster = make_cluster(dict(zip(["c", "u1", "u2"], pg_databases(3))), tmp_path, [("0:0:0", ["u1"])])
    gdids = [GDID(0, 0, 1), GDID(0, 0, 2)]
    with cluster.store() as store:
        for g in gdids:
            create_user(store, g, orders=1, lines=600)  # 1,200 line items: several 64 KiB blocks
        tables = area_tables(store, "user")
        paced: list[int] = []
        with store.transaction("u1") as src, store.transaction("u2") as dst:
            copied = copy_batch(src, dst, tables, gdids, pace=lambda: paced.append(len(paced)))
        with store.transaction("u2") as conn:
            arrived = conn.execute(select(func.count()).select_from(OrderLineItem.__table__)).scalar_one()
    assert copied["order_line_items"] == arrived == 1_200
    blocks_of_line_items = -(-1_200 * 60 // RELAY_BLOCK)  # binary rows of this table are well over 60 bytes
    # once before each table's statement, and before each block of rows
    assert len(paced) >= len(tables) + blocks_of_line_items + len([t for t in tables if copied[t.name]]) - 1, paced
