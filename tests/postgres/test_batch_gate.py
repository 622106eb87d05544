"""Cutovers before copies: the gate parallel reshard workers share (mdb.moves.gate.CutoverGate).

A batch's write pause must not be stretched by another worker's pre-copy on the same cores, so
a cutover takes its locks once no copy step is in flight, and no step starts while it is on;
a relay passes its turn between blocks of rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from support.moves import create_user, make_cluster
from sqlalchemy import func, select

from mdb.demo.models import OrderLineItem
from mdb.gdid import GDID
from mdb.moves.gate import CutoverGate
from mdb.moves.copy import RELAY_BLOCK, copy_batch
from mdb.moves.sql_steps import area_tables


def _run(*jobs: Callable[[], None]) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a worker is still waiting at the gate"


def test_a_copy_step_waits_while_a_cutover_is_on_and_goes_on_after() -> None:
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
        with gate.step():
            events.append("copy step runs")

    _run(cutover, copy)
    assert events == ["cutover holds its locks", "cutover committed", "copy step runs"]


def test_a_cutover_waits_for_the_copy_step_in_flight_before_it_takes_its_locks() -> None:
    """A statement already sent keeps its server busy: the cutover lets it end first."""
    gate = CutoverGate()
    events: list[str] = []
    sent = threading.Event()

    def copy() -> None:
        with gate.step():
            events.append("sums query sent")
            sent.set()
            time.sleep(0.2)
            events.append("sums query done")

    def cutover() -> None:
        sent.wait()
        with gate.cutting():
            events.append("cutover takes its locks")

    _run(copy, cutover)
    assert events == ["sums query sent", "sums query done", "cutover takes its locks"]


def test_a_relay_passes_its_turn_between_blocks_and_resumes_after_the_cutover() -> None:
    gate = CutoverGate()
    events: list[str] = []
    first_block, cut = threading.Event(), threading.Event()

    def relay() -> None:
        with gate.step():
            events.append("block 1")
            first_block.set()
            cut.wait(10)
            gate.wait()  # between blocks: the waiting cutover goes first
            events.append("block 2")

    def cutover() -> None:
        first_block.wait()
        threading.Timer(0.1, cut.set).start()
        with gate.cutting():
            events.append("cutover")
            time.sleep(0.1)

    _run(relay, cutover)
    assert events == ["block 1", "cutover", "block 2"]
    with gate.step():
        gate.wait()  # no cutover: no wait, and the step is still counted once
    with gate.cutting():
        pass  # nothing in flight: the cutover does not wait


def test_cutovers_take_turns_and_copies_wait_for_the_last() -> None:
    """Two cutovers on two cores stretch each other too: the second takes its locks after the first commits."""
    gate = CutoverGate()
    events: list[str] = []
    first_in, second_waiting = threading.Event(), threading.Event()

    def first() -> None:
        with gate.cutting():
            events.append("first cutover")
            first_in.set()
            second_waiting.wait(10)
            time.sleep(0.1)
            events.append("first committed")

    def second() -> None:
        first_in.wait(10)
        second_waiting.set()
        with gate.cutting():
            events.append("second cutover")
            time.sleep(0.1)
            events.append("second committed")

    def copy() -> None:
        second_waiting.wait(10)
        with gate.step():
            events.append("copy step")

    _run(first, second, copy)
    assert events == ["first cutover", "first committed", "second cutover", "second committed", "copy step"]


def test_a_cutover_holds_back_only_its_own_servers() -> None:
    """Per server (issue 32): a copy between c and d goes on during a cutover between a and b; one touching b waits."""
    gates = CutoverGate()
    events: list[str] = []
    cut_in, release = threading.Event(), threading.Event()

    def cutover() -> None:
        with gates.pair("a", "b").cutting():
            cut_in.set()
            release.wait(10)
            events.append("a-b committed")

    def unrelated() -> None:
        cut_in.wait(10)
        with gates.pair("c", "d").step():
            events.append("c-d copy")
        with gates.pair("d", "c").cutting():
            events.append("d-c cutover")
        release.set()

    def same_server() -> None:
        cut_in.wait(10)
        while not release.is_set():
            time.sleep(0.01)
        with gates.pair("b", "c").step():
            events.append("b-c copy")

    _run(cutover, unrelated, same_server)
    assert events[:2] == ["c-d copy", "d-c cutover"]
    assert events.index("a-b committed") < events.index("b-c copy")


def test_a_batch_copy_is_paced_between_blocks_of_rows(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """Between two PostgreSQL servers each table is one step of the gate, and the relay passes its turn before every block."""
    cluster = make_cluster(dict(zip(["c", "u1", "u2"], pg_databases(3))), tmp_path, [("0:0:0", ["u1"])])
    gdids = [GDID(0, 0, 1), GDID(0, 0, 2)]
    with cluster.store() as store:
        for g in gdids:
            create_user(store, g, orders=1, lines=600)  # 1,200 line items: several 64 KiB blocks
        tables = area_tables(store, "user")
        gate = _CountingGate()
        with store.transaction("u1") as src, store.transaction("u2") as dst:
            copied = copy_batch(src, dst, tables, gdids, gate)
        with store.transaction("u2") as conn:
            arrived = conn.execute(select(func.count()).select_from(OrderLineItem.__table__)).scalar_one()
    assert copied["order_line_items"] == arrived == 1_200
    assert gate.steps == len(tables)  # one step per table's statement
    blocks_of_line_items = -(-1_200 * 60 // RELAY_BLOCK)  # binary rows of this table are well over 60 bytes
    assert gate.waits >= blocks_of_line_items + len([t for t in tables if copied[t.name]]) - 1, gate.waits


class _CountingGate(CutoverGate):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.waits = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        self.steps += 1
        with super().step():
            yield

    def wait(self) -> None:
        self.waits += 1
        super().wait()
