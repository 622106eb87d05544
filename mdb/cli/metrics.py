"""``--metrics-port N``: long-running commands serve mdb's metrics to Prometheus while they run.

``mdb reshard``, ``mdb moves resume`` and ``mdb rebalance --apply`` run for minutes to hours;
an operator wants their rows/s, pauses and verification failures on the same dashboards as
the application's. mdb itself only depends on the OpenTelemetry API (a no-op without an SDK);
this switch installs the SDK with the OpenTelemetry Prometheus exporter for the length of the
command and serves ``/metrics`` on the port (``prometheus_client``'s HTTP server). The packages
come with the optional extra ``observability`` (``pip install 'mdb[observability]'``); without
them the command stops at once with one line and exit 2, before touching any server.

Use: add :data:`MetricsPortOpt` to the command's options and run its work inside
``with serve_metrics(metrics_port):``. The endpoint ends with the command, so a scrape
interval shorter than the run sees it (docs/observability.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from opentelemetry import metrics

from mdb.cli.app import fail

__all__ = ["MetricsPortOpt", "serve_metrics"]

MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        "--metrics-port", metavar="N", min=1, max=65535, show_default=False,
        help="Serve mdb's metrics for Prometheus on port N (/metrics) while the command runs (needs the optional extra 'observability').",
    ),
]

EXTRA_MISSING = "--metrics-port needs the optional packages of mdb[observability] (pip install 'mdb[observability]')"


@contextmanager
def serve_metrics(port: int | None, *, host: str = "0.0.0.0") -> Iterator[None]:
    """While the block runs, export mdb's metrics through a Prometheus endpoint on ``port`` (None: nothing).

    The SDK's meter provider becomes the process's global one (OpenTelemetry allows that once
    per process; a CLI command is its own process), so every instrument mdb created earlier
    through the API starts recording. The HTTP server and the provider are shut down at the end.
    """
    if port is None:
        yield
        return
    try:  # by name: the extra is optional, so neither mypy nor the import of this module may need it
        exporter = importlib.import_module("opentelemetry.exporter.prometheus")
        sdk = importlib.import_module("opentelemetry.sdk.metrics")
        client = importlib.import_module("prometheus_client")
    except ImportError as exc:
        fail(f"{EXTRA_MISSING}: {exc.name or exc} is not installed")
    try:
        server, thread = client.start_http_server(port, addr=host)
    except OSError as exc:
        fail(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc})")
    provider = sdk.MeterProvider(metric_readers=[exporter.PrometheusMetricReader()])
    metrics.set_meter_provider(provider)
    try:
        yield
    finally:
        server.shutdown()
        thread.join(timeout=5)
        provider.shutdown()
