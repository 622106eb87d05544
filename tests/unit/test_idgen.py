"""The GDID generator on SQLite files (PostgreSQL: test_idgen_pg.py), its validation and its CLI.

A generator alone on a sequence hands out exactly 1, 2, 3, ... (blocks are consumed in the
order they were reserved and nobody else takes any), which gives the property test an exact
model to compare against, era roll-over included.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.mapfiles import write_map
from sqlalchemy import text
from typer.testing import CliRunner

from mdb.cli import app
from mdb.errors import GDIDError, SchemaError
from mdb.gdid import MAX_COUNTER, GDID, _trusted, _trusted_run
from mdb.idgen import (
    AUTHORITY_ENV,
    Block,
    GdidGenerator,
    advance_sequence,
    authority_from_env,
    read_sequence,
    reserve_block,
    sequence_key,
)
from mdb.schema import apply_schema
from mdb.store import Store

_names = itertools.count()


def fresh(prefix: str = "s") -> str:
    """A sequence name no other test used: tests share one CENTRAL database per module."""
    return f"{prefix}{next(_names)}"


@pytest.fixture(scope="module")
def map_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("idgen")
    urls = {name: f"sqlite:///{directory / name}.db" for name in ("c1", "c2", "u1")}
    path = write_map(directory, urls, central=["c1", "c2"], partitions=[("0:0:0", ["u1"])])
    with Store.from_yaml(path, types=[]) as store:
        reports = apply_schema(store)
        assert all(r.ok for r in reports), [(r.server, r.error, r.problems) for r in reports]
    return path


@pytest.fixture
def store(map_path: Path) -> Iterator[Store]:
    with Store.from_yaml(map_path, types=[]) as s:
        yield s


def central_conn(store: Store, scope: str, sequence: str):  # type: ignore[no-untyped-def]
    return store.transaction(store.router.locate_central(sequence_key(scope, sequence)).server)


def expected_run(era: int, counter: int, n: int) -> list[tuple[int, int]]:
    """The next ``n`` (era, counter) positions of a sequence, by hand."""
    out = []
    for _ in range(n):
        out.append((era, counter))
        era, counter = (era, counter + 1) if counter < MAX_COUNTER else (era + 1, 1)
    return out


# -- the trusted constructors ---------------------------------------------------------------------


def test_trusted_constructors_build_the_same_values_as_the_checked_constructor() -> None:
    raw = 9 << 60 | (MAX_COUNTER - 1)
    assert _trusted(7, raw) == GDID(7, 9, MAX_COUNTER - 1)
    run = _trusted_run(3, 2 << 60 | 10, 4)
    assert run == [GDID(3, 2, c) for c in range(10, 14)]
    assert [hash(g) for g in run] == [hash(GDID(3, 2, c)) for c in range(10, 14)]
    assert [str(g) for g in run] == ["3:2:10", "3:2:11", "3:2:12", "3:2:13"]
    with pytest.raises(AttributeError):
        run[0]._era = 5  # type: ignore[misc]
    assert _trusted_run(0, 1, 0) == []


# -- reservation ----------------------------------------------------------------------------------


def test_a_new_sequence_starts_at_counter_one_and_blocks_follow_each_other(store: Store) -> None:
    seq = fresh()
    with central_conn(store, "user", seq) as conn:
        assert read_sequence(conn, "user", seq) is None
        assert reserve_block(conn, "user", seq, 5) == Block(0, 1, 5)
        assert reserve_block(conn, "user", seq, 3) == Block(0, 6, 8)
        state = read_sequence(conn, "user", seq)
    assert state is not None and (state.era, state.next_counter, state.last_block) == (0, 9, Block(0, 6, 8))


def test_a_block_that_would_pass_the_counter_maximum_ends_there_and_the_era_rolls_over(store: Store) -> None:
    seq = fresh()
    with central_conn(store, "user", seq) as conn:
        advance_sequence(conn, "user", seq, 4, MAX_COUNTER - 2)
        assert reserve_block(conn, "user", seq, 10) == Block(4, MAX_COUNTER - 2, MAX_COUNTER)
        assert reserve_block(conn, "user", seq, 10) == Block(5, 1, 10)
    seq = fresh()
    with central_conn(store, "user", seq) as conn:  # a block ending exactly on the maximum
        advance_sequence(conn, "user", seq, 0, MAX_COUNTER - 9)
        assert reserve_block(conn, "user", seq, 10) == Block(0, MAX_COUNTER - 9, MAX_COUNTER)
        assert reserve_block(conn, "user", seq, 1) == Block(1, 1, 1)


def test_the_last_era_is_used_up_and_then_refused(store: Store) -> None:
    seq = fresh()
    with central_conn(store, "user", seq) as conn:
        advance_sequence(conn, "user", seq, 2**32 - 1, MAX_COUNTER)
        assert reserve_block(conn, "user", seq, 4) == Block(2**32 - 1, MAX_COUNTER, MAX_COUNTER)
    with central_conn(store, "user", seq) as conn, pytest.raises(GDIDError, match="exhausted"):
        reserve_block(conn, "user", seq, 4)


def test_advance_only_moves_a_sequence_forward(store: Store) -> None:
    seq = fresh()
    with central_conn(store, "user", seq) as conn:
        assert advance_sequence(conn, "user", seq, 1, 100).next_counter == 100
        assert (advance_sequence(conn, "user", seq, 1, 50).era, advance_sequence(conn, "user", seq, 0, 999).next_counter) == (1, 100)
        assert reserve_block(conn, "user", seq, 2) == Block(1, 100, 101)
        with pytest.raises(GDIDError, match="counter 0"):
            advance_sequence(conn, "user", seq, 1, 0)
        with pytest.raises(GDIDError, match="era"):
            advance_sequence(conn, "user", seq, 2**32, 1)


def test_the_row_lives_on_the_central_shard_of_its_key(store: Store) -> None:
    placed = {}
    for _ in range(12):
        seq = fresh()
        store.gdids("orders", seq).next()
        placed[seq] = store.router.locate_central(f"orders/{seq}").server
    assert set(placed.values()) == {"c1", "c2"}, "12 keys should hash onto both shards"
    for server in ("c1", "c2"):
        with store.transaction(server) as conn:
            found = {r[0] for r in conn.execute(text("SELECT sequence FROM mdb_gdid_sequences WHERE scope = 'orders'"))}
        assert found == {seq for seq, s in placed.items() if s == server}


# -- the generator --------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    block_size=st.integers(1, 40),
    start=st.sampled_from([(0, 1), (3, MAX_COUNTER - 30), (1, MAX_COUNTER)]),
    ops=st.lists(st.one_of(st.just(0), st.integers(1, 90)), min_size=1, max_size=25),
    authority=st.integers(0, 15),
)
def test_a_lone_generator_hands_out_exactly_the_next_positions(
    map_path: Path, block_size: int, start: tuple[int, int], ops: list[int], authority: int
) -> None:
    seq = fresh("prop")
    with Store.from_yaml(map_path, types=[]) as store:
        if start != (0, 1):
            with central_conn(store, "p", seq) as conn:
                advance_sequence(conn, "p", seq, *start)
        gen = GdidGenerator.for_store(store, "p", seq, authority=authority, block_size=block_size)
        got: list[GDID] = []
        for op in ops:  # 0 = next(), k = take(k)
            got.extend([gen.next()] if op == 0 else gen.take(op))
        gen.wait_idle()
    assert [(g.era, g.counter) for g in got] == expected_run(*start, len(got))
    assert {g.authority for g in got} == {authority}


def test_ids_strictly_increase_and_never_repeat_across_threads(store: Store) -> None:
    gen = store.gdids("user", fresh(), block_size=64)
    per_thread: list[list[GDID]] = [[] for _ in range(8)]
    barrier = threading.Barrier(8)

    def work(out: list[GDID]) -> None:
        barrier.wait()
        for i in range(300):
            out.extend(gen.take(i % 7) if i % 3 else [gen.next()])

    threads = [threading.Thread(target=work, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [g for out in per_thread for g in out]
    assert len(everything) == len(set(everything)) == sum(len(o) for o in per_thread) > 0
    for out in per_thread:
        assert all(a < b for a, b in zip(out, out[1:]))
    assert GDID.ZERO not in everything
    # One generator alone: no gaps either, whatever the interleaving.
    assert sorted(g.counter for g in everything) == list(range(1, len(everything) + 1))


def test_two_generators_of_one_sequence_in_two_stores_never_collide(map_path: Path) -> None:
    seq = fresh()
    with Store.from_yaml(map_path, types=[]) as a, Store.from_yaml(map_path, types=[]) as b:
        ga, gb = a.gdids("user", seq, block_size=16), b.gdids("user", seq, block_size=16)
        got_a, got_b = [], []
        for i in range(200):
            got_a.extend(ga.take(i % 5 + 1))
            got_b.append(gb.next())
        ga.wait_idle()
        gb.wait_idle()
    assert not set(got_a) & set(got_b)
    assert all(x < y for x, y in zip(got_a, got_a[1:])) and all(x < y for x, y in zip(got_b, got_b[1:]))


def test_two_sequences_are_independent(store: Store) -> None:
    s1, s2 = fresh(), fresh()
    g1, g2 = store.gdids("user", s1, block_size=4), store.gdids("user", s2, block_size=4)
    assert [g1.next().counter, g2.next().counter, g1.next().counter] == [1, 1, 2]
    assert [g.counter for g in g2.take(5)] == [2, 3, 4, 5, 6]
    assert store.gdids("other", s1).next().counter == 1  # same name, other scope
    for g in (g1, g2):
        g.wait_idle()


def test_prefetch_reserves_the_next_block_before_the_current_one_runs_out(store: Store) -> None:
    gen = GdidGenerator.for_store(store, "user", fresh(), block_size=100)
    gen.take(70)
    gen.wait_idle()
    assert gen.blocks_reserved == 1  # 30 % left: above the low-water mark
    gen.take(6)  # 24 % left
    assert gen.wait_idle(timeout=30)
    assert gen.blocks_reserved == 2
    assert [g.counter for g in gen.take(30)] == list(range(77, 107))  # served from the prefetched block
    assert GdidGenerator.for_store(store, "user", fresh(), block_size=10, prefetch=False).take(30)[-1].counter == 30


def test_blocks_grow_while_callers_wait_for_them_up_to_the_maximum(store: Store) -> None:
    seq = fresh()
    gen = GdidGenerator.for_store(store, "user", seq, block_size=10, max_block_size=35, prefetch=False)
    sizes = []
    for _ in range(5):  # without prefetch, every used-up block makes the caller wait
        before = gen.blocks_reserved
        gen.next()
        gen.take(gen.current_block_size - 1)
        assert gen.blocks_reserved == before + 1
        sizes.append(gen.current_block_size)
    assert sizes == [10, 20, 35, 35, 35]
    with central_conn(store, "user", seq) as conn:
        state = read_sequence(conn, "user", seq)
    assert state is not None and state.next_counter == 1 + sum(sizes)  # and nothing was skipped
    with pytest.raises(GDIDError, match="below the block size"):
        GdidGenerator.for_store(store, "user", seq, block_size=10, max_block_size=9)


def test_a_restarted_generator_never_reissues_what_was_reserved_before(map_path: Path) -> None:
    seq = fresh()
    with Store.from_yaml(map_path, types=[]) as store:
        gen = store.gdids("user", seq, block_size=50)
        before = gen.take(45)  # crosses the low-water mark: a second block is prefetched
        gen.wait_idle()
        assert gen.blocks_reserved == 2
    with Store.from_yaml(map_path, types=[]) as store:
        after = store.gdids("user", seq, block_size=50).next()
    assert after.counter == 101  # the unused 46..100 are lost, never handed out again
    assert after > max(before)


def test_a_failed_prefetch_surfaces_as_the_next_callers_error(tmp_path: Path) -> None:
    path = write_map(tmp_path, {"c": f"sqlite:///{tmp_path}/c.db"}, central=["c"])
    with Store.from_yaml(path, types=[]) as store:
        apply_schema(store)
        gen = GdidGenerator.for_store(store, "user", "x", block_size=8)
        gen.take(2)
        with store.transaction("c") as conn:
            conn.execute(text("DROP TABLE mdb_gdid_sequences"))
        gen.take(5)  # below the low-water mark: the background prefetch fails
        gen.wait_idle()
        assert gen.last_prefetch_error is not None
        assert gen.take(1)[0].counter == 8  # the current block still serves
        with pytest.raises(SchemaError, match="mdb_gdid_sequences"):
            gen.next()


# -- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 16, 255, True, "3", 1.0])
def test_a_bad_authority_is_refused(store: Store, bad: object) -> None:
    with pytest.raises(GDIDError, match="authority"):
        GdidGenerator.for_store(store, "user", "a", authority=bad)  # type: ignore[arg-type]


def test_the_authority_comes_from_the_environment_by_default(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AUTHORITY_ENV, raising=False)
    assert authority_from_env() == 0
    monkeypatch.setenv(AUTHORITY_ENV, " 12 ")
    gen = GdidGenerator.for_store(store, "user", fresh())
    assert gen.authority == 12 and gen.next().authority == 12
    gen.wait_idle()
    assert GdidGenerator.for_store(store, "user", "b", authority=3).authority == 3  # the argument wins
    for bad in ("16", "-1", "x", "1.5"):
        monkeypatch.setenv(AUTHORITY_ENV, bad)
        with pytest.raises(GDIDError, match=r"\$MDB_AUTHORITY"):
            GdidGenerator.for_store(store, "user", "c")


@pytest.mark.parametrize("scope, sequence", [("", "a"), ("a/b", "c"), ("a", "b c"), ("x" * 64, "a"), ("a", "é")])
def test_bad_names_are_refused_with_the_name(store: Store, scope: str, sequence: str) -> None:
    with pytest.raises(GDIDError) as info:
        store.gdids(scope, sequence)
    assert repr(scope) in str(info.value) or repr(sequence) in str(info.value)


def test_bad_counts_and_block_sizes_are_refused(store: Store) -> None:
    for bad in (0, -5, 2**41, True):
        with pytest.raises(GDIDError, match="block size"):
            GdidGenerator.for_store(store, "user", "a", block_size=bad)
    gen = GdidGenerator.for_store(store, "user", fresh())
    assert gen.take(0) == []
    assert gen.blocks_reserved == 0
    with pytest.raises(GDIDError, match="count -1"):
        gen.take(-1)


def test_the_store_keeps_one_generator_per_sequence_and_refuses_a_conflicting_one(store: Store) -> None:
    seq = fresh()
    gen = store.gdids("user", seq, authority=2, block_size=10)
    assert store.gdids("user", seq) is gen
    assert store.gdids("user", seq, authority=2, block_size=10) is gen
    with pytest.raises(GDIDError, match="authority 2"):
        store.gdids("user", seq, authority=3)
    with pytest.raises(GDIDError, match="block size 10"):
        store.gdids("user", seq, block_size=11)


# -- CLI ------------------------------------------------------------------------------------------


def test_cli_reserves_and_prints_new_gdids(map_path: Path) -> None:
    runner = CliRunner()
    seq = fresh()
    first = runner.invoke(app, ["gdid", "next", str(map_path), "cli", seq, "--count", "3"])
    assert first.exit_code == 0, first.output
    assert first.output.split() == ["0:0:1", "0:0:2", "0:0:3"]
    second = runner.invoke(app, ["gdid", "next", str(map_path), "cli", seq, "--json", "--authority", "9"])
    assert second.exit_code == 0, second.output
    data = json.loads(second.output)
    assert data["gdids"] == ["0:9:4"] and data["hex"] == [GDID(0, 9, 4).hex] and data["count"] == 1
    assert data["central_key"] == f"cli/{seq}" and data["server"] in ("c1", "c2")
    # `mdb gdid VALUE` still shows a GDID.
    shown = runner.invoke(app, ["gdid", "0:9:4", "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["authority"] == 9


@pytest.mark.parametrize(
    "args, message",
    [
        (["--count", "0"], "--count must be in 1..1000000, got 0"),
        (["--authority", "16"], "authority 16"),
    ],
)
def test_cli_refuses_bad_input_with_one_error_line(
    map_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mdb.cli import main

    monkeypatch.setattr("sys.argv", ["mdb", "gdid", "next", str(map_path), "cli", "bad", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_cli_names_a_missing_table(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from mdb.cli import main

    path = write_map(tmp_path, {"c": f"sqlite:///{tmp_path}/c.db"}, central=["c"])
    monkeypatch.setattr("sys.argv", ["mdb", "gdid", "next", str(path), "user", "user"])
    with pytest.raises(SystemExit):
        main()
    err = capsys.readouterr().err
    assert "mdb_gdid_sequences" in err and "mdb schema apply" in err
