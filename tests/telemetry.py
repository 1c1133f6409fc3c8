"""The OpenTelemetry SDK, in memory: what a project's exporters would receive.

The SDK's providers can be set once per process, so they are set at the
first use and kept; each test compares readings before and after what it
does, and clears the spans it looked at.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_installed: tuple[InMemoryMetricReader, InMemorySpanExporter] | None = None


def installed() -> tuple[InMemoryMetricReader, InMemorySpanExporter]:
    global _installed
    if _installed is None:
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        exporter = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(tracer_provider)
        _installed = (reader, exporter)
    return _installed


class Readings:
    """One collection of every instrument's points, looked up by name and attributes."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        self.points: list[tuple[str, dict[str, Any], Any]] = []
        data = reader.get_metrics_data()
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                if scope.scope.name != "django_idempotency":
                    continue
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        self.points.append((metric.name, dict(point.attributes or {}), point))

    def matching(self, name: str, attributes: Mapping[str, Any]) -> list[Any]:
        return [
            point
            for metric, labels, point in self.points
            if metric == name and all(labels.get(k) == v for k, v in attributes.items())
        ]

    def value(self, name: str, **attributes: Any) -> float:
        """A counter's sum over the matching points (a histogram's count; a gauge's value)."""
        total = 0.0
        for point in self.matching(name, attributes):
            total += point.count if hasattr(point, "bucket_counts") else point.value
        return total

    def labels(self, name: str) -> list[dict[str, Any]]:
        return [labels for metric, labels, _ in self.points if metric == name]


def spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return list(exporter.get_finished_spans())


def attributes_of_the_span_around(call: Callable[[], object]) -> dict[str, Any]:
    """Run ``call`` under a span of its own (as a worker's task span); its attributes after."""
    from opentelemetry.trace import SpanKind

    _, exporter = installed()
    exporter.clear()
    with (
        trace.get_tracer("tests").start_as_current_span("run/task", kind=SpanKind.CONSUMER),
        contextlib.suppress(Exception),
    ):
        call()
    (span,) = [span for span in exporter.get_finished_spans() if span.name == "run/task"]
    return dict(span.attributes or {})
