"""Metrics: what the protection did, counted, timed and sent to the configured sinks.

``IDEMPOTENCY["METRICS"]`` names the sinks: ``"opentelemetry"`` (the
default: the OpenTelemetry API, a no-op until the project configures an
SDK, and when the API is not installed) and ``"prometheus"``
(``prometheus_client``, across gunicorn's workers in its multiprocess
mode). ``django_idempotency.metrics.INSTRUMENTS`` is the catalogue both build
from; docs/observability.md lists it with what to watch.

Where the figures come from:

- per request, from ``protect()``: one ``requests`` count with its outcome,
  and the protection's own time (the view's time taken out);
- per event, from ``signals.notify``: releases, UNCERTAIN outcomes,
  records recovery could not reconcile;
- per run, from recovery and the purge;
- the gauges, from ``census.take_census``, taken by ONE process (the
  beat-driven ``observe_records`` task): read by every worker they would
  multiply the queries, and each worker would report its own stale copy.

Labels are bounded: ``operation`` (at most ``METRICS_OPERATIONS`` distinct
values per process, the rest are "other"), ``outcome``, ``reason``,
``state``, ``database``, and ``tenant`` only with ``METRICS_TENANT``.
Keys are never labels. A failing sink is logged and never fails a request.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from django.core.signals import setting_changed

from django_idempotency.conf import idempotency_settings
from django_idempotency.metrics import (
    CENSUS_TIMESTAMP,
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
    from django.dispatch import Signal
    from django.http import HttpRequest, HttpResponseBase

    from django_idempotency.census import Census
    from django_idempotency.recovery import RecoveryReport
    from django_idempotency.scope import Scope

# The rest (the recording functions) is the package's own plumbing.

logger = logging.getLogger("django_idempotency")


class Sink(Protocol):
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


def _send(method: str, instrument: Instrument, value: float, labels: Mapping[str, str]) -> None:
    for sink in sinks():
        try:
            getattr(sink, method)(instrument, value, labels)
        except Exception:  # a metrics backend must never fail the request
            logger.exception("Metrics sink %r failed on %s.", sink, instrument.name)


_seen_operations: set[str] = set()


def _operation_label(operation: str) -> str:
    """``operation``, or "other" once the process labelled ``METRICS_OPERATIONS`` others."""
    if operation in _seen_operations:
        return operation
    if len(_seen_operations) >= idempotency_settings.METRICS_OPERATIONS:
        return "other"
    _seen_operations.add(operation)
    return operation


class RequestObservation:
    """One protected request's outcome and timing, counted once it is answered."""

    __slots__ = ("operation", "outcome", "scope", "started", "view_ran", "view_seconds")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.view_seconds = 0.0
        self.view_ran = False
        self.outcome: str | None = None
        #: The request's scope, once it has one.
        self.scope: Scope | None = None
        #: The operation of a request refused before it had a scope.
        self.operation: str | None = None

    def timed(self, view: Callable[[], HttpResponseBase]) -> Callable[[], HttpResponseBase]:
        """``view``, its time added up so that it can be taken out of the protection's."""

        def run() -> HttpResponseBase:
            self.view_ran = True
            started = time.perf_counter()
            try:
                return view()
            finally:
                self.view_seconds += time.perf_counter() - started

        return run

    def refused(self, refusal: Exception) -> None:
        """The request was answered with ``refusal``: that answer is its outcome."""
        self.outcome = _REFUSALS.get(getattr(refusal, "default_code", ""), "rejected")

    def finish(self) -> None:
        """Count the request: its outcome and its time."""
        elapsed = time.perf_counter() - self.started - self.view_seconds
        scope = self.scope
        operation = scope.operation if scope is not None else self.operation
        if operation is None:
            return  # not a protected request after all (a GET, a key-less call)
        # No outcome: an exception that is no refusal ended the request (the
        # view's own, or a bug before it ran).
        outcome = self.outcome or ("executed" if self.view_ran else "error")
        labels = {"operation": _operation_label(operation), "outcome": outcome}
        _send("record", PROTECTION_DURATION, elapsed, labels)
        if idempotency_settings.METRICS_TENANT and scope is not None:
            labels = {**labels, "tenant": scope.tenant}
        _send("add", REQUESTS, 1, labels)


#: Refusals by their code; any other (no key, a key too long, a body too
#: large or unreadable) is refused input, "rejected".
_REFUSALS = {
    "idempotency_key_reused": "key_reused",
    "idempotency_key_expired": "key_expired",
    "idempotency_request_in_progress": "in_flight",
    "idempotency_store_unavailable": "store_unavailable",
    "idempotency_outcome_uncertain": "outcome_uncertain",
}

#: Release reasons as labels; any other is "other".
_RELEASE_REASONS = {
    "exception": "exception",
    "recovery": "recovery",
    "reconciled": "reconciled",
    "store unavailable": "store_unavailable",
}

_OBSERVATION = "_idempotency_observation"


def observe_request(request: HttpRequest) -> RequestObservation | None:
    """Start observing ``request`` (None when no sink is configured: nothing to do)."""
    if not sinks():
        return None
    observation = RequestObservation()
    setattr(request, _OBSERVATION, observation)
    return observation


def _outcome_of(name: str, kwargs: Mapping[str, Any]) -> str | None:
    if name == "request_claimed" or name == "response_stored":
        return "executed"
    if name == "response_replayed":
        return "replayed"
    if name == "key_reused":
        return "key_reused"
    if name == "key_expired":
        return "key_expired"
    if name == "request_in_flight":
        return "in_flight"
    if name == "store_unavailable":
        return "unprotected" if kwargs.get("fail_open") else "store_unavailable"
    return None


def note(
    signal: Signal, request: HttpRequest | None, scope: Scope, kwargs: Mapping[str, Any]
) -> None:
    """Count what ``signal`` reports (called by ``signals.notify`` when metrics are on)."""
    name = _signal_names().get(id(signal))
    if name is None:
        return
    observation = getattr(request, _OBSERVATION, None) if request is not None else None
    if observation is not None:
        outcome = _outcome_of(name, kwargs)
        # A claim counts as executed once: the stored response (or a
        # release) that follows does not change it; a replay, a refusal or a
        # lost lease after it does (the optimistic mode's losers, say).
        if outcome is not None and not (outcome == "executed" and observation.outcome):
            observation.outcome = outcome
        elif name == "claim_released" and observation.outcome is None:
            observation.outcome = "executed"  # the optimistic mode runs the view unclaimed
    if name == "claim_released":
        reason = kwargs.get("reason")
        label = "status" if isinstance(reason, int) else _RELEASE_REASONS.get(str(reason), "other")
        _send("add", RELEASES, 1, {"operation": _operation_label(scope.operation), "reason": label})
    elif name == "record_uncertain":
        _send("add", UNCERTAIN, 1, {"operation": _operation_label(scope.operation)})
    elif name == "record_unreconciled":
        _send("add", UNRECONCILED, 1, {"operation": _operation_label(scope.operation)})


@functools.cache
def _signal_names() -> dict[int, str]:
    from django_idempotency import signals

    return {id(getattr(signals, name)): name for name in signals.__all__ if name != "notify"}


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


def _forget(*, setting: str, **kwargs: Any) -> None:
    if setting == "IDEMPOTENCY":
        _seen_operations.clear()


setting_changed.connect(_forget, dispatch_uid="django_idempotency._observability.recording")
