"""Progress and ETA of a reshard (issue 15): one computation (mdb.moves.status.rate_and_eta) over a
recent window, the same numbers in the CLI's bars, in `mdb moves status` and its JSON; the
`mdb reshard --rate/--max-lag` options, journaled by the reshard with its counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.moves import Cluster, create_user, make_cluster, run_cli

from mdb.cli.moves_cmd import _RichReshardProgress, format_eta
from mdb.gdid import GDID
from mdb.moves.journal import RUNNING, Journal, JournalEntry
from mdb.moves.lease import hold
from mdb.moves.status import RATE_WINDOW, RateWindow, rate_and_eta, status_of
from mdb.moves.throttle import ThrottleSettings

SERVERS = ["u1", "u2", "x"]


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the one computation --------------------------------------------------------------------------


def test_the_rate_is_over_the_last_window_not_since_the_start() -> None:
    t = 1000.0
    # 10 briefcases/s for 100 s, then 2/s for the last 30 s (a throttle took over)
    samples = [(t + s, 10 * s, 1000 * s) for s in range(0, 101, 10)] + [(t + 100 + s, 1000 + 2 * s, 100_000 + 200 * s) for s in range(10, 31, 10)]
    f = rate_and_eta(1060, 2000, 106_000, 200_000, samples, now=t + 130)
    assert f.briefcases_per_second == pytest.approx(2.0)
    assert f.rows_per_second == pytest.approx(200.0)
    assert f.eta_seconds == pytest.approx(max(940 / 2.0, 94_000 / 200.0))
    since_start = rate_and_eta(1060, 2000, 106_000, 200_000, samples, now=t + 130, window=None)
    assert since_start.briefcases_per_second == pytest.approx(1060 / 130)


def test_the_window_start_is_interpolated_between_samples() -> None:
    samples = [(0.0, 0, 0), (20.0, 100, 1000), (40.0, 100, 1000)]
    f = rate_and_eta(100, 200, 1000, 2000, samples, now=40.0, window=30.0)  # from t=10 (50 done) to 40
    assert f.briefcases_per_second == pytest.approx(50 / 30)
    assert f.rows_per_second == pytest.approx(500 / 30)


def test_a_stalled_reshard_decays_to_rate_0_and_an_unknown_eta() -> None:
    samples = [(0.0, 0, 0), (10.0, 100, 1000)]
    assert rate_and_eta(100, 200, 1000, 2000, samples, now=10.0).briefcases_per_second == pytest.approx(10.0)
    later = rate_and_eta(100, 200, 1000, 2000, samples, now=25.0)
    assert later.briefcases_per_second == pytest.approx(100 / 25)  # the window still holds the 100 moved
    stalled = rate_and_eta(100, 200, 1000, 2000, samples, now=10.0 + RATE_WINDOW + 1)
    assert (stalled.briefcases_per_second, stalled.rows_per_second, stalled.eta_seconds) == (0.0, 0.0, None)


def test_eta_is_the_later_estimate_and_leaves_out_a_count_that_did_not_move() -> None:
    samples = [(0.0, 0, 0), (10.0, 100, 100)]
    assert rate_and_eta(100, 200, 100, 1100, samples, now=10.0).eta_seconds == pytest.approx(100.0)  # rows: 1000 at 10/s
    assert rate_and_eta(100, 1100, 100, 200, samples, now=10.0).eta_seconds == pytest.approx(100.0)  # briefcases
    empty = [(0.0, 0, 0), (10.0, 100, 0)]  # empty briefcases: no rows moved, the rows left do not make it "unknown"
    assert rate_and_eta(100, 200, 0, 50, empty, now=10.0).eta_seconds == pytest.approx(10.0)
    assert rate_and_eta(200, 200, 50, 50, empty, now=10.0).eta_seconds == 0.0  # nothing left
    assert rate_and_eta(0, 10, 0, 10, [], now=10.0).eta_seconds is None
    assert rate_and_eta(0, 10, 0, 10, [(10.0, 0, 0)], now=10.0).briefcases_per_second is None  # no time measured


def test_the_window_keeps_few_samples_and_one_before_its_start() -> None:
    clock = Clock(0.0)
    window = RateWindow(window=30.0, resolution=1.0, clock=clock)
    for i in range(1, 1001):  # an update every 0.1 s for 100 s
        clock.now = i / 10
        window.add(i, 10 * i)
    samples = window.samples
    assert len(samples) <= 33
    assert samples[0][0] <= clock.now - 30.0 < samples[1][0]
    assert samples[-1] == (100.0, 1000, 10_000)
    f = window.figures(1000, 2000, 10_000, 20_000)
    assert f.briefcases_per_second == pytest.approx(10.0)
    assert f.eta_seconds == pytest.approx(100.0)


def test_the_journaled_window_reads_back_to_the_same_figures() -> None:
    clock = Clock(5000.0)
    window = RateWindow(clock=clock)
    for i in range(40):
        clock.now += 0.7
        window.add(3 * i, 300 * i)
    params = json.loads(json.dumps({"partition_start": "0:0:0", **window.to_params()}))  # through the journal's JSON
    again = RateWindow.from_params(params)
    assert again is not None and again.window == window.window
    assert again.figures(117, 500, 11_700, 50_000, now=clock.now + 3) == window.figures(117, 500, 11_700, 50_000, now=clock.now + 3)
    assert RateWindow.from_params({"partition_start": "0:0:0"}) is None  # an older mdb journaled none


def test_the_bars_and_status_show_the_same_rate_and_eta() -> None:
    """The CLI's bars and `mdb moves status` (another process, the journal only) agree."""
    clock = Clock()
    bars = _RichReshardProgress(RateWindow(clock=clock))
    journaled = RateWindow(clock=clock)  # the reshard's own, journaled with each counts update
    done = rows = 0
    for step in range(60):
        clock.now += 0.5 + (step % 7) / 10
        done, rows = done + 3, rows + 250 + step
        counts = SimpleNamespace(briefcases_done=done, briefcases_total=400, rows_done=rows, rows_total=40_000)
        journaled.add(done, rows)
        bars.counts(counts, None)  # type: ignore[arg-type]
    entry = JournalEntry("reshard-x", "reshard", "user", "moves", RUNNING, params={"partition_start": "0:0:0", **journaled.to_params()},
                         briefcases_done=done, briefcases_total=400, rows_done=rows, rows_total=40_000,
                         started_at=datetime.fromtimestamp(clock.now - 40, timezone.utc))
    status = status_of(entry, datetime.fromtimestamp(clock.now, timezone.utc))
    assert bars.figures is not None
    assert status.rate_briefcases == pytest.approx(bars.figures.briefcases_per_second)
    assert status.rate_rows == pytest.approx(bars.figures.rows_per_second)
    assert status.eta_seconds == pytest.approx(bars.figures.eta_seconds)
    assert status.rate_window == RATE_WINDOW
    assert status.to_json()["rate_window_seconds"] == RATE_WINDOW


def test_the_bar_says_why_the_throttle_waits_until_the_next_counts() -> None:
    bars = _RichReshardProgress(RateWindow(clock=Clock()))
    counts = SimpleNamespace(briefcases_done=1, briefcases_total=4, rows_done=10, rows_total=40)
    bars.counts(counts, None)  # type: ignore[arg-type]
    bars.waiting("replica lag above 5 s: u1 9.0 s", 1.0)
    descriptions = [task.description for task in bars._progress.tasks]
    assert descriptions[0] == "briefcases (waiting: replica lag above 5 s: u1 9.0 s)"
    bars.counts(counts, None)  # type: ignore[arg-type]
    assert bars._progress.tasks[0].description == "briefcases"


@pytest.mark.parametrize(("seconds", "shown"), [(None, "-"), (0.0, "0s"), (59.4, "59s"), (61.0, "1m01s"), (3725.0, "1h02m")])
def test_eta_format(seconds: float | None, shown: str) -> None:
    assert format_eta(seconds) == shown


# -- through the CLI ---------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> Cluster:
    cluster = make_cluster(dict(zip(["c", *SERVERS], tmp_sqlite_urls(4))), tmp_path, [("0:0:0", ["u1", "u2"])])
    with cluster.store() as store:
        for i in range(1, 13):
            create_user(store, GDID(0, 0, i), orders=1, lines=1)
    return cluster


@pytest.mark.slow  # 32 s measured at load ~15 on 2 cores: docs/testing.md
@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--rate", "fast", "error: --rate 'fast': cannot read 'fast'; give a comma-separated list"),
        ("--rate", "500,600", "error: --rate '500,600' gives briefcases per second twice"),
        ("--max-lag", "soon", "error: --max-lag 'soon': give seconds of replica lag, e.g. 5, 2.5s or 500ms"),
        ("--replica-timeout", "0", "error: --replica-timeout 0.0 must be more than 0 seconds"),
    ],
)
def test_bad_throttle_options_are_one_line_and_exit_2_before_anything_moves(cluster: Cluster, option: str, value: str, message: str) -> None:
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x", option, value])
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.stderr.strip() == message or run.stderr.strip().startswith(message), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    with cluster.store() as store:
        assert Journal(store).entries() == []


@pytest.fixture
def running_reshard(cluster: Cluster) -> Iterator[tuple[Cluster, JournalEntry]]:
    """A reshard journal entry driven (lease held) by this process, with a window of counts journaled."""
    window = RateWindow()
    now = datetime.now(timezone.utc).timestamp()
    for i in range(0, 21):  # 2 briefcases/s over the last 20 s
        window.add(2 * i, 20 * i, at=now - 20 + i)
    entry = JournalEntry("reshard-progress", "reshard", "user", "moves", RUNNING,
                         params={"partition_start": "0:0:0", "old_shards": ["u1", "u2"], "new_shards": SERVERS, **window.to_params()},
                         briefcases_done=40, briefcases_total=100, rows_done=400, rows_total=1000)
    with cluster.store() as store:
        journal = Journal(store)
        journal.start(entry)
        with hold(journal, entry.move_id):
            stored = journal.get(entry.move_id)
            assert stored is not None
            yield cluster, stored


@pytest.mark.slow  # 33 s measured at load ~15 on 2 cores: docs/testing.md
def test_status_json_and_table_show_the_windowed_rate_and_eta(running_reshard: tuple[Cluster, JournalEntry]) -> None:
    cluster, entry = running_reshard
    before = status_of(entry, datetime.now(timezone.utc))
    run = run_cli(["moves", "status", str(cluster.path), "--json"])
    after = status_of(entry, datetime.now(timezone.utc))
    assert run.returncode == 0, run.stderr
    (shown,) = [s for s in json.loads(run.stdout)["in_flight"] if s["move_id"] == entry.move_id]
    assert shown["driver"].startswith("running (pid ")
    assert (shown["briefcases_done"], shown["briefcases_total"], shown["rows_done"], shown["rows_total"]) == (40, 100, 400, 1000)
    assert shown["rate_window_seconds"] == RATE_WINDOW
    # no progress since the last sample: the rate only falls as time passes, so the other
    # process's figure lies between the ones computed just before and just after it ran
    assert after.rate_briefcases is not None and before.rate_briefcases is not None
    assert after.rate_briefcases <= shown["briefcases_per_second"] <= before.rate_briefcases
    assert after.rate_rows <= shown["rows_per_second"] <= before.rate_rows  # type: ignore[operator]
    assert shown["eta_seconds"] == pytest.approx(max(60 / shown["briefcases_per_second"], 600 / shown["rows_per_second"]))

    table = run_cli(["moves", "status", str(cluster.path)])
    assert table.returncode == 0, table.stderr
    assert "briefcases/s" in table.stdout and "40/100" in table.stdout and "400/1000" in table.stdout
    assert f"{entry.move_id}: rate over the last 30 s" in table.stdout


def test_status_of_a_stalled_reshard_shows_rate_0_and_no_eta(cluster: Cluster) -> None:
    window = RateWindow()
    now = datetime.now(timezone.utc).timestamp()
    window.add(0, 0, at=now - 200)
    window.add(40, 400, at=now - 100)  # nothing since (a replica lagging, say)
    entry = JournalEntry("reshard-stalled", "reshard", "user", "moves", RUNNING,
                         params={"partition_start": "0:0:0", **window.to_params()},
                         briefcases_done=40, briefcases_total=100, rows_done=400, rows_total=1000)
    with cluster.store() as store:
        journal = Journal(store)
        journal.start(entry)
        with hold(journal, entry.move_id):
            run = run_cli(["moves", "status", str(cluster.path), "--json"])
    assert run.returncode == 0, run.stderr
    (shown,) = json.loads(run.stdout)["in_flight"]
    assert (shown["briefcases_per_second"], shown["rows_per_second"], shown["eta_seconds"]) == (0.0, 0.0, None)


@pytest.mark.slow  # 35 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_throttled_reshard_through_the_cli_journals_its_settings(cluster: Cluster) -> None:
    """reshard(..., throttle=ThrottleSettings) journals settings.to_params(), so a resume keeps them."""
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x",
               "--rate", "200,50000rows", "--max-lag", "5"])
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "throttle: at most 200 briefcases/s, at most 50000 rows/s, pause while replica lag > 5 s" in run.stdout
    with cluster.store() as store:
        [entry] = [e for e in Journal(store).entries() if e.kind == "reshard"]
    assert entry.status == "done"
    assert ThrottleSettings.from_params(entry.params) == ThrottleSettings(200.0, 50000.0, 5.0)


@pytest.mark.slow  # 34 s measured at load ~15 on 2 cores: docs/testing.md
def test_a_reshard_journals_its_window_with_its_counts(cluster: Cluster) -> None:
    """Every counts update also journals RateWindow.to_params() (docs/moves.md): status reads the same window."""
    run = run_cli(["reshard", str(cluster.path), "user", "--partition", "0:0:0", "--shards", "u1,u2,x"])
    assert run.returncode == 0, (run.stdout, run.stderr)
    with cluster.store() as store:
        [entry] = [e for e in Journal(store).entries() if e.kind == "reshard"]
    window = RateWindow.from_params(entry.params)
    assert window is not None, entry.params
    assert window.samples[-1][1:] == (entry.briefcases_done, entry.rows_done)
    assert entry.briefcases_done > 0
