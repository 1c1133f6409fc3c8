"""The metrics the package records: names, kinds, units and labels.

The names and labels are public (they are what dashboards and alert rules
query); where the figures come from and how labels stay bounded is in
docs/observability.md. ``IDEMPOTENCY["METRICS"]`` chooses the sinks; the
view Prometheus scrapes is ``django_idempotency.prometheus.metrics_view``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DURATION_BUCKETS", "INSTRUMENTS", "Instrument"]


@dataclass(frozen=True)
class Instrument:
    """One metric: its OpenTelemetry name and its Prometheus name.

    The Prometheus name, the one queries use, is what an OpenTelemetry
    collector's Prometheus exporter makes of the OpenTelemetry one (dots to
    underscores, ``_total`` after a counter, ``_seconds`` for the unit
    "s"), so alert rules and dashboards work with either sink.
    """

    name: str
    prometheus_name: str
    kind: Literal["counter", "histogram", "gauge"]
    unit: str
    description: str
    labels: tuple[str, ...]


REQUESTS = Instrument(
    "idempotency.requests",
    "idempotency_requests_total",
    "counter",
    "{request}",
    "Protected requests by outcome: executed, replayed, key_reused, key_expired, "
    "in_flight, store_unavailable, outcome_uncertain, unprotected, rejected, error.",
    ("operation", "outcome", "tenant"),
)
PROTECTION_DURATION = Instrument(
    "idempotency.protection.duration",
    "idempotency_protection_duration_seconds",
    "histogram",
    "s",
    "Time a protected request spent in the protection itself, the view's time taken out.",
    ("operation", "outcome"),
)
KEYLESS_REQUESTS = Instrument(
    "idempotency.keyless_requests",
    "idempotency_keyless_requests_total",
    "counter",
    "{request}",
    "Unsafe requests without a key that IdempotencyMiddleware let run unprotected "
    '(MIDDLEWARE_KEYS = "report"): the clients still to move to keys, by operation.',
    ("operation",),
)
RELEASES = Instrument(
    "idempotency.releases",
    "idempotency_releases_total",
    "counter",
    "{record}",
    "Claims given up so that a retry runs: exception, status, store_unavailable, recovery, "
    "reconciled.",
    ("operation", "reason"),
)
UNCERTAIN = Instrument(
    "idempotency.uncertain",
    "idempotency_uncertain_total",
    "counter",
    "{record}",
    "Records that became UNCERTAIN: a view failed after begin_external().",
    ("operation",),
)
UNRECONCILED = Instrument(
    "idempotency.unreconciled",
    "idempotency_unreconciled_total",
    "counter",
    "{record}",
    "Unresolved records recovery left as they were: their operation has no reconciler.",
    ("operation",),
)
RECOVERY = Instrument(
    "idempotency.recovery",
    "idempotency_recovery_total",
    "counter",
    "{record}",
    "Records recovery handled, by outcome: released, handed_back, completed, failed, "
    "retried, unreconciled, stale.",
    ("outcome",),
)
PURGED = Instrument(
    "idempotency.purged",
    "idempotency_purged_total",
    "counter",
    "{record}",
    "Records the purge deleted or made tombstones of.",
    ("database", "action"),
)
RECORDS = Instrument(
    "idempotency.records",
    "idempotency_records",
    "gauge",
    "{record}",
    "Records per state; COMPLETED and FAILED are the planner's estimates past 200,000.",
    ("database", "state"),
)
OLDEST_UNRESOLVED_AGE = Instrument(
    "idempotency.oldest_unresolved.age",
    "idempotency_oldest_unresolved_age_seconds",
    "gauge",
    "s",
    "Age of the oldest record in each unresolved state; 0 when there is none.",
    ("database", "state"),
)
PURGE_BACKLOG = Instrument(
    "idempotency.purge.backlog",
    "idempotency_purge_backlog",
    "gauge",
    "{record}",
    "Resolved records past retention not yet purged, counted up to 100,000.",
    ("database",),
)
UNRECONCILED_OPERATIONS = Instrument(
    "idempotency.unreconciled_operations",
    "idempotency_unreconciled_operations",
    "gauge",
    "{operation}",
    "Operations with IN_PROGRESS or UNCERTAIN records and no reconciler.",
    ("database",),
)
CENSUS_TIMESTAMP = Instrument(
    "idempotency.census.timestamp",
    "idempotency_census_timestamp_seconds",
    "gauge",
    "s",
    "When the gauges were last taken (Unix time, the database's clock).",
    ("database",),
)

INSTRUMENTS = (
    REQUESTS,
    PROTECTION_DURATION,
    KEYLESS_REQUESTS,
    RELEASES,
    UNCERTAIN,
    UNRECONCILED,
    RECOVERY,
    PURGED,
    RECORDS,
    OLDEST_UNRESOLVED_AGE,
    PURGE_BACKLOG,
    UNRECONCILED_OPERATIONS,
    CENSUS_TIMESTAMP,
)
"""Every metric the package records, with its OpenTelemetry and Prometheus names."""

#: Buckets of the duration histogram (seconds): a claim and a completion
#: take about a millisecond; the "wait" mode and a busy database, seconds.
DURATION_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""The duration histogram's bucket bounds, in seconds."""
