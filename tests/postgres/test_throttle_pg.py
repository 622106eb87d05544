"""The reshard throttle against a real streaming replica (PostgreSQL 15, pg_basebackup -R).

Replay on the replica is paused with pg_wal_replay_pause(), the primary writes, the replica's lag
grows past --max-lag and Throttle.wait blocks; pg_wal_replay_resume() lets it return. Under CI=true
these tests fail when PostgreSQL cannot start (tests/support/plugin.py), they never skip.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from support.mapfiles import write_map
from mdb.errors import ServerUnavailableError
from mdb.moves.throttle import Throttle, ThrottleSettings, replica_lag
from mdb.store import Store

DEADLINE = 60.0
"""Seconds a step may take before the test gives up (a bound against hanging, not an assertion on speed)."""


@contextmanager
def replica_store(tmp_path: Path, pair: Any, central: str) -> Iterator[Store]:
    path = write_map(tmp_path, {"c": central, "u1": pair.primary_url}, central=["c"], partitions=[("0:0:0", ["u1"])],
                     replicas={"u1": pair.replica_url})
    with Store.from_yaml(path, types=[]) as store:
        yield store


@contextmanager
def replay_paused(replica_url: str) -> Iterator[Callable[[], None]]:
    """Pause WAL replay on the replica; yields ``resume``; replay is resumed in any case (the
    replica is shared by the session's tests)."""
    engine = create_engine(replica_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_wal_replay_pause()"))

            def resume() -> None:
                conn.execute(text("SELECT pg_wal_replay_resume()"))

            try:
                yield resume
            finally:
                resume()
    finally:
        engine.dispose()


def write_on_primary(primary_url: str, n: int) -> None:
    engine = create_engine(primary_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE IF NOT EXISTS throttle_probe (n int)"))
            conn.execute(text("INSERT INTO throttle_probe SELECT generate_series(1, :n)"), {"n": n})
    finally:
        engine.dispose()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE} s: {what}")
        time.sleep(0.05)


def test_an_idle_caught_up_replica_has_no_lag(pg_replica_pair: Any, pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    """now() - pg_last_xact_replay_timestamp() alone would say "behind by the idle time"."""
    (central,) = pg_databases(1)
    write_on_primary(pg_replica_pair.primary_url, 10)
    pg_replica_pair.wait_for_replay()
    with replica_store(tmp_path, pg_replica_pair, central) as store:
        engine = create_engine(pg_replica_pair.replica_url)
        try:
            with engine.connect() as conn:
                def idle_for_more_than_a_second() -> bool:
                    age = conn.execute(text("SELECT extract(epoch FROM now() - pg_last_xact_replay_timestamp())")).scalar_one()
                    conn.rollback()  # now() is the transaction's start: take a new one each time
                    return float(age) > 1.0

                wait_until(idle_for_more_than_a_second, "the last replayed commit is a second old")
        finally:
            engine.dispose()
        assert replica_lag(store, "u1") == 0.0
        assert replica_lag(store, "c") == 0.0  # no replica in the map: the primary itself is not in recovery
        seen: list[str] = []
        throttle = Throttle(store, ThrottleSettings(max_lag=0.5), ["u1", "c"], on_wait=lambda why, s: seen.append(why))
        assert throttle.replicas == ["u1"]
        throttle.wait(1, 10)
        assert seen == []
        assert throttle.waited["lag"] == 0.0


def test_wait_blocks_while_replay_is_paused_and_returns_once_it_resumes(
    pg_replica_pair: Any, pg_databases: Callable[[int], list[str]], tmp_path: Path
) -> None:
    (central,) = pg_databases(1)
    pg_replica_pair.wait_for_replay()
    with replica_store(tmp_path, pg_replica_pair, central) as store, replay_paused(pg_replica_pair.replica_url) as resume:
        write_on_primary(pg_replica_pair.primary_url, 1000)
        wait_until(lambda: replica_lag(store, "u1") > 0.5, "the paused replica is more than 0.5 s behind")

        waiting = threading.Event()
        reasons: list[str] = []
        failure: list[BaseException] = []

        def on_wait(why: str, seconds: float) -> None:
            reasons.append(why)
            waiting.set()

        throttle = Throttle(store, ThrottleSettings(max_lag=0.5), ["u1"], on_wait=on_wait, poll_interval=0.1,
                            lag_check_interval=0.0)

        def cutover() -> None:
            try:
                throttle.wait(10, 1000)
            except BaseException as exc:
                failure.append(exc)

        worker = threading.Thread(target=cutover)
        worker.start()
        try:
            assert waiting.wait(DEADLINE), "the throttle never said it waits"
            assert worker.is_alive(), "wait returned although the replica is still paused"
            assert reasons[0].startswith("replica lag above 0.5 s: u1 ")
        finally:
            resume()
            worker.join(DEADLINE)
        assert not worker.is_alive(), "wait did not return after replay resumed"
        assert failure == []
        assert throttle.waited["lag"] > 0.0
        assert replica_lag(store, "u1") <= 0.5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_replica_is_reported_then_stops_the_wait(pg_databases: Callable[[int], list[str]], tmp_path: Path) -> None:
    central, primary = pg_databases(2)
    gone = make_url(primary).set(host="127.0.0.1", port=_closed_port()).render_as_string(hide_password=False)
    path = write_map(tmp_path, {"c": central, "u1": primary}, central=["c"], partitions=[("0:0:0", ["u1"])], replicas={"u1": gone})
    reasons: list[str] = []
    with Store.from_yaml(path, types=[]) as store:
        throttle = Throttle(store, ThrottleSettings(max_lag=5.0, replica_timeout=0.3), ["u1"],
                            on_wait=lambda why, s: reasons.append(why), poll_interval=0.1, lag_check_interval=0.0)
        with pytest.raises(ServerUnavailableError) as raised:
            throttle.wait(1, 1)
    assert raised.value.server == "u1"
    assert "the replica timeout is 0.3 s" in str(raised.value)
    assert reasons and all(r.startswith("replica unreachable, waiting: u1 (") for r in reasons)
