"""Python's garbage collector waits while a cutover holds write locks (mdb.moves.collector).

A full collection of the mover's heap took 52-73 ms in a 10,000-briefcase reshard; landing in
a batch's lock it tripled that batch's write pause. These tests pin the rule where every SQL
cutover takes its locks (``sql_steps.locked_briefcases``): off while held, on again after,
also when the lock cannot be had, and never switched on for an application that runs without it.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.moves import create_user, make_cluster
from sqlalchemy import text

from mdb.errors import MoveAbortedError
from mdb.gdid import GDID
from mdb.moves.collector import collection_deferred, long_lived_frozen
from mdb.moves.sql_steps import locked_briefcases
from mdb.ownership import lock_key_sql

GDIDS = [GDID(0, 0, 1), GDID(0, 0, 2)]


@pytest.fixture(autouse=True)
def collector_on() -> Iterator[None]:
    was, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.enable()
    gc.unfreeze()  # an in-process `mdb` command of another test may have frozen its start-up
    yield
    (gc.enable if was else gc.disable)()
    if frozen:
        gc.freeze()


def test_off_while_a_postgres_cutover_holds_its_locks_and_on_after(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = make_cluster(dict(zip(["c", "u1"], pg_databases(2))), tmp_path, [("0:0:0", ["u1"])])
    with cluster.store() as store:
        with locked_briefcases(store, "u1", "user", GDIDS, lock_wait=1.0, max_pause=1.0) as (conn, _):
            assert not gc.isenabled()
            conn.commit()
        assert gc.isenabled()


def test_off_while_a_sqlite_cutover_holds_its_lock(tmp_path: Path) -> None:
    urls = {name: f"sqlite:///{tmp_path / f'{name}.db'}" for name in ("c", "u1")}
    cluster = make_cluster(urls, tmp_path, [("0:0:0", ["u1"])])
    with cluster.store() as store:
        with locked_briefcases(store, "u1", "user", GDIDS, lock_wait=1.0, max_pause=1.0):
            assert not gc.isenabled()
        assert gc.isenabled()


def test_on_again_when_the_lock_cannot_be_had(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """A session holds one briefcase's lock: the tries and the bounded wait fail, the collector is back on."""
    cluster = make_cluster(dict(zip(["c", "u1"], pg_databases(2))), tmp_path, [("0:0:0", ["u1"])])
    with cluster.store() as store, store.transaction("u1") as holder:
        holder.execute(text(f"SELECT pg_advisory_xact_lock({lock_key_sql('user', GDIDS[1])})"))
        with pytest.raises(MoveAbortedError, match="could not take the write lock"):
            with locked_briefcases(store, "u1", "user", GDIDS, lock_wait=0.05, max_pause=0.05):
                pytest.fail("the lock was taken while a session held it")
        assert gc.isenabled()


def test_overlapping_cutovers_of_two_threads_enable_it_only_when_the_last_ends() -> None:
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def second() -> None:
        first_in.wait(10)
        with collection_deferred():
            second_in.set()
            first_out.wait(10)
            seen.append(gc.isenabled())  # the first has ended, this one still holds

    worker = threading.Thread(target=second)
    worker.start()
    with collection_deferred():
        first_in.set()
        second_in.wait(10)
    first_out.set()
    worker.join(10)
    assert seen == [False]
    assert gc.isenabled()


def test_an_application_running_without_the_collector_keeps_it_off() -> None:
    gc.disable()
    with collection_deferred():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_reshard_moves_with_its_plan_out_of_full_collections_and_gives_it_back_after(
        pg_databases: Callable[[int], list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between a batch's commit point and its finalize the application waits; a full collection
    of a million-briefcase mover's heap took 0.5-0.7 s there. The heap alive when the moves begin
    (the plan) is frozen while they run, and nothing stays frozen after the reshard."""
    from mdb import faults
    from mdb.moves.reshard import reshard

    cluster = make_cluster(dict(zip(["c", "u1", "u2"], pg_databases(3))), tmp_path, [("0:0:0", ["u1"])])
    users = [GDID(0, 0, n) for n in range(1, 9)]
    frozen_at: dict[str, int] = {}
    monkeypatch.setattr(faults, "hook", lambda point: frozen_at.setdefault(point, gc.get_freeze_count()))
    with cluster.store() as store:
        for g in users:
            create_user(store, g, orders=1, lines=1)
        reshard(store, "user", GDID(0, 0, 0), ["u1", "u2"], map_path=cluster.path)
    assert frozen_at["batch.after_commit_point"] > 0  # a batch committed with the plan frozen
    assert frozen_at["reshard.after_moves"] == 0  # the moves are over: given back to the collector
    assert gc.get_freeze_count() == 0


def test_overlapping_freezes_unfreeze_only_when_the_last_ends() -> None:
    # Counts only as "some" or "none": frozen objects that die are freed, so the count can fall.
    kept = [[] for _ in range(10)]  # containers the collector tracks, alive throughout
    with long_lived_frozen():
        with long_lived_frozen():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the outer block still holds
    assert gc.get_freeze_count() == 0 and kept


def test_a_process_that_froze_objects_of_its_own_keeps_them_frozen() -> None:
    kept = [[] for _ in range(10)]  # containers the collector tracks, alive throughout
    gc.freeze()  # as the `mdb` command does after its start-up
    with long_lived_frozen():
        pass
    assert gc.get_freeze_count() >= len(kept)  # not unfrozen: at least what is alive of its own freeze
