"""The GDID generator on real PostgreSQL: many processes, era roll-over, restarts.

CENTRAL has two shards on two PostgreSQL servers, so sequence rows really are spread by their
key. Worker processes are started with 'spawn' and build their own Store and generator from
the map file, as separate application processes would.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.mapfiles import write_map
from sqlalchemy import event, text
from typer.testing import CliRunner

from mdb.cli import app
from mdb.errors import GDIDError
from mdb.gdid import MAX_COUNTER, GDID
from mdb.idgen import Block, GdidGenerator, advance_sequence, read_sequence, reserve_block, sequence_key
from mdb.schema import apply_schema
from mdb.store import Store

PROCESSES = 8
PER_PROCESS = 20_000
AUTHORITY = 5


@pytest.fixture
def map_path(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> Path:
    c1, c2 = pg_databases(2)
    path = write_map(tmp_path, {"c1": c1, "c2": c2}, central=["c1", "c2"])
    with Store.from_yaml(path, types=[]) as store:
        reports = apply_schema(store)
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    return path


@pytest.fixture
def store(map_path: Path) -> Iterator[Store]:
    with Store.from_yaml(map_path, types=[]) as s:
        yield s


def _draw(args: tuple[str, str, int]) -> bytes:
    """One worker process: its own Store and generator; next() and take() mixed; 12 bytes per id."""
    map_path, sequence, count = args
    with Store.from_yaml(map_path, types=[]) as store:
        gen = store.gdids("load", sequence, authority=AUTHORITY)
        ids: list[GDID] = []
        step = 0
        while len(ids) < count:
            step += 1
            ids.extend(gen.take(min(step * 37 % 900, count - len(ids))) if step % 2 else [gen.next()])
        gen.wait_idle()
    return b"".join(bytes(g) for g in ids)


@pytest.mark.slow  # 63 s measured at load ~13 on 2 cores (-n 3): docs/testing.md
def test_eight_processes_draw_unique_increasing_gdids(map_path: Path, store: Store) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(PROCESSES) as pool:
        results = pool.map(_draw, [(str(map_path), "user", PER_PROCESS)] * PROCESSES)
    per_process = [[GDID.from_bytes(blob[i : i + 12]) for i in range(0, len(blob), 12)] for blob in results]
    everything = [g for ids in per_process for g in ids]
    assert len(everything) == PROCESSES * PER_PROCESS
    assert len(set(everything)) == len(everything), "a GDID was issued twice"
    assert len({g.sharding_value for g in everything}) == len(everything), "a counter was issued twice"
    assert GDID.ZERO not in everything and min(g.counter for g in everything) >= 1
    assert {g.authority for g in everything} == {AUTHORITY}
    for ids in per_process:
        assert all(a < b for a, b in zip(ids, ids[1:])), "a process's GDIDs did not strictly increase"
    # Every issued counter lies below the sequence's next free position.
    with store.transaction(store.router.locate_central(sequence_key("load", "user")).server) as conn:
        state = read_sequence(conn, "load", "user")
    assert state is not None and state.era == 0 and max(g.counter for g in everything) < state.next_counter


def test_the_era_rolls_over_before_the_counter_passes_its_maximum(store: Store) -> None:
    server = store.router.locate_central(sequence_key("user", "roll")).server
    with store.transaction(server) as conn:
        advance_sequence(conn, "user", "roll", 6, MAX_COUNTER - 1000)
    gen = store.gdids("user", "roll", authority=1, block_size=300)
    got = gen.take(700) + [gen.next() for _ in range(600)]
    gen.wait_idle()
    assert all(a < b for a, b in zip(got, got[1:]))
    era6 = [g for g in got if g.era == 6]
    era7 = [g for g in got if g.era == 7]
    assert [g.counter for g in era6] == list(range(MAX_COUNTER - 1000, MAX_COUNTER + 1))
    assert [g.counter for g in era7] == list(range(1, 1300 - 1001 + 1))
    with store.transaction(server) as conn:
        state = read_sequence(conn, "user", "roll")
        assert state is not None and state.era == 7 and state.next_counter > era7[-1].counter
    # A block ending exactly at the maximum moves on to the next era, counter 1.
    edge_server = store.router.locate_central(sequence_key("user", "edge")).server
    with store.transaction(edge_server) as conn:
        advance_sequence(conn, "user", "edge", 0, MAX_COUNTER - 4)
        assert reserve_block(conn, "user", "edge", 5) == Block(0, MAX_COUNTER - 4, MAX_COUNTER)
        assert reserve_block(conn, "user", "edge", 5) == Block(1, 1, 5)


def test_a_sequence_survives_a_restart_without_reissuing(map_path: Path) -> None:
    with Store.from_yaml(map_path, types=[]) as store:
        gen = store.gdids("user", "restart", block_size=100)
        before = gen.take(80)  # below the low-water mark: the next block is prefetched too
        gen.wait_idle()
        reserved = gen.blocks_reserved
    assert reserved == 2
    with Store.from_yaml(map_path, types=[]) as store:
        gen = store.gdids("user", "restart", block_size=100)
        after = gen.take(50)
        gen.wait_idle()
    assert min(after) > max(before)
    assert [g.counter for g in after] == list(range(201, 251))  # 81..200 were reserved, so lost


def test_two_sequences_are_independent_and_live_on_their_own_shards(store: Store) -> None:
    names = [f"seq{i}" for i in range(10)]
    gens = {name: store.gdids("orders", name, block_size=8) for name in names}
    for round_ in range(3):
        for name in names:
            assert gens[name].next().counter == round_ + 1
    for gen in gens.values():
        gen.wait_idle()
    placed = {name: store.router.locate_central(f"orders/{name}").server for name in names}
    assert set(placed.values()) == {"c1", "c2"}, "ten keys should use both CENTRAL shards"
    for server in ("c1", "c2"):
        with store.transaction(server) as conn:
            rows = {r[0] for r in conn.execute(text("SELECT sequence FROM mdb_gdid_sequences WHERE scope = 'orders'"))}
        assert rows == {n for n, s in placed.items() if s == server}


def test_one_reservation_is_one_statement(store: Store) -> None:
    server = store.router.locate_central(sequence_key("user", "stmt")).server
    statements: list[str] = []
    engine = store.engine(server)

    def record(conn, cursor, statement, *args):  # type: ignore[no-untyped-def]
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        GdidGenerator.for_store(store, "user", "stmt", block_size=10, prefetch=False).take(10)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    work = [s for s in statements if s.strip().upper() not in ("BEGIN", "COMMIT")]
    assert len(work) == 1 and "ON CONFLICT" in work[0] and "RETURNING" in work[0], statements


def test_a_bad_authority_is_refused(store: Store) -> None:
    for bad in (16, -1):
        with pytest.raises(GDIDError, match=f"authority {bad}"):
            store.gdids("user", "bad", authority=bad)


def test_cli_next_on_postgresql(map_path: Path) -> None:
    runner = CliRunner()
    first = runner.invoke(app, ["gdid", "next", str(map_path), "ops", "tickets", "-n", "2", "--authority", "3"])
    second = runner.invoke(app, ["gdid", "next", str(map_path), "ops", "tickets"])
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert first.output.split() + second.output.split() == ["0:3:1", "0:3:2", "0:0:3"]
