"""Telemetry configurations of the benchmark project, for benchmarks/telemetry_cost.py.

``IDEMPOTENCY_BENCH_TELEMETRY`` picks one; unset, the project is what it
always was (the package's defaults, no SDK, no extra routes):

* ``off``: ``METRICS = ()`` and ``TRACING = False``;
* ``api-only``: the defaults, the OpenTelemetry API and no SDK (the API's
  no-op proxies): what a project that installed the package gets;
* ``sdk``: the defaults with an SDK in each process (``configure_sdk``, run
  by gunicorn's ``post_fork`` hook, gunicorn_telemetry.py): a MeterProvider
  exporting every 10 s and a TracerProvider sampling everything into a
  BatchSpanProcessor, both to exporters that only count what they are
  given (OTLP without a collector);
* ``prometheus``: ``METRICS = ("prometheus",)``, ``TRACING = False``; run it
  with ``PROMETHEUS_MULTIPROC_DIR`` set (multiprocess mode, as under gunicorn).

With the variable set, ``urls.py`` adds ``metrics`` (the package's
``metrics_view``) and ``telemetry`` (this process's configuration and what
its SDK exported, as JSON): the benchmark checks that each configuration
really recorded what it claims to, so that a broken one cannot pass as cheap.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse

ENV = "IDEMPOTENCY_BENCH_TELEMETRY"
CONFIGURATIONS = ("off", "api-only", "sdk", "prometheus")
#: How often the SDK's metric reader collects and exports (the SDK's default is 60 s).
EXPORT_INTERVAL_MS = 10_000


def configuration() -> str | None:
    name = os.environ.get(ENV) or None
    if name is not None and name not in CONFIGURATIONS:
        raise ValueError(f"{ENV}={name!r}: one of {', '.join(CONFIGURATIONS)}")
    return name


def idempotency_settings(name: str) -> dict[str, object]:
    """The ``IDEMPOTENCY`` entries of configuration ``name`` (the defaults: none)."""
    if name == "off":
        return {"METRICS": (), "TRACING": False}
    if name == "prometheus":
        return {"METRICS": ("prometheus",), "TRACING": False}
    return {}


class _Exported:
    """What the SDK's exporters were given in this process (they send it nowhere)."""

    def __init__(self) -> None:
        self.spans: collections.Counter[str] = collections.Counter()
        #: Cumulative values of the last export: the request counter by outcome.
        self.requests: dict[str, float] = {}
        self.durations = 0
        self.exports = 0


_exported = _Exported()
_providers: list[Any] = []


def configure_sdk() -> None:
    """Install an SDK MeterProvider and TracerProvider in this process (once, after fork)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        MetricsData,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    class CountingMetricExporter(MetricExporter):
        def export(
            self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
        ) -> MetricExportResult:
            _exported.exports += 1
            for resource in metrics_data.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        points: Any = metric.data.data_points
                        if metric.name == "idempotency.requests":
                            requests: dict[str, float] = collections.defaultdict(float)
                            for point in points:
                                requests[str(point.attributes["outcome"])] += point.value
                            _exported.requests = dict(requests)
                        elif metric.name == "idempotency.protection.duration":
                            _exported.durations = sum(point.count for point in points)
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            pass

    class CountingSpanExporter(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            _exported.spans.update(span.name for span in spans)
            return SpanExportResult.SUCCESS

    reader = PeriodicExportingMetricReader(
        CountingMetricExporter(), export_interval_millis=EXPORT_INTERVAL_MS
    )
    meter_provider = MeterProvider(metric_readers=[reader])
    tracer_provider = TracerProvider(sampler=ALWAYS_ON)
    tracer_provider.add_span_processor(BatchSpanProcessor(CountingSpanExporter()))
    metrics.set_meter_provider(meter_provider)
    trace.set_tracer_provider(tracer_provider)
    _providers[:] = [meter_provider, tracer_provider]


def report() -> dict[str, Any]:
    """This process's telemetry: its configuration and, with the SDK, what it exported."""
    from django_idempotency._observability import recording as metrics
    from django_idempotency.conf import idempotency_settings as conf

    found: dict[str, Any] = {
        "pid": os.getpid(),
        "configuration": configuration(),
        "metrics_setting": list(conf.METRICS),
        "tracing_setting": conf.TRACING,
        "sinks": [repr(sink) for sink in metrics.sinks()],
    }
    try:
        from opentelemetry import metrics as otel_metrics
        from opentelemetry import trace
    except ImportError:
        return found
    found["meter_provider"] = type(otel_metrics.get_meter_provider()).__name__
    found["tracer_provider"] = type(trace.get_tracer_provider()).__name__
    for provider in _providers:
        provider.force_flush()
    if _providers:
        found["exports"] = _exported.exports
        found["requests"] = _exported.requests
        found["durations"] = _exported.durations
        found["spans"] = dict(_exported.spans)
    return found


def telemetry_view(request: HttpRequest) -> JsonResponse:
    return JsonResponse(report())


def metrics_view(request: HttpRequest) -> HttpResponse:
    # Imported here: django_idempotency._observability.prometheus needs prometheus_client.
    from django_idempotency.prometheus import metrics_view as package_view

    return package_view(request)
