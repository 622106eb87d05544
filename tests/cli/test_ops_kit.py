"""The operations kit (deploy/) and ``mdb serve-metrics`` (issue 33).

* The alert rules pass ``promtool check rules`` and their unit tests (``promtool test rules``,
  one test per alert). promtool comes with the Debian package ``prometheus`` (.ci/run installs
  it); under CI=true a missing promtool fails, elsewhere the two tests skip.
* ``mdb serve-metrics`` is scraped during a reshard (running, a partition frozen), after it was
  SIGKILLed (interrupted, broken) and after ``moves resume`` (idle again): each gauge follows.
* Every metric the Grafana dashboard and the alert rules name is in a real exporter's output:
  that scrape, plus the application-side counters as ``--metrics-port`` serves them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import forkserver
from support.moves import ROOT, Cluster, run_cli
from support.templates import Databases
from support.fleet import SERVE, _free_port, _python
from support.fleet import REVISION, build, cloned, kill, start_reshard, status

from mdb.migrations.scripts import open_history

PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "mdb-fleet.json"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("promtool is not installed (Debian package 'prometheus'; .ci/run installs it)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def test_the_alert_rules_pass_promtool_check() -> None:
    done = subprocess.run([promtool(), "check", "rules", "mdb-alerts.yml"], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout


def test_each_alert_has_a_unit_test_and_they_pass() -> None:
    rules = {r["alert"] for g in yaml.safe_load((PROMETHEUS / "mdb-alerts.yml").read_text())["groups"] for r in g["rules"]}
    tests = yaml.safe_load((PROMETHEUS / "mdb-alerts.test.yml").read_text())["tests"]
    tested = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == rules
    done = subprocess.run([promtool(), "test", "rules", "mdb-alerts.test.yml"], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def scrape(port: int) -> dict[str, float]:
    """``name{labels}`` (without the otel_scope labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, value = line.rsplit(" ", 1)
        series = re.sub(r',?otel_scope_[a-z_]+="[^"]*"', "", series).replace("{,", "{").replace("{}", "")
        out[series] = float(value)
    return out


def metric_names(series: dict[str, float] | str) -> set[str]:
    lines = series if isinstance(series, str) else "\n".join(series)
    return set(re.findall(r"\bmdb_[a-z0-9_]+", lines))


def wait_scrape(port: int, proc: subprocess.Popen[str], ready: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    deadline = time.monotonic() + 120
    last: dict[str, float] = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            last = scrape(port)
        except OSError:
            last = {}
        if last and ready(last):
            return last
        time.sleep(0.3)
    raise AssertionError(f"the gauges never got there; last scrape: {last}")


@pytest.mark.slow  # 250 s measured at load ~15 on 2 cores: docs/testing.md
def test_serve_metrics_gauges_follow_a_reshard_and_the_dashboard_names_only_exported_metrics(
    pg_databases: Databases, tmp_path: Path
) -> None:
    pytest.importorskip("opentelemetry.exporter.prometheus")
    cluster: Cluster = cloned(pg_databases, tmp_path)
    root = cluster.path.parent / "migrations"  # a migration history, rolled out: mdb_migrations_mixed is 0
    open_history(root, "user", create=True)
    (root / "user" / "versions" / "a1_noop.py").write_text(REVISION, encoding="utf-8")
    assert run_cli(["migrate", "up", str(cluster.path)]).returncode == 0
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    exporter = forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", "serve-metrics", str(cluster.path),
                                 "--port", str(port), "--interval", "0.3"], cwd=str(ROOT), env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        running, frozen, interrupted = 'mdb_jobs{kind="reshard",state="running"}', 'mdb_partitions_frozen{area="user"}', \
            'mdb_jobs{kind="reshard",state="interrupted"}'
        idle = wait_scrape(port, exporter, lambda m: "mdb_fleet_status" in m)
        assert (idle["mdb_fleet_status"], idle[running], idle[interrupted], idle[frozen]) == (0, 0, 0, 0), idle
        assert idle["mdb_jobs_interrupted_oldest_age_seconds"] == 0 and idle['mdb_spare_briefcases{server="x"}'] == 0
        assert 'mdb_area_skew_ratio{area="user",measure="bytes"}' in idle and idle['mdb_relocations{area="user"}'] == 0
        assert idle['mdb_migrations_mixed{area="user"}'] == 0

        reshard = start_reshard(cluster, "reshard.during_freeze")
        try:
            during = wait_scrape(port, exporter, lambda m: m.get(frozen) == 1)
            assert during[running] == 1 and during["mdb_fleet_status"] == 0, during
            assert during['mdb_partitions_frozen_oldest_age_seconds{area="user"}'] >= 0
        finally:
            kill(reshard)
        after = wait_scrape(port, exporter, lambda m: m.get(interrupted) == 1)
        assert after[running] == 0 and after[frozen] == 1 and after["mdb_fleet_status"] == 2, after
        assert after["mdb_jobs_interrupted_oldest_age_seconds"] > 0

        assert run_cli(["moves", "resume", str(cluster.path)]).returncode == 0
        resumed = time.time()
        # A refresh that ended after the resume may have read the fleet while it ran (the job running,
        # the partition frozen); the one after it began after the resume had ended.
        stamp = "mdb_status_last_refresh_timestamp_seconds"
        first = wait_scrape(port, exporter, lambda m: m.get(stamp, 0) > resumed)[stamp]
        done = wait_scrape(port, exporter, lambda m: m.get(stamp, 0) > first)
        assert done[interrupted] == 0, done
        assert (done[running], done[frozen], done["mdb_fleet_status"], done["mdb_jobs_interrupted_oldest_age_seconds"]) == (0, 0, 0, 0), done
        assert done["mdb_status_last_refresh_timestamp_seconds"] > idle["mdb_status_last_refresh_timestamp_seconds"]
        assert done["mdb_status_refresh_errors_total"] == 0
    finally:
        exporter.send_signal(signal.SIGINT)
        try:
            exporter.communicate(timeout=30)
        finally:
            if exporter.poll() is None:
                exporter.kill()
                exporter.communicate()

    application = _python(SERVE, str(_free_port()))  # the counters an application's (or a command's) exporter serves
    assert application.returncode == 0, application.stderr
    exported = set().union(*(metric_names(m) for m in (idle, during, after, done))) | metric_names(application.stdout)
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"] for name in metric_names(target["expr"])}
    missing = {n for n in queried if n not in exported}
    assert queried and not missing, f"the dashboard queries metrics no exporter serves: {sorted(missing)}"
    rules = yaml.safe_load((PROMETHEUS / "mdb-alerts.yml").read_text())
    alerted = {n for g in rules["groups"] for r in g["rules"] for n in re.findall(r"mdb_[a-z0-9_]+", r["expr"])}
    assert alerted and not alerted - exported, sorted(alerted - exported)


@pytest.mark.slow  # 88 s measured at load ~15 on 2 cores: docs/testing.md
def test_replica_lag_is_in_status_and_a_gauge(pg_databases: Callable[[int], list[str]], pg_replica_pair: Any, tmp_path: Path) -> None:
    """The lag a `--max-lag` reshard waits on, measured the same way, outlives the command: `mdb status` and a gauge."""
    pytest.importorskip("opentelemetry.exporter.prometheus")
    c, u2, x = pg_databases(3)
    cluster: Cluster = build([c, pg_replica_pair.primary_url, u2, x], tmp_path)
    data = yaml.safe_load(cluster.path.read_text(encoding="utf-8"))
    data["servers"]["u1"]["replica"] = pg_replica_pair.replica_url
    cluster.path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    pg_replica_pair.wait_for_replay()
    _, out = status(cluster)
    assert set(out["replica_lag_seconds"]) == {"u1"} and 0 <= out["replica_lag_seconds"]["u1"] < 60, out["replica_lag_seconds"]
    port = _free_port()
    exporter = forkserver.popen([sys.executable, "-c", "from mdb.cli import main; main()", "serve-metrics", str(cluster.path),
                                 "--port", str(port), "--interval", "0.3"], cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = wait_scrape(port, exporter, lambda m: 'mdb_replica_lag_seconds{server="u1"}' in m)
        assert 0 <= seen['mdb_replica_lag_seconds{server="u1"}'] < 60
        assert not any(k.startswith("mdb_replica_lag_seconds") and '"u2"' in k for k in seen)  # no replica, no series
    finally:
        exporter.terminate()
        exporter.communicate(timeout=30)
