"""The suites that carry mdb's guarantees, run again through a transaction-mode PgBouncer.

Each test here calls a test of an existing suite, unchanged, with that suite's own fixture
rebuilt on databases behind one PgBouncer (3 server connections per database): the suite's
``write_map`` is swapped for :meth:`pgbouncerhelp.Pooling.write_map`, so every map it writes
has ``pooler: transaction`` and routes the application (and, where the suite opens its own
Stores for setup or inspection, those too) through PgBouncer. Stale routing, map apply,
CENTRAL atomic creation, counters, the stats lock and snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import test_central_create
import test_central_index
import test_map_apply_pg
import test_stale_routing
import test_stats_pg
from pgbouncerhelp import Pooling
from test_stats_support import create_staker, open_store

from mdb.central.creation import STEPS
from mdb.schema import apply_schema
from mdb.store import Store
from mdb.testing.pgbouncer import PgBouncer


@pytest.fixture
def pooling(pg_databases: Callable[[int], list[str]], pgbouncer: Callable[..., PgBouncer], monkeypatch: pytest.MonkeyPatch) -> Pooling:
    pooling = Pooling(pg_databases, pgbouncer)
    for module in (test_stale_routing, test_map_apply_pg, test_central_index):
        monkeypatch.setattr(module, "write_map", pooling.write_map)
    return pooling


# -- stale routing ------------------------------------------------------------------------------


@pytest.fixture
def cluster(pooling: Pooling, tmp_path: Path) -> Iterator[test_stale_routing.Cluster]:
    yield from test_stale_routing._cluster(pooling.databases(4) + pooling.databases(3), tmp_path)


def test_stale_store_with_an_older_map_through_pgbouncer(cluster: test_stale_routing.Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "pooler: transaction" in cluster.path.read_text()
    test_stale_routing.test_store_with_an_older_map_is_refused_and_retried_on_the_right_shard(cluster, monkeypatch)


def test_restamped_shard_through_pgbouncer(cluster: test_stale_routing.Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    test_stale_routing.test_shard_restamped_with_another_layout_refuses_until_the_retries_run_out(cluster, monkeypatch)


def test_fence_and_relocation_through_pgbouncer(cluster: test_stale_routing.Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    test_stale_routing.test_fence_and_relocation_send_a_stale_store_to_the_new_shard(cluster, monkeypatch)


def test_relocation_without_resident_record_through_pgbouncer(cluster: test_stale_routing.Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    test_stale_routing.test_a_relocation_without_resident_record_is_refused(cluster, monkeypatch)


def test_incoming_copy_makes_sessions_wait_through_pgbouncer(cluster: test_stale_routing.Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    test_stale_routing.test_incoming_copy_makes_sessions_wait(cluster, monkeypatch)


def test_session_waits_for_a_moves_lock_through_pgbouncer(cluster: test_stale_routing.Cluster) -> None:
    test_stale_routing.test_session_waits_for_a_moves_lock_then_follows_the_fence(cluster)


# -- map apply ----------------------------------------------------------------------------------


@pytest.fixture
def system(pooling: Pooling, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[test_map_apply_pg.System]:
    yield from test_map_apply_pg._system(pooling.databases(3) + pooling.databases(2), tmp_path, monkeypatch)


def test_map_apply_new_partition_through_pgbouncer(system: test_map_apply_pg.System) -> None:
    assert "pooler: transaction" in (system.directory / "v1.yaml").read_text()
    test_map_apply_pg.test_apply_new_partition_above_the_mark_pg(system)


def test_map_apply_refuses_a_bad_edit_through_pgbouncer(system: test_map_apply_pg.System) -> None:
    test_map_apply_pg.test_apply_refuses_a_bad_edit_and_changes_nothing(system)


def test_map_apply_catches_a_late_write_through_pgbouncer(system: test_map_apply_pg.System, monkeypatch: pytest.MonkeyPatch) -> None:
    test_map_apply_pg.test_write_after_the_mark_was_read_is_caught_under_the_lock_and_undone(system, monkeypatch)


def test_map_apply_reshard_restamps_through_pgbouncer(system: test_map_apply_pg.System) -> None:
    test_map_apply_pg.test_apply_reshard_restamps_and_drops_the_leaving_server(system)


def test_map_cli_diff_and_apply_through_pgbouncer(system: test_map_apply_pg.System) -> None:
    test_map_apply_pg.test_cli_diff_and_apply(system)


# -- CENTRAL atomic creation --------------------------------------------------------------------


@pytest.fixture
def central_map(pooling: Pooling, tmp_path: Path) -> Path:
    path = test_central_index.make_map(tmp_path, pooling.databases(2) + pooling.databases(2))
    assert "pooler: transaction" in path.read_text()
    test_central_index.open_store(path).close()  # schema, through PgBouncer
    return path


@pytest.mark.slow
def test_concurrent_registration_through_pgbouncer(central_map: Path) -> None:
    test_central_create.test_concurrent_registration_has_exactly_one_winner_per_email(central_map)


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_sigkill_at_each_creation_step_through_pgbouncer(central_map: Path, step: str) -> None:
    test_central_create.test_sigkill_at_each_creation_step_is_found_by_check_and_fixed_by_repair(central_map, step)


def test_reader_settles_a_crashed_creation_through_pgbouncer(central_map: Path) -> None:
    test_central_create.test_reader_settles_a_crashed_creation_without_repair(central_map)


# -- counters, the stats lock, event log snapshots ----------------------------------------------


@pytest.fixture
def stats_map(pooling: Pooling, tmp_path: Path) -> Path:
    c, u1, u2 = pooling.databases(3)
    path = pooling.write_map(tmp_path, {"c": c, "u1": u1, "u2": u2}, central=["c"], partitions=[("0:0:0", ["u1", "u2"])])
    with open_store(path) as store:
        assert all(r.ok for r in apply_schema(store))
        for g in test_stats_pg.USERS:
            create_staker(store, g)
    return path


@pytest.fixture
def stats_store(stats_map: Path) -> Iterator[Store]:
    with open_store(stats_map) as store:
        yield store


def test_counter_totals_exact_through_pgbouncer(stats_map: Path, stats_store: Store) -> None:
    test_stats_pg.test_counter_totals_exact_after_concurrent_increments(stats_map, stats_store, 16)


def test_first_increments_never_raise_through_pgbouncer(stats_store: Store) -> None:
    test_stats_pg.test_simultaneous_first_increments_of_a_new_counter_never_raise(stats_store)


def test_stats_lock_applies_each_calculation_once_through_pgbouncer(stats_map: Path, stats_store: Store) -> None:
    test_stats_pg.test_each_calculation_applied_exactly_once_under_concurrent_redelivery(stats_map, stats_store)


def test_stats_lock_first_deliveries_never_raise_through_pgbouncer(stats_store: Store) -> None:
    test_stats_pg.test_simultaneous_first_deliveries_never_raise(stats_store)


def test_a_late_commit_is_not_skipped_by_a_snapshot_through_pgbouncer(stats_store: Store) -> None:
    test_stats_pg.test_a_late_commit_is_not_skipped_by_a_snapshot(stats_store)


def test_snapshot_jobs_concurrent_with_writers_through_pgbouncer(stats_map: Path, stats_store: Store) -> None:
    test_stats_pg.test_snapshot_jobs_run_concurrently_with_writers_and_each_other(stats_map, stats_store)


def test_a_move_carries_stats_through_pgbouncer(stats_map: Path, stats_store: Store) -> None:
    test_stats_pg.test_a_move_carries_log_snapshots_counters_and_locks_and_duplicates_stay_applied_once(stats_map, stats_store)
