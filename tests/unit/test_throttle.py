"""The reshard throttle with a fake clock: --rate/--max-lag syntax, pacing math, thread safety,
waiting for lagging and unreachable replicas (the real replica is in test_throttle_pg.py)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from mdb.dialects import sql_dialect
from mdb.errors import MdbError, ServerUnavailableError
from mdb.moves.throttle import DEFAULT_REPLICA_TIMEOUT, Throttle, ThrottleSettings, replicas_of
from mdb.urls import MONGO, SQL


class FakeClock:
    """Time that passes only when the throttle sleeps; every sleep is recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


class ThreadClocks:
    """One fake clock per thread: a thread's sleep passes only its own time, so each thread ends
    a wait exactly at the start of the slot the throttle reserved for it."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        return float(getattr(self._local, "now", 0.0))

    def sleep(self, seconds: float) -> None:
        self._local.now = self() + seconds


def fake_cluster(kinds: dict[str, str], replicas: set[str], sqlite: frozenset[str] = frozenset()) -> Any:
    return SimpleNamespace(
        map=SimpleNamespace(kind_of=lambda s: kinds[s]),
        engines=SimpleNamespace(has_replica=lambda s: s in replicas,
                                sql_dialect=lambda s: sql_dialect("sqlite" if s in sqlite else "postgresql")),
    )


NO_SERVERS = fake_cluster({}, set())


def throttle(settings: ThrottleSettings, clock: Any, **kwargs: Any) -> Throttle:
    return Throttle(kwargs.pop("cluster", NO_SERVERS), settings, kwargs.pop("servers", []), clock=clock, sleep=clock.sleep, **kwargs)


# -- the CLI text -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "briefcases", "rows"),
    [
        ("500", 500.0, None),
        ("500/s", 500.0, None),
        ("12.5 briefcases/s", 12.5, None),
        ("20000rows", None, 20000.0),
        ("20000 rows/s", None, 20000.0),
        ("500,20000rows", 500.0, 20000.0),
        (" 20000ROWS , 500bc ", 500.0, 20000.0),
        ("1e3", 1000.0, None),
    ],
)
def test_rate_syntax(rate: str, briefcases: float | None, rows: float | None) -> None:
    settings = ThrottleSettings.parse(rate, None)
    assert (settings.briefcases_per_second, settings.rows_per_second, settings.max_lag) == (briefcases, rows, None)
    assert settings.limited


@pytest.mark.parametrize(
    ("max_lag", "seconds"), [("5", 5.0), ("2.5s", 2.5), ("500ms", 0.5), (" 10 S ", 10.0)],
)
def test_max_lag_syntax(max_lag: str, seconds: float) -> None:
    settings = ThrottleSettings.parse(None, max_lag)
    assert (settings.briefcases_per_second, settings.rows_per_second, settings.max_lag) == (None, None, seconds)
    assert settings.replica_timeout == DEFAULT_REPLICA_TIMEOUT


@pytest.mark.parametrize(
    ("rate", "max_lag", "message"),
    [
        ("fast", None, "cannot read 'fast'"),
        ("", None, "is empty"),
        ("0", None, "'0' must be more than 0"),
        ("-5", None, "cannot read '-5'"),
        ("500,600", None, "briefcases per second twice"),
        ("10rows,5rows", None, "rows per second twice"),
        ("10 bytes", None, "unknown unit 'bytes'"),
        ("500,", None, "cannot read ''"),
        (None, "soon", "--max-lag 'soon'"),
        (None, "0", "must be more than 0 seconds"),
        (None, "5min", "--max-lag '5min'"),
    ],
)
def test_bad_cli_text_is_refused_with_what_was_wrong(rate: str | None, max_lag: str | None, message: str) -> None:
    with pytest.raises(MdbError) as raised:
        ThrottleSettings.parse(rate, max_lag)
    assert message in str(raised.value)


def test_nothing_given_is_not_throttled() -> None:
    settings = ThrottleSettings.parse(None, None)
    assert settings == ThrottleSettings()
    assert not settings.limited
    assert settings.describe() == "not throttled"


def test_bad_replica_timeout_and_bad_settings_are_refused() -> None:
    with pytest.raises(MdbError, match="--replica-timeout"):
        ThrottleSettings.parse(None, "5", replica_timeout=0.0)
    with pytest.raises(MdbError, match="briefcases per second must be a positive number"):
        ThrottleSettings(briefcases_per_second=-1.0)


def test_settings_travel_through_the_journal_params_and_older_journals_mean_unlimited() -> None:
    settings = ThrottleSettings.parse("500,20000rows", "2.5s", replica_timeout=60.0)
    params = json.loads(json.dumps({"partition_start": "0:0:0", **settings.to_params()}))  # as the journal stores it
    assert ThrottleSettings.from_params(params) == settings
    assert ThrottleSettings.from_params({"partition_start": "0:0:0"}) == ThrottleSettings()
    assert ThrottleSettings.from_params({"throttle": {"max_lag": 3}}) == ThrottleSettings(max_lag=3.0)
    with pytest.raises(MdbError, match="max_lag is not a number"):
        ThrottleSettings.from_params({"throttle": {"max_lag": "3"}})


# -- pacing ------------------------------------------------------------------------------------


def test_briefcases_per_second_spaces_the_cutovers_by_their_cost() -> None:
    clock = FakeClock()
    t = throttle(ThrottleSettings(briefcases_per_second=100.0), clock)
    starts = []
    for _ in range(5):
        t.wait(10, 0)  # 10 briefcases at 100/s cost 0.1 s each, paid before they start
        starts.append(clock.now)
    assert starts == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert t.waited["rate"] == pytest.approx(0.5)


def test_the_stricter_limit_decides() -> None:
    clock = FakeClock()
    t = throttle(ThrottleSettings(briefcases_per_second=100.0, rows_per_second=1000.0), clock)
    assert t.cost(1, 500) == pytest.approx(0.5)  # rows: 0.5 s, briefcases: 0.01 s
    assert t.cost(50, 10) == pytest.approx(0.5)  # briefcases: 0.5 s, rows: 0.01 s
    t.wait(1, 500)
    t.wait(50, 10)
    assert clock.now == pytest.approx(1.0)
    t.wait(1, 1)
    assert clock.now == pytest.approx(1.01)


def test_no_overshoot_at_the_start_with_growing_batches() -> None:
    """Issue 29: batches of 8, 16, 32, 64 under 100/s: by any moment, at most 100/s x the time
    since the first wait have started (paying afterwards let 120 start within 0.56 s)."""
    clock = FakeClock()
    t = throttle(ThrottleSettings(briefcases_per_second=100.0), clock)
    started = 0
    for n in (8, 16, 32, 64, 128, 128):
        t.wait(n, 0)
        started += n
        assert started <= 100.0 * clock.now + 1e-9, (started, clock.now)
    assert clock.now == pytest.approx(started / 100.0)


def test_a_slow_reshard_earns_no_burst() -> None:
    clock = FakeClock()
    t = throttle(ThrottleSettings(rows_per_second=100.0), clock)
    t.wait(1, 100)
    assert clock.now == pytest.approx(1.0)
    clock.now += 60.0  # the cutovers themselves took a minute
    t.wait(1, 100)
    assert clock.now == pytest.approx(62.0)  # it waits its own cost: a minute of slowness earns no credit


def test_long_rate_waits_are_announced_in_slices_so_a_cancel_is_seen() -> None:
    clock = FakeClock()
    seen: list[tuple[str, float]] = []
    t = throttle(ThrottleSettings(briefcases_per_second=0.25), clock, on_wait=lambda why, s: seen.append((why, s)), poll_interval=1.0)
    t.wait(1, 0)  # costs 4 s
    assert [s for _, s in seen] == pytest.approx([1.0, 1.0, 1.0, 1.0])
    assert all("at most 0.25 briefcases/s" in why for why, _ in seen)


def test_what_on_wait_raises_ends_the_wait() -> None:
    clock = FakeClock()

    def cancelled(why: str, seconds: float) -> None:
        raise MdbError("cancelled by `mdb moves cancel`")

    t = throttle(ThrottleSettings(briefcases_per_second=1.0), clock, on_wait=cancelled)
    with pytest.raises(MdbError, match="cancelled"):
        t.wait(1, 0)


def test_parallel_workers_share_one_budget_and_never_get_the_same_slot() -> None:
    clocks = ThreadClocks()
    t = Throttle(NO_SERVERS, ThrottleSettings(briefcases_per_second=1000.0), [], clock=clocks, sleep=clocks.sleep,
                 poll_interval=1e9)
    starts: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        for _ in range(200):
            t.wait(1, 0)
            with lock:
                starts.append(clocks())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(starts) == 1600
    # every cutover got its own millisecond: 1, 2, ..., 1600 ms, none twice, none skipped
    assert sorted(round(s * 1000) for s in starts) == list(range(1, 1601))


# -- replicas ------------------------------------------------------------------------------------


def test_only_sql_servers_with_a_replica_in_the_map_are_watched() -> None:
    cluster = fake_cluster({"a": SQL, "b": SQL, "f": SQL, "m": MONGO}, replicas={"a", "f", "m"}, sqlite=frozenset({"f"}))
    assert replicas_of(cluster, ["a", "b", "f", "m", "a"]) == ["a"]
    t = Throttle(cluster, ThrottleSettings(max_lag=1.0), ["a", "b"], lag_of=lambda s: 0.0)
    assert t.replicas == ["a"]
    assert Throttle(cluster, ThrottleSettings(rows_per_second=1.0), ["a"]).replicas == []  # no --max-lag: nothing asked


class Lags:
    """lag_of: a script of answers per server (a number, or an exception to raise)."""

    def __init__(self, script: dict[str, list[Any]]) -> None:
        self._script = {s: iter(answers) for s, answers in script.items()}
        self.asked: list[str] = []

    def __call__(self, server: str) -> float:
        self.asked.append(server)
        answer = next(self._script[server])
        if isinstance(answer, BaseException):
            raise answer
        return float(answer)


def lag_cluster() -> Any:
    return fake_cluster({"u1": SQL, "u2": SQL}, replicas={"u1", "u2"})


def test_lag_above_max_lag_pauses_until_the_replica_catches_up() -> None:
    clock = FakeClock()
    seen: list[tuple[str, float]] = []
    lags = Lags({"u1": [9.5, 7.0, 0.2, 0.1], "u2": [0.0, 0.0, 0.0, 0.0]})
    t = throttle(ThrottleSettings(max_lag=5.0), clock, cluster=lag_cluster(), servers=["u1", "u2"], lag_of=lags,
                 on_wait=lambda why, s: seen.append((why, s)), poll_interval=0.5, lag_check_interval=0.0)
    t.wait(1, 100)
    assert seen == [("replica lag above 5 s: u1 9.5 s", 0.5), ("replica lag above 5 s: u1 7.0 s", 0.5)]
    assert t.waited == {"rate": 0.0, "lag": 1.0, "unreachable": 0.0}
    assert lags.asked == ["u1", "u2"] * 3


def test_a_fresh_lag_check_is_reused_by_the_next_cutovers() -> None:
    clock = FakeClock()
    lags = Lags({"u1": [0.0, 0.0]})
    t = throttle(ThrottleSettings(max_lag=5.0), clock, cluster=lag_cluster(), servers=["u1"], lag_of=lags, lag_check_interval=1.0)
    t.wait(1, 1)
    t.wait(1, 1)
    assert lags.asked == ["u1"]
    clock.now += 1.0
    t.wait(1, 1)
    assert lags.asked == ["u1", "u1"]


def test_an_unreachable_replica_is_waited_for_then_the_reshard_stops() -> None:
    clock = FakeClock()
    seen: list[str] = []
    down = ServerUnavailableError("u1", "connection refused")
    t = throttle(ThrottleSettings(max_lag=5.0, replica_timeout=3.0), clock, cluster=lag_cluster(), servers=["u1"],
                 lag_of=Lags({"u1": [down] * 10}), on_wait=lambda why, s: seen.append(why), lag_check_interval=0.0)
    with pytest.raises(ServerUnavailableError) as raised:
        t.wait(1, 1)
    assert "could not be asked for its lag for 3 s (the replica timeout is 3 s)" in str(raised.value)
    assert raised.value.server == "u1"
    assert seen == [
        "replica unreachable, waiting: u1 (0 s: server 'u1' is unavailable: connection refused)",
        "replica unreachable, waiting: u1 (1 s: server 'u1' is unavailable: connection refused)",
        "replica unreachable, waiting: u1 (2 s: server 'u1' is unavailable: connection refused)",
    ]
    assert t.waited["unreachable"] == pytest.approx(3.0)


def test_a_replica_that_comes_back_resets_the_unreachable_clock() -> None:
    clock = FakeClock()
    down = ServerUnavailableError("u1", "connection refused")
    t = throttle(ThrottleSettings(max_lag=5.0, replica_timeout=2.5), clock, cluster=lag_cluster(), servers=["u1"],
                 lag_of=Lags({"u1": [down, down, 0.0, down, down, 0.0]}), lag_check_interval=0.0)
    t.wait(1, 1)  # down 2 s (< 2.5), then back
    t.wait(1, 1)  # down 2 s again: counted from its own start, so not 4 s
    assert t.waited["unreachable"] == pytest.approx(4.0)


def test_lag_and_rate_combine() -> None:
    clock = FakeClock()
    t = throttle(ThrottleSettings(briefcases_per_second=1.0, max_lag=1.0), clock, cluster=lag_cluster(), servers=["u1"],
                 lag_of=Lags({"u1": [0.0, 3.0, 0.0]}), lag_check_interval=0.0)
    t.wait(1, 1)  # its 1 s of rate; the replica is caught up
    t.wait(1, 1)  # its 1 s of rate, then 1 s while the replica lags 3 s
    assert t.waited == {"rate": pytest.approx(2.0), "lag": pytest.approx(1.0), "unreachable": 0.0}

