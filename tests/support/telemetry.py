"""Shared by test_telemetry and the suites beside it (moved out of test_telemetry, which used to be imported by other test modules)."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from mdb.gdid import GDID

Series = tuple[str, frozenset[tuple[str, Any]]]


@dataclass
class Otel:
    reader: InMemoryMetricReader
    spans: InMemorySpanExporter

    def values(self) -> Counter[Series]:
        """(metric, labels) -> cumulative sum (counters) or number of recordings (histograms)."""
        out: Counter[Series] = Counter()
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for point in metric.data.data_points:
                        labels = frozenset((point.attributes or {}).items())
                        if isinstance(point, HistogramDataPoint):
                            out[(metric.name, labels)] += point.count
                        else:
                            assert isinstance(point, NumberDataPoint)
                            out[(metric.name, labels)] += point.value
        return out

    def delta(self, before: Counter[Series]) -> dict[Series, float]:
        after = self.values()
        return {k: after[k] - before[k] for k in after if after[k] != before[k]}

    def bounds(self, name: str) -> set[tuple[float, ...]]:
        """The bucket bounds of every data point of histogram ``name``."""
        data = self.reader.get_metrics_data()
        return {
            tuple(point.explicit_bounds)
            for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics
            for metric in sm.metrics if metric.name == name for point in metric.data.data_points
            if isinstance(point, HistogramDataPoint)
        }

    def all_label_values(self) -> list[Any]:
        return [value for _, labels in self.values() for _, value in labels]

    def finished_spans(self) -> tuple[ReadableSpan, ...]:
        return self.spans.get_finished_spans()


_installed: Otel | None = None
"""The one SDK of this process (an OpenTelemetry provider can be set only once)."""


@pytest.fixture(scope="module")
def otel() -> Otel:
    """The SDK, installed once per process after mdb.telemetry created its (proxy) instruments."""
    global _installed
    if _installed is None:
        assert "mdb.telemetry" in sys.modules, "mdb.telemetry must exist before the SDK, to test the proxies"
        reader, exporter = InMemoryMetricReader(), InMemorySpanExporter()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(tracer_provider)
        _installed = Otel(reader, exporter)
    return _installed


def s(name: str, **labels: str) -> Series:
    return (name, frozenset(labels.items()))


def assert_no_gdid_or_key(values: list[Any], keys: list[str]) -> None:
    """No label value is a GDID (in any text form that parses) or one of the workload's keys."""
    for value in values:
        assert value not in keys, f"label value {value!r} is a key"
        try:
            GDID.parse(str(value))
        except ValueError:
            continue
        raise AssertionError(f"label value {value!r} parses as a GDID")


