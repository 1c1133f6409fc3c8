"""Settling records whose owner is gone: reconcilers and the recovery run.

A reconciler is registered per operation and, given a stuck record, asks
the outside world what happened (a payment provider, by the record's
``provider_key``) and returns an outcome::

    from django_idempotency.recovery import Completed, Failed, Release, Retry, register_reconciler

    @register_reconciler("POST v1/payments")
    def settle_payment(record):
        charge = provider.find(idempotency_key=record.provider_key)
        if charge is None:
            return Release()           # never charged: the client's retry may run it
        if charge.pending:
            return Retry(after=60)     # ask again in a minute
        payment, _ = Payment.objects.get_or_create(...)   # commits with the outcome
        # The bytes the view answers: its serializer, rendered as DRF renders it.
        body = JSONRenderer().render(PaymentSerializer(payment).data)
        return Completed(status=201, body=body, headers={"Content-Type": "application/json"})

The reconciler runs inside a transaction that also stores its outcome, so
its own writes and the outcome commit together, as a view's do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeAlias

from django.db import transaction
from django.utils import timezone

from django_idempotency import signals, store
from django_idempotency.clock import ahead
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import Outcome, StoredResponse

logger = logging.getLogger("django_idempotency")
State = IdempotencyRecord.State

#: How long recovery leaves a record alone after a reconciler failed or
#: when no reconciler is registered, so it is not retried (and logged) on
#: every run.
DEFAULT_BACKOFF = timedelta(minutes=5)


@dataclass(frozen=True)
class _Answer:
    """A response to store and replay: status, body and headers."""

    status: int
    body: Any = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    def stored(self) -> StoredResponse:
        headers = dict(self.headers)
        if isinstance(self.body, bytes):
            body = self.body
        elif isinstance(self.body, str):
            body = self.body.encode("utf-8")
            headers.setdefault("Content-Type", "text/plain; charset=utf-8")
        else:
            body = json.dumps(self.body, separators=(",", ":")).encode("utf-8")
            headers.setdefault("Content-Type", "application/json")
        return StoredResponse(self.status, [[name, value] for name, value in headers.items()], body)


@dataclass(frozen=True)
class Completed(_Answer):
    """The operation happened: store this response (2xx) as COMPLETED."""

    status: int = 200


@dataclass(frozen=True)
class Failed(_Answer):
    """The operation definitively failed: store this response as FAILED."""

    status: int = 409


@dataclass(frozen=True)
class Retry:
    """Not known yet: ask again after ``after`` (seconds or a timedelta)."""

    after: timedelta | float = 60


@dataclass(frozen=True)
class Release:
    """The external call never happened: release the claim so a retry runs it."""


ReconcilerOutcome: TypeAlias = Completed | Failed | Retry | Release
Reconciler: TypeAlias = Callable[[IdempotencyRecord], ReconcilerOutcome]

_reconcilers: dict[str, Reconciler] = {}


def register_reconciler(operation: str) -> Callable[[Reconciler], Reconciler]:
    """Register the decorated function as the reconciler of ``operation``.

    ``operation`` is the record's operation name, as ``@idempotent`` gave it:
    ``"POST v1/payments"`` by default, or your ``operation=`` argument.
    """

    def register(reconciler: Reconciler) -> Reconciler:
        previous = _reconcilers.get(operation)
        if previous is not None and previous is not reconciler:
            raise ValueError(f"A reconciler for {operation!r} is already registered: {previous!r}")
        _reconcilers[operation] = reconciler
        return reconciler

    return register


def reconciler_for(operation: str) -> Reconciler | None:
    return _reconcilers.get(operation)


@dataclass
class RecoveryReport:
    """What one recovery run did, by outcome."""

    released: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    unreconciled: int = 0
    stale: int = 0

    @property
    def handled(self) -> int:
        return self.released + self.completed + self.failed + self.retried + self.unreconciled


def stale_records(*, limit: int) -> list[IdempotencyRecord]:
    """Unresolved records whose lease ran out (what a run would take), read-only."""
    database = idempotency_settings.DATABASE
    return list(
        IdempotencyRecord.objects.using(database)
        .filter(state__in=store.UNRESOLVED_STATES, lease_expires_at__lte=timezone.now())
        .order_by("lease_expires_at")[:limit]
    )


def recover_stale_records(*, batch_size: int = 100) -> RecoveryReport:
    """Take over and settle up to ``batch_size`` stale records, one at a time.

    CLAIMED records are released: their owner began no external call, and
    its local work rolled back with it. IN_PROGRESS and UNCERTAIN records
    go to their operation's reconciler; without one they stay UNCERTAIN,
    reported by a log line and the ``record_unreconciled`` signal. Nothing
    unresolved is ever deleted except by a reconciler's ``Release()``.

    Each record is taken (with a fresh lease) just before it is settled; a
    reconciler should finish within ``IDEMPOTENCY["LEASE"]``, or another
    worker may take the record over and ask again (reconcilers look the
    outcome up, so asking twice is harmless; the fencing token keeps the
    slower answer from being stored).
    """
    conf = idempotency_settings
    report = RecoveryReport()
    for _ in range(batch_size):
        taken = store.take_over_next_stale(lease=conf.LEASE, using=conf.DATABASE)
        if taken is None:
            break
        try:
            settle(*taken, report)
        except StaleOwner:
            report.stale += 1
    return report


def settle(record: IdempotencyRecord, held: store.Claim, report: RecoveryReport) -> None:
    if record.state == State.CLAIMED:
        if store.release(held):
            report.released += 1
            signals.notify(signals.claim_released, None, held.scope, reason="recovery")
        return
    reconciler = reconciler_for(record.operation)
    if reconciler is None:
        store.postpone(held, ahead(DEFAULT_BACKOFF))
        report.unreconciled += 1
        logger.error(
            "No reconciler for %r: record %s (%s) stays UNCERTAIN until an operator "
            "resolves it. Register one with @register_reconciler(%r).",
            record.operation,
            record.pk,
            held.scope,
            record.operation,
        )
        signals.notify(signals.record_unreconciled, None, held.scope, record=record)
        return
    try:
        with transaction.atomic(using=held.database):
            outcome = reconciler(record)
            if not isinstance(outcome, (Completed, Failed, Retry, Release)):
                raise TypeError(
                    f"The reconciler of {record.operation!r} returned {outcome!r}; it must "
                    "return Completed, Failed, Retry or Release."
                )
            if isinstance(outcome, (Completed, Failed)):
                state = Outcome.COMPLETED if isinstance(outcome, Completed) else Outcome.FAILED
                store.complete(held, state, outcome.stored(), ttl=idempotency_settings.TTL)
            else:
                # Nothing the reconciler wrote may outlive an unsettled record.
                transaction.set_rollback(True, using=held.database)
    except StaleOwner:
        raise
    except Exception:
        logger.exception("The reconciler of %r failed on record %s", record.operation, record.pk)
        store.postpone(held, ahead(DEFAULT_BACKOFF))
        report.retried += 1
        return
    if isinstance(outcome, Completed):
        report.completed += 1
    elif isinstance(outcome, Failed):
        report.failed += 1
    elif isinstance(outcome, Release):
        if store.release(held, states=store.UNRESOLVED_STATES):
            report.released += 1
            signals.notify(signals.claim_released, None, held.scope, reason="reconciled")
        else:
            report.stale += 1
    else:
        store.postpone(held, ahead(as_timedelta(outcome.after)))
        report.retried += 1
