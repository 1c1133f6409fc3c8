"""The OpenTelemetry sink of ``metrics``: instruments of the OpenTelemetry API.

The API hands out a proxy meter until the project installs an SDK's
``MeterProvider`` (``opentelemetry-instrument``, or its own set-up code),
and forwards to it from then on: the instruments made here at the first
request work whether the SDK came first or later. Without the API
installed there is no sink at all.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Mapping
from typing import Any

from django_idempotency import __version__
from django_idempotency._observability.providers import meter_provider_set
from django_idempotency.metrics import DURATION_BUCKETS, INSTRUMENTS, Instrument

#: How long a process goes on reporting the census it took (seconds): the
#: beat schedule takes one a minute, so a fresh one replaces it well before.
CENSUS_REPORTED_FOR = 150.0


class OpenTelemetrySink:
    """Counters and the histogram are synchronous; the gauges are observed.

    A process reports the census it took at every collection (each reader's,
    each scrape of a pull exporter) for ``CENSUS_REPORTED_FOR`` seconds,
    then no more. A synchronous gauge would report its last value for
    ever: under Celery's prefork pool each child that ever ran
    ``observe_records`` would go on reporting its own old census (an
    UNCERTAIN record long resolved, still "old"), and the alert rules'
    ``max by (database)`` would keep firing on it.
    """

    def __init__(self, meter: Any) -> None:
        self.instruments: dict[str, Any] = {}
        #: Gauge -> labels -> (value, when it was set, time.monotonic()).
        self.census: dict[str, dict[frozenset[tuple[str, str]], tuple[float, float]]] = {}
        self.lock = threading.Lock()
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
                self.census[instrument.name] = {}
                made = meter.create_observable_gauge(
                    instrument.name,
                    callbacks=[functools.partial(self.observe, instrument.name)],
                    unit=instrument.unit,
                    description=instrument.description,
                )
            self.instruments[instrument.name] = made

    @property
    def receiving(self) -> bool:
        """Whether an SDK's meter provider is set: until then the API drops measurements."""
        return meter_provider_set()

    def add(self, instrument: Instrument, amount: float, labels: Mapping[str, str]) -> None:
        self.instruments[instrument.name].add(amount, labels)

    def record(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
        self.instruments[instrument.name].record(value, labels)

    def set(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
        with self.lock:
            self.census[instrument.name][frozenset(labels.items())] = (value, time.monotonic())

    def observe(self, name: str, options: Any) -> list[Any]:
        """The gauge's values from this process's census, while it is recent."""
        from opentelemetry.metrics import Observation

        oldest = time.monotonic() - CENSUS_REPORTED_FOR
        with self.lock:
            values = self.census[name]
            for labels in [labels for labels, (_, at) in values.items() if at < oldest]:
                del values[labels]
            return [Observation(value, dict(labels)) for labels, (value, _) in values.items()]

    def __repr__(self) -> str:
        return "OpenTelemetrySink()"


def opentelemetry_sink() -> OpenTelemetrySink | None:
    """The sink, or None when the OpenTelemetry API is not installed."""
    try:
        from opentelemetry import metrics
    except ImportError:
        return None
    return OpenTelemetrySink(metrics.get_meter("django_idempotency", __version__))
