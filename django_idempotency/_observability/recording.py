"""Metrics: what the protection did, counted, timed and sent to the configured sinks.

``IDEMPOTENCY["METRICS"]`` names the sinks: ``"opentelemetry"`` (the
default: the OpenTelemetry API, a no-op until the project configures an
SDK, and when the API is not installed) and ``"prometheus"``
(``prometheus_client``, across gunicorn's workers in its multiprocess
mode). ``django_idempotency.metrics.INSTRUMENTS`` is the catalogue both build
from; docs/observability.md lists it with what to watch.

Where the figures come from:

- per request, from the request's outcome (``_protection.outcome``),
  counted once it is answered: one ``requests`` count with its outcome,
  the protection's own time (the view's time taken out), and the release
  or the UNCERTAIN record it left, if any; and, from the middleware, the
  unsafe requests it let run without a key (report-only);
- per event, from recovery: releases, records it could not reconcile;
- per run, from recovery and the purge;
- the gauges, from ``census.take_census``, taken by ONE process (the
  beat-driven ``observe_records`` task): read by every worker they would
  multiply the queries, and each worker would report its own stale copy.

Labels are bounded: ``operation`` (the names the code declares, the same in
every process; any other is "other": ``labels``), ``outcome``, ``reason``,
``state``, ``database``, and ``tenant`` only with ``METRICS_TENANT``.
Keys are never labels. A failing sink is logged and never fails a request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from django_idempotency._observability.labels import operation_label
from django_idempotency.conf import idempotency_settings
from django_idempotency.metrics import (
    CENSUS_TIMESTAMP,
    KEYLESS_REQUESTS,
    OLDEST_UNRESOLVED_AGE,
    PROTECTION_DURATION,
    PURGE_BACKLOG,
    PURGED,
    RECORDS,
    RECOVERY,
    RELEASES,
    REQUESTS,
    UNCERTAIN,
    UNRECONCILED,
    UNRECONCILED_OPERATIONS,
    Instrument,
)

if TYPE_CHECKING:
    from django_idempotency.census import Census
    from django_idempotency.recovery import RecoveryReport

# The rest (the recording functions) is the package's own plumbing.

logger = logging.getLogger("django_idempotency")


class Sink(Protocol):
    @property
    def receiving(self) -> bool:
        """Whether what is counted now reaches anything (a backend, an SDK)."""
        ...

    def add(self, instrument: Instrument, amount: float, labels: Mapping[str, str]) -> None: ...

    def record(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None: ...

    def set(self, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None: ...


_made_sinks: dict[tuple[str, ...], tuple[Sink, ...]] = {}
_making_sinks = threading.Lock()


def sinks() -> tuple[Sink, ...]:
    """The configured sinks; () when metrics are off (or no sink could be made)."""
    names = idempotency_settings.METRICS
    try:
        return _made_sinks[names]
    except KeyError:
        pass
    # Made once per process, under a lock: two threads of a gthread worker
    # registering the same Prometheus names at once would collide.
    with _making_sinks:
        if names not in _made_sinks:
            _made_sinks[names] = tuple(_made(names))
    return _made_sinks[names]


def _made(names: tuple[str, ...]) -> Iterator[Sink]:
    """Each named sink that can be made; one that cannot is logged once and left out.

    A sink that cannot be made (an older OpenTelemetry API, a project that
    registered one of these Prometheus names itself) must not fail the
    requests it would have counted.
    """
    for name in names:
        try:
            if name == "opentelemetry":
                from django_idempotency._observability.opentelemetry import opentelemetry_sink

                sink: Sink | None = opentelemetry_sink()
            elif name == "prometheus":
                from django_idempotency._observability.prometheus import prometheus_sink

                sink = prometheus_sink()
            else:
                sink = None  # check E037 names it
        except Exception:
            logger.exception("The %r metrics sink could not be made; it is left out.", name)
            continue
        if sink is not None:
            yield sink


def receiving() -> bool:
    """Whether a request's counts would reach anything: a sink whose backend is there.

    The OpenTelemetry sink's instruments drop what they are given until the
    project sets an SDK's meter provider: counting each request for them
    would be work for an observer nobody registered.
    """
    # A sink that does not say so receives.
    return any(getattr(sink, "receiving", True) for sink in sinks())


def reuse_files_across_runs(command: str) -> None:
    """Have the Prometheus sink write ``command``'s files, not this run's: see
    ``_observability.prometheus.write_to_files_named``. For the commands cron
    runs again and again; a no-op without the sink or its directory.
    """
    if "prometheus" not in idempotency_settings.METRICS:
        return
    try:
        from django_idempotency._observability.prometheus import write_to_files_named

        write_to_files_named(command)
    except Exception:  # the metrics must never stop the command's work
        logger.exception("The Prometheus files of %r could not be set up.", command)


def _send(method: str, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
    for sink in sinks():
        try:
            getattr(sink, method)(instrument, value, labels)
        except Exception:  # a metrics backend must never fail the request
            logger.exception("Metrics sink %r failed on %s.", sink, instrument.name)


#: Release reasons as labels; any other is "other".
_RELEASE_REASONS = {
    "exception": "exception",
    "recovery": "recovery",
    "reconciled": "reconciled",
    "store unavailable": "store_unavailable",
}


def count_request(
    operation: str, outcome: str, seconds: float, *, tenant: str | None, from_code: bool
) -> None:
    """Count one answered request: its ``outcome`` label and the protection's own time.

    ``from_code``: the operation's name is the route's or a literal one
    (``labels.operation_label``).
    """
    labels = {"operation": operation_label(operation, from_code=from_code), "outcome": outcome}
    _send("record", PROTECTION_DURATION, seconds, labels)
    if idempotency_settings.METRICS_TENANT and tenant is not None:
        labels = {**labels, "tenant": tenant}
    _send("add", REQUESTS, 1, labels)


def release_label(reason: object) -> str:
    """The ``reason`` label of a release: a status code is "status"."""
    return "status" if isinstance(reason, int) else _RELEASE_REASONS.get(str(reason), "other")


def count_release(operation: str, reason: object, *, from_code: bool = False) -> None:
    """Count a claim given up so that a retry runs."""
    label = operation_label(operation, from_code=from_code)
    _send("add", RELEASES, 1, {"operation": label, "reason": release_label(reason)})


def count_keyless(operation: str, *, from_code: bool) -> None:
    """Count an unsafe request the middleware let run without a key (report-only)."""
    label = operation_label(operation, from_code=from_code)
    _send("add", KEYLESS_REQUESTS, 1, {"operation": label})


def count_uncertain(operation: str, *, from_code: bool = False) -> None:
    """Count a record left UNCERTAIN for a reconciler."""
    _send("add", UNCERTAIN, 1, {"operation": operation_label(operation, from_code=from_code)})


def count_unreconciled(operation: str) -> None:
    """Count a record recovery found no reconciler for."""
    _send("add", UNRECONCILED, 1, {"operation": operation_label(operation)})


def count_recovery(report: RecoveryReport) -> None:
    """Count one recovery run's outcomes."""
    if not sinks():
        return
    for outcome in (
        "released",
        "handed_back",
        "completed",
        "failed",
        "retried",
        "unreconciled",
        "stale",
    ):
        amount = getattr(report, outcome)
        if amount:
            _send("add", RECOVERY, amount, {"outcome": outcome})


def count_purged(database: str, *, deleted: int, tombstoned: int) -> None:
    """Count what one purge batch did on ``database``."""
    if not sinks():
        return
    if deleted:
        _send("add", PURGED, deleted, {"database": database, "action": "deleted"})
    if tombstoned:
        _send("add", PURGED, tombstoned, {"database": database, "action": "tombstoned"})


def publish_census(census: Census) -> None:
    """Set the gauges from ``census`` (what the ``observe_records`` task does)."""
    from django_idempotency.models import UNRESOLVED_STATES

    database = census.database
    for state, count in census.counts.items():
        _send("set", RECORDS, count, {"database": database, "state": str(state)})
    for state in UNRESOLVED_STATES:
        age = census.age(state)
        seconds = 0.0 if age is None else age.total_seconds()
        labels = {"database": database, "state": str(state)}  # the value, not the enum
        _send("set", OLDEST_UNRESOLVED_AGE, seconds, labels)
    _send("set", PURGE_BACKLOG, census.purge_backlog, {"database": database})
    _send(
        "set",
        UNRECONCILED_OPERATIONS,
        len(census.unreconciled_operations),
        {"database": database},
    )
    _send("set", CENSUS_TIMESTAMP, census.taken_at.timestamp(), {"database": database})
