"""Settling records whose owner is gone: reconcilers and the recovery run.

A reconciler is registered per operation and, given a stuck record, asks
the outside world what happened (a payment provider, by the record's
``provider_key``) and returns an outcome:

```python
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
```

The reconciler runs inside a transaction that also stores its outcome, so
its own writes and the outcome commit together, as a view's do.

An operation of several calls (``begin_external(step=...)``) shows its
steps to the reconciler: ``record.steps.all()``, in the order they were
begun, each with its ``name``, ``provider_key`` and
``provider_operation_id``. Besides settling the whole operation, the
reconciler may then hand it back to the client's retry from one step
(``RetryFrom``): the steps before it are kept, and the re-run view skips
them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeAlias

from django.db import transaction
from django.db.models import Count, Min

from django_idempotency import _store as store
from django_idempotency import signals
from django_idempotency._observability import labels
from django_idempotency._observability import recording as metrics
from django_idempotency._store.database_time import DatabaseNow, time_left
from django_idempotency._store.routing import records_database_named, sweep
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse, Verdict

__all__ = [
    "DEFAULT_BACKOFF",
    "Completed",
    "Failed",
    "Reconciler",
    "ReconcilerOutcome",
    "RecoveryReport",
    "Release",
    "Retry",
    "RetryFrom",
    "leased_records",
    "reconciler_for",
    "recover_stale_records",
    "register_reconciler",
    "registered_operations",
    "settle",
    "stale_records",
]

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
    provider_operation_id: str = ""

    def stored_response(self) -> StoredResponse:
        """What is stored and replayed for this answer."""
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
    """The operation happened: store this response (a status below 400) as COMPLETED.

    Args:
        status: The HTTP status replayed to the client's retries.
        body: ``bytes`` are stored as they are; a ``str`` is encoded as UTF-8
            with a default ``Content-Type: text/plain; charset=utf-8``;
            anything else is JSON-encoded (compact) with a default
            ``Content-Type: application/json``.
        headers: Response headers to store and replay; a ``Content-Type``
            given here wins over the default.
        provider_operation_id: The provider's id of the operation the
            reconciler found (a charge id), stored on the record as
            ``set_provider_operation()`` would have, so that the admin's
            search finds the record by it; ``""`` leaves the column as it is.
    """

    status: int = 200


@dataclass(frozen=True)
class Failed(_Answer):
    """The operation definitively failed: store this response (4xx) as FAILED.

    Args:
        status: The HTTP status replayed to the client's retries.
        body: ``bytes`` are stored as they are; a ``str`` is encoded as UTF-8
            with a default ``Content-Type: text/plain; charset=utf-8``;
            anything else is JSON-encoded (compact) with a default
            ``Content-Type: application/json``.
        headers: Response headers to store and replay; a ``Content-Type``
            given here wins over the default.
        provider_operation_id: The provider's id of what the reconciler
            found (a declined charge, a voided authorization), stored on the
            record; ``""`` leaves the column as it is.
    """

    status: int = 409


@dataclass(frozen=True)
class Retry:
    """Not known yet: leave the record UNCERTAIN and ask again later.

    Args:
        after: How long until the reconciler is asked again, in seconds or as
            a ``timedelta``.
    """

    after: timedelta | float = 60


@dataclass(frozen=True)
class Release:
    """The external call never happened: delete the record so the client's retry runs the view."""


@dataclass(frozen=True)
class RetryFrom:
    """Hand the operation back to the client's retry, to run again from ``step``.

    For an operation of several calls (``begin_external(step=...)``) that
    stopped part way: the steps begun before ``step`` are kept, ``step``
    and the steps begun after it are forgotten (their rows deleted), and
    the record is handed back: CLAIMED, with no lease owner, and a lease
    that ends with its retention (``expires_at``). The client's retry, with
    the same key and the same input, takes it over at once and runs the
    view, which finds the kept steps (``request.idempotency.step(name)``)
    and skips them; a forgotten step is begun again under the same,
    derived provider key. A retry with another input is refused as for any
    record of that key. If no retry comes before the record's retention
    ends, recovery asks the reconciler again; a ``RetryFrom`` is then
    taken as ``Retry(after=DEFAULT_BACKOFF)``, leaving the record UNCERTAIN
    for an operator or a reconciler that settles it.

    Only for a call that did not happen (or that the provider will never
    complete, such as an expired authorization's capture): the view runs it
    again. The reconciler's own writes are rolled back, as after ``Retry``.

    Args:
        step: The first step to run again. A name the record has no row
            for (the view died before beginning it) keeps every stored step.
        provider_operation_ids: Provider ids the reconciler found for kept
            steps whose id was never recorded (the view died between the
            provider's answer and ``set_provider_operation()``), by step
            name; stored on the steps, so that the re-run view skips them.

    Raises:
        ValueError: (At settle time, handled like any reconciler error:
            logged, asked again in five minutes.) ``provider_operation_ids``
            names a step that is not kept.
    """

    step: str
    provider_operation_ids: Mapping[str, str] = field(default_factory=dict)


ReconcilerOutcome: TypeAlias = Completed | Failed | Retry | Release | RetryFrom
"""What a reconciler returns: ``Completed``, ``Failed``, ``Retry``, ``Release`` or ``RetryFrom``."""

Reconciler: TypeAlias = Callable[[IdempotencyRecord], ReconcilerOutcome]
"""A reconciler: takes the stuck record, returns a ``ReconcilerOutcome``."""

_reconcilers: dict[str, Reconciler] = {}


def register_reconciler(operation: str) -> Callable[[Reconciler], Reconciler]:
    """Register the decorated function as the reconciler of ``operation``.

    The function takes the stuck ``IdempotencyRecord`` and returns
    ``Completed``, ``Failed``, ``Retry``, ``Release`` or ``RetryFrom``. The
    record's steps are loaded with it, in the order they were begun
    (``record.steps.all()``). It runs inside a transaction on the record's
    database (``record._state.db``) that also stores a ``Completed`` or
    ``Failed``; after ``Retry``, ``Release`` or ``RetryFrom``, or when it
    raises, its writes are rolled back. Anything else returned raises
    ``TypeError``, handled like any exception the reconciler raises: logged,
    and the record is asked about again in five minutes.

    Args:
        operation: The record's operation name, as ``@idempotent`` gave it:
            ``"POST v1/payments"`` by default (as ``IDEMPOTENCY["OPERATION_NAMES"]``
            writes it), or your ``operation=`` argument (``"task
            <module>.<qualname>"`` for ``idempotent_task``). ``manage.py
            check`` warns about a name no protected view has (W004, W005).

    Returns:
        A decorator registering the function and returning it unchanged.

    Raises:
        ValueError: Another function is already registered for ``operation``.
    """

    def register(reconciler: Reconciler) -> Reconciler:
        previous = _reconcilers.get(operation)
        if previous is not None and previous is not reconciler:
            raise ValueError(f"A reconciler for {operation!r} is already registered: {previous!r}")
        _reconcilers[operation] = reconciler
        labels.declare(operation)  # its records' metrics are labelled with it
        return reconciler

    return register


def reconciler_for(operation: str) -> Reconciler | None:
    """The reconciler registered for ``operation``, or ``None``."""
    return _reconcilers.get(operation)


def registered_operations() -> list[str]:
    """The operation names that have a reconciler, sorted (for the system checks)."""
    return sorted(_reconcilers)


@dataclass
class RecoveryReport:
    """What one recovery run did, by outcome.

    Attributes:
        released: CLAIMED records released, and records a reconciler released.
        completed: Records a reconciler settled with ``Completed``.
        failed: Records a reconciler settled with ``Failed``.
        retried: Records left for later: ``Retry``, or a reconciler that raised.
        unreconciled: Records left UNCERTAIN for want of a reconciler.
        stale: Records taken over by someone else meanwhile.
        handed_back: Records a reconciler handed back to the client's retry
            (``RetryFrom``).
    """

    released: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    unreconciled: int = 0
    stale: int = 0
    #: Last, so that positional construction keeps its meaning.
    handed_back: int = 0

    @property
    def handled(self) -> int:
        """Records this run settled or postponed: every count but ``stale``."""
        return (
            self.released
            + self.handed_back
            + self.completed
            + self.failed
            + self.retried
            + self.unreconciled
        )


def stale_records(*, limit: int, database: str | None = None) -> list[IdempotencyRecord]:
    """Unresolved records whose lease ran out (what a run would take), read-only.

    Used by ``idempotency_recover --dry-run``. Each record's
    ``_state.db`` names the database it was read from.

    Args:
        limit: At most this many records from each database, the longest
            expired first.
        database: Only this records database; ``None``: all of them.
    """
    found: list[IdempotencyRecord] = []
    for alias in records_database_named(database):
        found.extend(
            IdempotencyRecord.objects.using(alias)
            .filter(state__in=store.UNRESOLVED_STATES, lease_expires_at__lte=DatabaseNow())
            .order_by("lease_expires_at")[:limit]
        )
    return found


def leased_records(*, database: str | None = None) -> tuple[int, datetime | None]:
    """Unresolved records a run would skip, their lease still running, read-only.

    How many, and when the first of those leases ends: their owner is at
    work, or a run postponed them (no reconciler, ``Retry``, a reconciler
    that raised). Over every records database, or only ``database``.
    """
    count, first_end = 0, None
    for alias in records_database_named(database):
        found = (
            IdempotencyRecord.objects.using(alias)
            .filter(state__in=store.UNRESOLVED_STATES, lease_expires_at__gt=DatabaseNow())
            .aggregate(count=Count("pk"), first_end=Min("lease_expires_at"))
        )
        count += found["count"]
        if found["first_end"] is not None and (first_end is None or found["first_end"] < first_end):
            first_end = found["first_end"]
    return count, first_end


def recover_stale_records(*, batch_size: int = 100, database: str | None = None) -> RecoveryReport:
    """Take over and settle up to ``batch_size`` stale records, one at a time.

    What the ``recover_stale_records`` Celery task and the
    ``idempotency_recover`` command run.

    CLAIMED records are released: their owner began no external call, and
    its local work rolled back with it; except those with steps, which a
    reconciler handed back (``RetryFrom``) and the client did not take
    within the record's retention (or whose retry died before its first
    ``begin_external()``): their kept steps did call providers. Those, and
    IN_PROGRESS and UNCERTAIN records, go to their operation's reconciler;
    without one they stay UNCERTAIN, reported by a log line and the
    ``record_unreconciled`` signal. Nothing unresolved is ever deleted
    except by a reconciler's ``Release()``.

    Each record is taken (with a fresh lease) just before it is settled; a
    reconciler should finish within ``IDEMPOTENCY["LEASE"]``, or another
    worker may take the record over and ask again (reconcilers look the
    outcome up, so asking twice is harmless; the fencing token keeps the
    slower answer from being stored).

    Every records database is swept (``databases.record_databases()``: one
    unless ``IDEMPOTENCY["DATABASE"]`` is ``None``); each record is settled
    in the database it lives in.

    Args:
        batch_size: At most this many records from each database in this run.
        database: Only this records database; ``None``: all of them.

    Returns:
        What the run did, by outcome, over all the databases swept.

    Raises:
        UnknownRecordDatabase: ``database`` holds no records.
        DatabaseError: A records database failed; the others were still swept.
    """
    conf = idempotency_settings
    report = RecoveryReport()

    def recover_in(alias: str) -> None:
        for _ in range(batch_size):
            taken = store.take_over_next_stale(lease=conf.LEASE, using=alias)
            if taken is None:
                break
            try:
                settle(*taken, report)
            except StaleOwner:
                report.stale += 1

    try:
        sweep(records_database_named(database), recover_in)
    finally:  # a database that failed still leaves the others' outcomes to count
        metrics.count_recovery(report)
    return report


def settle(record: IdempotencyRecord, held: store.Claim, report: RecoveryReport) -> None:
    """Settle one record recovery took over (``held``), counting the outcome in ``report``."""
    # The reconciler sees the steps in begin order as ``record.steps.all()``:
    # one query, on the record's own database, put where Django's prefetch
    # puts its results. (``prefetch_related_objects`` would ask the routers'
    # db_for_read first, which must never see a record read: a replica.)
    steps = store.steps_of(record.pk, using=held.database)
    len(steps)  # evaluated here, once
    record._prefetched_objects_cache = {"steps": steps}  # type: ignore[attr-defined]
    if record.state == State.CLAIMED and not record.steps.all():
        if store.release(held):
            report.released += 1
            signals.notify(signals.claim_released, None, held.scope, reason="recovery")
            metrics.count_release(held.scope.operation, "recovery")
        return
    reconciler = reconciler_for(record.operation)
    if reconciler is None:
        store.postpone(held, DEFAULT_BACKOFF)
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
        metrics.count_unreconciled(held.scope.operation)
        return
    try:
        with transaction.atomic(using=held.database):
            outcome = reconciler(record)
            if not isinstance(outcome, (Completed, Failed, Retry, Release, RetryFrom)):
                raise TypeError(
                    f"The reconciler of {record.operation!r} returned {outcome!r}; it must "
                    "return Completed, Failed, Retry, Release or RetryFrom."
                )
            if isinstance(outcome, (Completed, Failed)):
                state = Verdict.COMPLETED if isinstance(outcome, Completed) else Verdict.FAILED
                if outcome.provider_operation_id:
                    store.note_provider_operation(held, str(outcome.provider_operation_id))
                store.complete(held, state, outcome.stored_response(), ttl=idempotency_settings.TTL)
            else:
                # Nothing the reconciler wrote may outlive an unsettled record.
                transaction.set_rollback(True, using=held.database)
        if isinstance(outcome, RetryFrom):
            kept = _kept_steps(record, outcome)
    except StaleOwner:
        raise
    except Exception:
        logger.exception("The reconciler of %r failed on record %s", record.operation, record.pk)
        store.postpone(held, DEFAULT_BACKOFF)
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
            metrics.count_release(held.scope.operation, "reconciled")
        else:
            report.stale += 1
    elif isinstance(outcome, RetryFrom):
        _hand_back(record, held, outcome, kept, report)
    else:
        store.postpone(held, as_timedelta(outcome.after))
        report.retried += 1


def _kept_steps(record: IdempotencyRecord, outcome: RetryFrom) -> tuple[str, ...]:
    """The names of the steps begun before ``outcome.step`` (all, if it has no row)."""
    names = [step.name for step in record.steps.all()]
    kept = tuple(names[: names.index(outcome.step)] if outcome.step in names else names)
    unknown = set(outcome.provider_operation_ids) - set(kept)
    if unknown:
        raise ValueError(
            f"RetryFrom({outcome.step!r}) gives provider ids for {sorted(unknown)}, "
            f"which are not kept steps (kept: {list(kept)})."
        )
    return kept


def _hand_back(
    record: IdempotencyRecord,
    held: store.Claim,
    outcome: RetryFrom,
    kept: tuple[str, ...],
    report: RecoveryReport,
) -> None:
    if record.read_at is not None and time_left(record, record.expires_at) <= timedelta(0):
        # Handed back before and never taken within its retention: waiting
        # longer would only churn. Left for an operator (or a reconciler
        # that settles it), as after Retry.
        logger.warning(
            "Record %s (%s): the client did not retry within its retention; RetryFrom(%r) "
            "taken as Retry(after=%s).",
            record.pk,
            held.scope,
            outcome.step,
            DEFAULT_BACKOFF,
        )
        store.postpone(held, DEFAULT_BACKOFF)
        report.retried += 1
        return
    ids = {name: str(value) for name, value in outcome.provider_operation_ids.items()}
    store.hand_back(held, keep=kept, provider_operation_ids=ids)
    report.handed_back += 1
    logger.warning(
        "Record %s (%s) handed back to the client's retry from step %r (kept: %s).",
        record.pk,
        held.scope,
        outcome.step,
        ", ".join(kept) or "none",
    )
