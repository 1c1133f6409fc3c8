"""Claim, complete, release, take over: the only module that writes records.

Every write by an owner is conditional on the fencing token it was handed
at claim (or takeover) time, so an owner that lost its lease changes
nothing: the write matches no row, is logged, and raises ``StaleOwner``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import IntegrityError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Case, DateTimeField, F, QuerySet, Value, When
from django.utils import timezone

from django_idempotency.clock import ahead
from django_idempotency.database_errors import is_serialization_failure
from django_idempotency.db import commit_now_alias
from django_idempotency.digests import Fingerprint
from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import RESOLVED_STATES, IdempotencyRecord
from django_idempotency.responses import Outcome, StoredResponse
from django_idempotency.scope import Scope
from django_idempotency.sealing import (
    UnreadableRecord,
    encrypt,
    reseal,
    seal,
    sealed_by_an_earlier_release,
)
from django_idempotency.statements import record_from_row, statements_for

logger = logging.getLogger("django_idempotency")

State = IdempotencyRecord.State
UNRESOLVED_STATES = (State.CLAIMED, State.IN_PROGRESS, State.UNCERTAIN)
_HOST = socket.gethostname()


@dataclass(frozen=True)
class Claim:
    """What the winner of a claim holds: the record and its fencing token."""

    record_id: int
    fencing_token: int
    scope: Scope
    database: str
    #: False when the claim joined a transaction that was already open (the
    #: caller's): then the record exists only inside it, and so must every
    #: later write of this owner.
    committed: bool = True
    #: The provider key the record already holds (a claim taken over): the
    #: owner sends the provider that one, never a newly derived one.
    provider_key: str = ""

    @property
    def write_now_alias(self) -> str:
        """Where an owner write commits at once, even mid-transaction."""
        return commit_now_alias(self.database) if self.committed else self.database


def lease_owner() -> str:
    return f"{_HOST}:{os.getpid()}:{threading.get_ident()}"[:255]


def claim(
    scope: Scope,
    fingerprint: Fingerprint,
    *,
    ttl: timedelta,
    lease: timedelta,
    using: str,
    wait_at_most: timedelta | None = None,
) -> Claim | None:
    """Insert a CLAIMED record in one atomic statement; ``None`` if the key is taken.

    The database's unique constraint on (tenant, operation, key) is the
    arbiter: on PostgreSQL ``INSERT ... ON CONFLICT DO NOTHING RETURNING``,
    elsewhere an INSERT inside a savepoint whose IntegrityError means "lost".
    Never SELECT-then-INSERT. Outside a transaction the statement commits at
    once; inside one (the caller's), it commits with it.

    ``wait_at_most`` (PostgreSQL, inside a transaction): how long the INSERT
    may wait on a concurrent, uncommitted claim of the same scope; the
    setting lasts until the transaction ends, and running out raises
    ``OperationalError`` (SQLSTATE 55P03).
    """
    connection = connections[using]
    committed = not connection.in_atomic_block
    if connection.vendor == "postgresql":
        sql = statements_for(connection)
        params = _claim_params(scope, fingerprint, ttl=ttl, lease=lease)
        if wait_at_most is not None:
            timeout_ms = max(1, round(wait_at_most.total_seconds() * 1000))
            params, query = [*params, str(timeout_ms)], sql.claim_waiting_at_most
        else:
            query = sql.claim
        # In a caller's transaction the INSERT may wait on a duplicate and
        # time out (lock_timeout, a deadlock): a savepoint keeps that from
        # aborting the caller's transaction. The single-transaction claim
        # (``wait_at_most``) opens its transaction itself: nothing to keep.
        joins_callers = not committed and wait_at_most is None
        savepoint = transaction.atomic(using=using) if joins_callers else nullcontext()
        with savepoint, connection.cursor() as cursor:
            cursor.execute(query, params)
            row = cursor.fetchone()
        return None if row is None else Claim(row[0], 1, scope, using, committed)
    now = timezone.now()
    try:
        with transaction.atomic(using=using):
            record = IdempotencyRecord.objects.using(using).create(
                tenant=scope.tenant,
                operation=scope.operation,
                key=scope.key,
                fingerprint=fingerprint.stored,
                state=State.CLAIMED,
                lease_owner=lease_owner(),
                lease_expires_at=ahead(lease, now=now),
                fencing_token=1,
                created_at=now,
                updated_at=now,
                expires_at=ahead(ttl, now=now),
            )
    except IntegrityError:
        return None
    return Claim(record.pk, 1, scope, using, committed)


def claim_or_find(
    scope: Scope, fingerprint: Fingerprint, *, ttl: timedelta, lease: timedelta, using: str
) -> tuple[Claim | None, IdempotencyRecord | None]:
    """``claim()``, and when the key is taken, the record that holds it.

    Two statements for a replay, one for a first execution. (A single
    ``WITH claimed AS (INSERT ...) SELECT ...`` statement was measured: the
    planning of the CTE cost a first execution more than it saved a replay.)
    Both can be ``None``: the holder released the record in between.
    """
    held = claim(scope, fingerprint, ttl=ttl, lease=lease, using=using)
    return held, None if held else lookup(scope, using=using)


def _scope_params(scope: Scope) -> list[str]:
    return [scope.tenant, scope.operation, scope.key]


def _claim_params(
    scope: Scope, fingerprint: Fingerprint, *, ttl: timedelta, lease: timedelta
) -> list[Any]:
    now = timezone.now()
    return [
        scope.tenant,
        scope.operation,
        scope.key,
        fingerprint.stored,
        State.CLAIMED.value,
        lease_owner(),
        ahead(lease, now=now),
        now,
        now,
        ahead(ttl, now=now),
    ]


def take_over(
    record: IdempotencyRecord, scope: Scope, *, lease: timedelta, using: str
) -> Claim | None:
    """Claim a CLAIMED record whose owner's lease ran out, by compare-and-set.

    A CLAIMED owner has begun no external call, and its local work commits
    only with its completion: if it died, that work rolled back with it; if
    it is merely slow, its completion will find the fencing token moved on
    and roll back too. So the record can be run again, once.
    """
    now = timezone.now()
    token = record.fencing_token + 1
    updated = (
        IdempotencyRecord.objects.using(using)
        .filter(
            pk=record.pk,
            fencing_token=record.fencing_token,
            state=State.CLAIMED,
            lease_expires_at__lte=now,
        )
        .update(
            fencing_token=token,
            lease_owner=lease_owner(),
            lease_expires_at=ahead(lease, now=now),
            updated_at=now,
        )
    )
    if not updated:
        return None
    logger.warning(
        "Took over record %s (%s): its owner's lease ran out at %s.",
        record.pk,
        scope,
        record.lease_expires_at,
    )
    committed = not connections[using].in_atomic_block
    return Claim(record.pk, token, scope, using, committed, record.provider_key)


def lookup(scope: Scope, *, using: str) -> IdempotencyRecord | None:
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(statements_for(connection).find, _scope_params(scope))
        row = cursor.fetchone()
    return None if row is None else record_from_row(connection, row)


def complete(held: Claim, outcome: Outcome, response: StoredResponse, *, ttl: timedelta) -> None:
    """Store the outcome; run inside the view's transaction so both commit together.

    What is written passes ``sealing.seal``: the REDACT hook, then encryption,
    and whether it is encrypted is written by the same statement.
    """
    sealed = seal(response)
    response = sealed.response
    connection = connections[held.database]
    adapt = connection.ops.adapt_datetimefield_value
    now = timezone.now()
    expires_at = adapt(ahead(ttl, now=now))
    params = [
        outcome.value,
        response.status,
        # Text, which every backend casts to its JSON column (PostgreSQL
        # reads an untyped literal as jsonb): cheaper than the Jsonb adapter.
        json.dumps(response.headers),
        response.body,
        sealed.sealed,
        expires_at,
        expires_at,
        adapt(now),
        held.record_id,
        held.fencing_token,
    ]
    with connection.cursor() as cursor:
        cursor.execute(statements_for(connection).complete, params)
        updated = cursor.rowcount
    if not updated:
        _log_stale(held, "completion")
        raise StaleOwner(held.record_id)


def release(held: Claim, *, states: tuple[str, ...] = (State.CLAIMED,)) -> bool:
    """Delete the record so that a retry runs the operation again.

    Only CLAIMED records by default: once an external call has begun, only
    a reconciler that knows it never happened may release (``Release()``).
    """
    deleted = _delete_where(
        IdempotencyRecord.objects.filter(
            pk=held.record_id, fencing_token=held.fencing_token, state__in=states
        ),
        using=held.database,
    )
    if not deleted:
        _log_stale(held, "release")
    return bool(deleted)


# Never ``QuerySet.delete()``: as soon as a project connects any
# ``pre_delete``/``post_delete`` receiver without a sender (audit and history
# packages do), Django's collector SELECTs the rows, sends the signals, then
# deletes by primary key alone, and whatever changed in between (a takeover,
# an extended retention) is deleted anyway. ``_raw_delete()`` is the one
# ``DELETE ... WHERE`` Django's own fast delete runs, with every condition:
# the ORM still compiles them (adapting datetimes per backend and USE_TZ,
# which SQL of our own in ``statements`` would have to repeat for a variable
# list of states or ids), and no model signal is sent, whatever receivers are
# connected (docs/signals.md). Private API, but the very statement of Django's
# own fast delete, and typed by django-stubs; tests/test_conditional_writes.py
# fails if it ever stops being one statement. (It answers None, not 0, when the
# conditions can match nothing, such as an empty list of states.)
def _delete_where(records: QuerySet[IdempotencyRecord], *, using: str) -> int:
    return records._raw_delete(using) or 0


def _log_stale(held: Claim, write: str) -> None:
    logger.warning(
        "Stale owner: the %s of record %s (%s) with fencing token %s changed nothing; "
        "the record was taken over or resolved meanwhile.",
        write,
        held.record_id,
        held.scope,
        held.fencing_token,
    )


def _owner_update(held: Claim, write: str, *, using: str, states: Any, **values: Any) -> None:
    values["updated_at"] = timezone.now()
    updated = (
        IdempotencyRecord.objects.using(using)
        .filter(pk=held.record_id, fencing_token=held.fencing_token, state__in=states)
        .update(**values)
    )
    if not updated:
        _log_stale(held, write)
        raise StaleOwner(held.record_id)


# An owner's write never moves its lease backwards: a view that asked
# ``begin_external(lease=...)`` for a long provider call keeps that lease when
# it then stores the provider's id or renews with the default ``LEASE``;
# otherwise recovery would take over (and ask the provider about) a call still
# under way. Part of the owner's one conditional UPDATE, not a read before it.
# A CASE rather than GREATEST, which SQLite lacks and MySQL answers NULL for
# when either side is NULL; here a NULL lease compares unknown and takes the
# new one.
def _lease_at_least(lease: timedelta) -> Case:
    until = ahead(lease)
    return Case(
        When(lease_expires_at__gt=until, then=F("lease_expires_at")),
        default=Value(until, output_field=DateTimeField()),
    )


def begin_external(held: Claim, provider_key: str, *, lease: timedelta) -> None:
    """Commit the intent (IN_PROGRESS and the provider key) before the call."""
    _owner_update(
        held,
        "begin_external",
        using=held.write_now_alias,
        states=(State.CLAIMED, State.IN_PROGRESS),
        state=State.IN_PROGRESS,
        provider_key=provider_key,
        lease_expires_at=_lease_at_least(lease),
    )


def set_provider_operation(held: Claim, operation_id: str, *, lease: timedelta) -> None:
    """Commit the provider's id for the call as soon as it is known."""
    _owner_update(
        held,
        "set_provider_operation",
        using=held.write_now_alias,
        states=(State.IN_PROGRESS,),
        provider_operation_id=operation_id,
        lease_expires_at=_lease_at_least(lease),
    )


def renew_lease(held: Claim, *, lease: timedelta) -> None:
    _owner_update(
        held,
        "lease renewal",
        using=held.write_now_alias,
        states=(State.CLAIMED, State.IN_PROGRESS),
        lease_expires_at=_lease_at_least(lease),
    )


def mark_uncertain(held: Claim, *, provider_key: str, provider_operation_id: str) -> None:
    """The external call's outcome is unknown: only a reconciler may settle it.

    Writes the intent again, since where ``begin_external()`` had to write
    inside the view's transaction (SQLite, or a caller's transaction) it was
    rolled back with the view. The lease ends now, so that the next recovery
    run asks the reconciler.
    """
    values: dict[str, Any] = {"provider_key": provider_key}
    if provider_operation_id:
        values["provider_operation_id"] = provider_operation_id
    _owner_update(
        held,
        "mark uncertain",
        using=held.write_now_alias,
        states=UNRESOLVED_STATES,
        state=State.UNCERTAIN,
        lease_owner="",
        lease_expires_at=timezone.now(),
        **values,
    )


def postpone(held: Claim, until: datetime) -> None:
    """Leave an unresolved record UNCERTAIN for recovery to try again ``until``."""
    _owner_update(
        held,
        "postpone",
        using=held.database,
        states=UNRESOLVED_STATES,
        state=State.UNCERTAIN,
        lease_owner="",
        lease_expires_at=until,
    )


def take_over_next_stale(*, lease: timedelta, using: str) -> tuple[IdempotencyRecord, Claim] | None:
    """Take the unresolved record whose lease ran out longest ago, for recovery.

    One record at a time, right before it is settled, so that its fresh
    lease covers the reconciler's run rather than a whole batch's. The row
    is locked while it is taken (SKIP LOCKED where the database has it, so
    that concurrent workers pass over each other's), and the takeover is a
    compare-and-set repeating every condition: a record another worker took
    or resolved in between is never handled twice.
    """
    connection = connections[using]
    conflicts = 0
    while True:
        now = timezone.now()
        try:
            taken, record, token, owner = _take_over_oldest_stale(connection, lease, now)
        except OperationalError as exc:
            # At REPEATABLE READ, a row another worker took after this
            # transaction's snapshot is a serialization failure, not a skip:
            # look again with a fresh snapshot (a few times; then it is news).
            conflicts += 1
            if not is_serialization_failure(exc) or conflicts > _MAX_CONFLICTS:
                raise
            continue
        if record is None:
            return None
        if taken:
            record.fencing_token, record.lease_owner = token, owner
            record.lease_expires_at = ahead(lease, now=now)
            scope = Scope(record.tenant, record.operation, record.key)
            return record, Claim(record.pk, token, scope, using, provider_key=record.provider_key)


#: How often recovery looks again after a serialization failure before giving up.
_MAX_CONFLICTS = 10


def _take_over_oldest_stale(
    connection: BaseDatabaseWrapper, lease: timedelta, now: datetime
) -> tuple[int, IdempotencyRecord | None, int, str]:
    using = connection.alias
    with transaction.atomic(using=using):
        stale = IdempotencyRecord.objects.using(using).filter(
            state__in=UNRESOLVED_STATES, lease_expires_at__lte=now
        )
        if connection.features.has_select_for_update_skip_locked:
            stale = stale.select_for_update(skip_locked=True)
        elif connection.features.has_select_for_update:
            stale = stale.select_for_update()
        record = stale.order_by("lease_expires_at").first()
        if record is None:
            return 0, None, 0, ""
        token = record.fencing_token + 1
        owner = lease_owner()
        taken = (
            IdempotencyRecord.objects.using(using)
            .filter(
                pk=record.pk,
                fencing_token=record.fencing_token,
                state__in=UNRESOLVED_STATES,
                lease_expires_at__lte=now,
            )
            .update(
                fencing_token=token,
                lease_owner=owner,
                lease_expires_at=ahead(lease, now=now),
                updated_at=now,
            )
        )
    return taken, record, token, owner


#: Where the first batch of a purge starts scanning: before any record's expiry.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def purge_expired_batch(
    *, limit: int, using: str, after: datetime | None = None
) -> tuple[int, datetime | None]:
    """Delete up to ``limit`` resolved records past retention; never unresolved ones.

    Returns how many were deleted and the latest expiry among them: pass it
    back as ``after`` so the next batch starts its scan there.
    """
    connection = connections[using]
    now = timezone.now()
    if connection.vendor == "postgresql":
        start = after or _EPOCH  # timestamptz on PostgreSQL, whatever USE_TZ says
        with connection.cursor() as cursor:
            cursor.execute(statements_for(connection).purge, [now, start, limit, now])
            deleted, reached = cursor.fetchone()
        return deleted, reached
    expired = IdempotencyRecord.objects.using(using).filter(
        state__in=RESOLVED_STATES, expires_at__lte=now
    )
    batch = expired if after is None else expired.filter(expires_at__gte=after)
    batch = batch.order_by("expires_at")[:limit]
    rows = list(batch.values_list("pk", "expires_at"))
    if not rows:
        return 0, after
    # The conditions again: a record could have been re-used in between.
    deleted = _delete_where(expired.filter(pk__in=[pk for pk, _ in rows]), using=using)
    return deleted, rows[-1][1]


def discard_expired(record: IdempotencyRecord, *, using: str) -> bool:
    """Delete a resolved record past its retention so its key can start anew."""
    deleted = _delete_where(
        IdempotencyRecord.objects.filter(
            pk=record.pk,
            fencing_token=record.fencing_token,
            state__in=RESOLVED_STATES,
            expires_at__lte=timezone.now(),
        ),
        using=using,
    )
    return bool(deleted)


def take_over_for_operator(
    record: IdempotencyRecord,
    *,
    seen_state: str,
    operator: str,
    lease: timedelta,
    using: str,
) -> Claim | None:
    """Take a record for an operator's action, if it is as the operator saw it.

    Compare-and-set on the fencing token and the state the operator's page
    showed: a record that changed since (taken over, resolved) is left alone.
    So is a record whose lease somebody holds (its owner, or a recovery
    worker reconciling it): they are working on it.
    """
    now = timezone.now()
    token = record.fencing_token + 1
    updated = (
        IdempotencyRecord.objects.using(using)
        .filter(pk=record.pk, fencing_token=record.fencing_token, state=seen_state)
        .exclude(lease_owner__gt="", lease_expires_at__gt=now)
        .update(
            fencing_token=token,
            lease_owner=f"operator:{operator}"[:255],
            lease_expires_at=ahead(lease, now=now) if seen_state not in RESOLVED_STATES else None,
            updated_at=now,
        )
    )
    if not updated:
        return None
    record.fencing_token = token
    scope = Scope(record.tenant, record.operation, record.key)
    return Claim(record.pk, token, scope, using, provider_key=record.provider_key)


def extend_retention(record_ids: list[int], *, until: datetime, using: str) -> int:
    """Keep records recognisable until at least ``until``; never shortens."""
    return (
        IdempotencyRecord.objects.using(using)
        .filter(pk__in=record_ids, expires_at__lt=until)
        .update(expires_at=until, updated_at=timezone.now())
    )


def expire_leases(*, using: str) -> int:
    """End every unresolved record's lease now (``testing.expire_leases``)."""
    return (
        IdempotencyRecord.objects.using(using)
        .filter(state__in=UNRESOLVED_STATES)
        .update(lease_expires_at=timezone.now())
    )


@dataclass
class ResealBatch:
    """What one batch of ``reseal_batch`` did."""

    #: The last primary key looked at: where the next batch starts.
    last: int
    #: Encrypted responses re-encrypted with the newest key.
    rotated: int = 0
    #: Plaintext responses (stored before encryption was on) encrypted.
    encrypted: int = 0
    #: (primary key, scope) of the encrypted responses no key decrypts.
    unreadable: list[tuple[int, Scope]] = field(default_factory=list)


def reseal_batch(*, after: int, limit: int, using: str) -> ResealBatch:
    """Encrypt with the newest key every stored response past primary key ``after``.

    Sealed responses are re-encrypted; plaintext ones (stored before
    ``ENCRYPTION_KEYS`` was set) are encrypted, headers included. A record
    that no key decrypts is reported, and the batch goes on. Each write is a
    compare-and-set on the fencing token and the sealed flag, so a record
    changed meanwhile is left alone.
    """
    rows = list(
        IdempotencyRecord.objects.using(using)
        .filter(pk__gt=after, state__in=RESOLVED_STATES)
        .order_by("pk")
        .values_list(
            "pk",
            "fencing_token",
            "tenant",
            "operation",
            "key",
            "response_status",
            "response_sealed",
            "response_headers",
            "response_body",
        )[:limit]
    )
    batch = ResealBatch(rows[-1][0] if rows else after)
    for pk, token, tenant, operation, key, status, sealed, headers, body in rows:
        unchanged = IdempotencyRecord.objects.using(using).filter(
            pk=pk, fencing_token=token, response_sealed=sealed
        )
        if sealed or sealed_by_an_earlier_release(headers, body):
            try:
                batch.rotated += unchanged.update(response_body=reseal(body), response_sealed=True)
            except UnreadableRecord:
                batch.unreadable.append((pk, Scope(tenant, operation, key)))
        elif headers or body is not None:
            encrypted = encrypt(status or 0, headers, None if body is None else bytes(body))
            batch.encrypted += unchanged.update(
                response_headers=encrypted.headers,
                response_body=encrypted.body,
                response_sealed=True,
            )
    return batch
