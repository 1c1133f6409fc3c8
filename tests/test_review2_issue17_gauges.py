"""Second review of issue 17: the OpenTelemetry gauges, now observable, with several readers."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from django_idempotency._observability.opentelemetry import OpenTelemetrySink
from django_idempotency.metrics import INSTRUMENTS
from tests.telemetry import Readings


def test_every_reader_of_the_meter_provider_sees_the_census() -> None:
    """A project exporting to two places (OTLP and Prometheus, OTLP and the console).

    ``OpenTelemetrySink.observe`` hands each census over once, to whichever
    reader collects first: the SDK runs the callbacks per reader and gives
    their measurements to that reader only
    (``SynchronousMeasurementConsumer.collect``). The other reader never
    sees the gauges, so its alert rules see ``IdempotencyCensusMissing``.
    """
    first, second = InMemoryMetricReader(), InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[first, second])
    try:
        sink = OpenTelemetrySink(provider.get_meter("django_idempotency"))
        records = next(i for i in INSTRUMENTS if i.name == "idempotency.records")
        # What publish_census does with a census: one value per state.
        sink.set(records, 7, {"database": "default", "state": "UNCERTAIN"})

        seen_first = Readings(first).value("idempotency.records", state="UNCERTAIN")
        seen_second = Readings(second).value("idempotency.records", state="UNCERTAIN")
    finally:
        provider.shutdown()

    assert (seen_first, seen_second) == (7, 7)
