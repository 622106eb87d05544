"""``--metrics-port N`` (mdb/cli/metrics.py): a long command serves mdb's metrics to Prometheus while it runs.

Each case runs in its own process: OpenTelemetry accepts one global meter provider per process,
and this test process already has one (tests/postgres/test_telemetry.py).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from support.moves import run_cli
from support.fleet import build_skewed
from support.fleet import SERVE, _free_port, _python


BLOCKED = """
import sys
sys.modules["opentelemetry.exporter.prometheus"] = None  # as if mdb[observability] were not installed
from mdb.cli import main
main()
"""


@pytest.mark.slow  # 32 s measured at load ~15 on 2 cores: docs/testing.md
def test_the_endpoint_serves_mdb_metrics_while_the_block_runs_and_closes_after() -> None:
    pytest.importorskip("opentelemetry.exporter.prometheus")
    run = _python(SERVE, str(_free_port()))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("mdb_move_rows_total{") and 'area="user"' in line and line.endswith(" 5.0") for line in lines), run.stdout
    assert any(line.startswith("mdb_route_stale_retries_total{") and 'server="u1"' in line for line in lines), run.stdout
    assert any(line.startswith("mdb_move_pause_duration_seconds_count{") for line in lines), run.stdout
    assert lines[-1] == "CLOSED", "the endpoint ends with the command"


@pytest.mark.slow  # 21 s measured at load ~15 on 2 cores: docs/testing.md
def test_without_the_extra_the_command_stops_with_one_line_and_exit_2(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    cluster = build_skewed(tmp_sqlite_urls(5), tmp_path)
    run = _python(BLOCKED, "rebalance", str(cluster.path), "user", "--apply", "--metrics-port", str(_free_port()))
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "--metrics-port needs the optional packages of mdb[observability]" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "moved" not in run.stdout, "nothing ran"


@pytest.mark.slow  # 24 s measured at load ~15 on 2 cores: docs/testing.md
def test_rebalance_apply_with_a_metrics_port_runs(tmp_sqlite_urls: Callable[[int], list[str]], tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.exporter.prometheus")
    cluster = build_skewed(tmp_sqlite_urls(5), tmp_path)
    run = run_cli(["rebalance", str(cluster.path), "user", "--apply", "--metrics-port", str(_free_port())])
    assert run.returncode == 0, run.stderr
    assert "applied" in run.stdout
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    try:
        taken = run_cli(["rebalance", str(cluster.path), "user", "--plan", "--metrics-port", str(busy.getsockname()[1])])
    finally:
        busy.close()
    assert taken.returncode == 2 and "cannot listen" in taken.stderr, taken.stderr
