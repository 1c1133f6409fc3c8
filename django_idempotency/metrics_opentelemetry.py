"""The OpenTelemetry sink of ``metrics``: instruments of the OpenTelemetry API.

The API hands out a proxy meter until the project installs an SDK's
``MeterProvider`` (``opentelemetry-instrument``, or its own set-up code),
and forwards to it from then on: the instruments made here at the first
request work whether the SDK came first or later. Without the API
installed there is no sink at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django_idempotency import __version__
from django_idempotency.metrics import DURATION_BUCKETS, INSTRUMENTS, Instrument

__all__ = ["OpenTelemetrySink", "opentelemetry_sink"]


class OpenTelemetrySink:
    def __init__(self, meter: Any) -> None:
        self.instruments: dict[str, Any] = {}
        for instrument in INSTRUMENTS:
            if instrument.kind == "counter":
                made = meter.create_counter(
                    instrument.name, unit=instrument.unit, description=instrument.description
                )
            elif instrument.kind == "histogram":
                made = meter.create_histogram(
                    instrument.name,
                    unit=instrument.unit,
                    description=instrument.description,
                    explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
                )
            else:
                made = meter.create_gauge(
                    instrument.name, unit=instrument.unit, description=instrument.description
                )
            self.instruments[instrument.name] = made

    def add(self, instrument: Instrument, amount: float, labels: Mapping[str, str]) -> None:
        self.instruments[instrument.name].add(amount, labels)

    def record(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
        self.instruments[instrument.name].record(value, labels)

    def set(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
        self.instruments[instrument.name].set(value, labels)

    def __repr__(self) -> str:
        return "OpenTelemetrySink()"


def opentelemetry_sink() -> OpenTelemetrySink | None:
    """The sink, or None when the OpenTelemetry API is not installed."""
    try:
        from opentelemetry import metrics
    except ImportError:
        return None
    return OpenTelemetrySink(metrics.get_meter("django_idempotency", __version__))
