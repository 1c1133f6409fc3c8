"""What the owner of a claim writes: its intent, its lease, its outcome, its release.

Every write is conditional on the fencing token the owner was handed at
claim (or takeover) time, so an owner that lost its lease changes nothing:
the write matches no row, is logged, and raises ``StaleOwner``.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

from django.db import connections
from django.db.models import Case, F, When

from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import UNRESOLVED_STATES, IdempotencyRecord
from django_idempotency.responses import StoredResponse, Verdict
from django_idempotency.store.claims import Claim
from django_idempotency.store.conditional import delete_where
from django_idempotency.store.database_time import DatabaseLater, DatabaseNow
from django_idempotency.store.sealing import seal
from django_idempotency.store.statements import statements_for

__all__ = [
    "begin_external",
    "complete",
    "mark_uncertain",
    "postpone",
    "release",
    "renew_lease",
    "set_provider_operation",
]

logger = logging.getLogger("django_idempotency")

State = IdempotencyRecord.State


def complete(held: Claim, verdict: Verdict, response: StoredResponse, *, ttl: timedelta) -> None:
    """Store the outcome; run inside the view's transaction so both commit together.

    What is written passes ``sealing.seal``: the REDACT hook, then encryption,
    and whether it is encrypted is written by the same statement.
    """
    sealed = seal(response)
    response = sealed.response
    connection = connections[held.database]
    sql = statements_for(connection)
    retention_ends = sql.clock.later_params(connection, ttl)
    params = [
        verdict.value,
        response.status,
        # Text, which every backend casts to its JSON column (PostgreSQL
        # reads an untyped literal as jsonb): cheaper than the Jsonb adapter.
        json.dumps(response.headers),
        response.body,
        sealed.sealed,
        *retention_ends,
        *retention_ends,
        *sql.clock.now_params(connection),
        held.record_id,
        held.fencing_token,
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql.complete, params)
        updated = cursor.rowcount
    if not updated:
        _log_stale(held, "completion")
        raise StaleOwner(held.record_id)


def release(held: Claim, *, states: tuple[str, ...] = (State.CLAIMED,)) -> bool:
    """Delete the record so that a retry runs the operation again.

    Only CLAIMED records by default: once an external call has begun, only
    a reconciler that knows it never happened may release (``Release()``).
    """
    deleted = delete_where(
        IdempotencyRecord.objects.filter(
            pk=held.record_id, fencing_token=held.fencing_token, state__in=states
        ),
        using=held.database,
    )
    if not deleted:
        _log_stale(held, "release")
    return bool(deleted)


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
    values["updated_at"] = DatabaseNow()
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
    return Case(
        When(lease_expires_at__gt=DatabaseLater(lease), then=F("lease_expires_at")),
        default=DatabaseLater(lease),
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
        lease_expires_at=DatabaseNow(),
        **values,
    )


def postpone(held: Claim, delay: timedelta) -> None:
    """Leave an unresolved record UNCERTAIN for recovery to try again ``delay`` from now."""
    _owner_update(
        held,
        "postpone",
        using=held.database,
        states=UNRESOLVED_STATES,
        state=State.UNCERTAIN,
        lease_owner="",
        lease_expires_at=DatabaseLater(delay),
    )
