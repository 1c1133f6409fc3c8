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

from django.db import connections, transaction
from django.db.models import Case, Exists, F, OuterRef, When

from django_idempotency._store.claims import Claim
from django_idempotency._store.conditional import delete_where
from django_idempotency._store.database_time import DatabaseLater, DatabaseNow
from django_idempotency._store.sealing import seal
from django_idempotency._store.statements import statements_for
from django_idempotency._store.steps import (
    StepWrite,
    forget_steps,
    insert_step,
    record_step_provider_operation,
    touch_step,
    write_steps_again,
)
from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import UNRESOLVED_STATES, IdempotencyRecord, IdempotencyStep
from django_idempotency.responses import StoredResponse, Verdict

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
        verdict._value_,  # what .value reads, without its two calls
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
    a reconciler that knows it never happened may release (``Release()``),
    or an operator. Nor, by default, a CLAIMED record with steps: it has
    them when a reconciler handed it back (``RetryFrom``) and kept steps
    whose providers were called; deleting it would delete what is known of
    them. Part of the one DELETE (``NOT EXISTS``), not a read before it. A
    caller that names other ``states`` (a reconciler's ``Release()``, an
    operator) deletes the steps with the record.
    """
    records = IdempotencyRecord.objects.filter(
        pk=held.record_id, fencing_token=held.fencing_token, state__in=states
    )
    with_steps = Exists(IdempotencyStep.objects.filter(record=OuterRef("pk")))
    if states == (State.CLAIMED,):
        records = records.filter(~with_steps)
    deleted = delete_where(records, using=held.database)
    if deleted:
        return True
    if states == (State.CLAIMED,) and _hand_back_again(held, with_steps):
        return False
    _log_stale(held, "release")
    return False


def _hand_back_again(held: Claim, with_steps: Exists) -> int:
    """A kept record (it has steps) goes back to the client's retry, as ``hand_back`` left it.

    Its owner gave up before its first ``begin_external()``: held under the
    owner's lease, the client's next retry would be refused 409 until the
    lease ran out, and recovery, not the client, would get it next. Only on
    the failure path, after a DELETE that matched nothing.
    """
    return (
        IdempotencyRecord.objects.using(held.database)
        .filter(pk=held.record_id, fencing_token=held.fencing_token, state=State.CLAIMED)
        .filter(with_steps)
        .update(lease_owner="", lease_expires_at=F("expires_at"), updated_at=DatabaseNow())
    )


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


def mark_uncertain(
    held: Claim,
    *,
    provider_key: str,
    provider_operation_id: str,
    steps: tuple[StepWrite, ...] = (),
) -> None:
    """The external call's outcome is unknown: only a reconciler may settle it.

    Writes the intent again, since where ``begin_external()`` had to write
    inside the view's transaction (SQLite, or a caller's transaction) it was
    rolled back with the view: the record's provider key (``""``: the
    request made no call without a step, and the column is left as it is)
    and id, and every step the request began, in the order it began them.
    The lease ends now, so that the next recovery run asks the reconciler.
    """
    values: dict[str, Any] = {}
    if provider_key:
        values["provider_key"] = provider_key
    if provider_operation_id:
        values["provider_operation_id"] = provider_operation_id
    alias = held.write_now_alias
    with transaction.atomic(using=alias):
        _owner_update(
            held,
            "mark uncertain",
            using=alias,
            states=UNRESOLVED_STATES,
            state=State.UNCERTAIN,
            lease_owner="",
            lease_expires_at=DatabaseNow(),
            **values,
        )
        write_steps_again(held.record_id, steps, using=alias)


def begin_step(
    held: Claim, name: str, provider_key: str, *, stored: bool, lease: timedelta
) -> None:
    """Commit a step's intent before its call: the record IN_PROGRESS, the step's row.

    One transaction on the write-now connection: the fenced UPDATE of the
    record (which also locks its row until the step is written), then the
    step's INSERT, or, for a step already ``stored`` (an earlier attempt's,
    or begun twice), an UPDATE that keeps its provider key.
    """
    alias = held.write_now_alias
    with transaction.atomic(using=alias):
        _owner_update(
            held,
            "begin_external",
            using=alias,
            states=(State.CLAIMED, State.IN_PROGRESS),
            state=State.IN_PROGRESS,
            lease_expires_at=_lease_at_least(lease),
        )
        if not stored:
            insert_step(held.record_id, name, provider_key, using=alias)
        elif not touch_step(held.record_id, name, using=alias):
            # Forgotten meanwhile by nobody but a takeover, which the fence
            # above would have caught: a step is never deleted under its owner.
            insert_step(held.record_id, name, provider_key, using=alias)


def set_step_provider_operation(
    held: Claim, name: str, operation_id: str, *, lease: timedelta
) -> None:
    """Commit the provider's id for one step's call as soon as it is known."""
    alias = held.write_now_alias
    with transaction.atomic(using=alias):
        _owner_update(
            held,
            "set_provider_operation",
            using=alias,
            states=(State.IN_PROGRESS,),
            lease_expires_at=_lease_at_least(lease),
        )
        record_step_provider_operation(held.record_id, name, operation_id, using=alias)


def note_provider_operation(held: Claim, operation_id: str) -> None:
    """A reconciler's ``provider_operation_id``: written in its transaction, before completion."""
    _owner_update(
        held,
        "provider operation id",
        using=held.database,
        states=UNRESOLVED_STATES,
        provider_operation_id=operation_id,
    )


def hand_back(
    held: Claim, *, keep: tuple[str, ...], provider_operation_ids: dict[str, str]
) -> None:
    """Hand a record back to the client's retry, keeping the steps ``keep`` (``RetryFrom``).

    The record becomes CLAIMED with no lease owner and a lease that ends
    with its retention, which no other write leaves a record in (a live
    owner always names itself, for a lease far shorter; ``claims.handed_back``):
    the client's retry with the same key and input takes it over at once
    (``claims.abandoned``), whatever its lease. The lease is set to end
    with the record's retention, so that recovery leaves the record alone
    until then and asks its reconciler again only if the client never came
    back. The other steps are deleted; the kept ones get the provider ids
    the reconciler found. One transaction, on the records database.
    """
    with transaction.atomic(using=held.database):
        _owner_update(
            held,
            "hand back",
            using=held.database,
            states=UNRESOLVED_STATES,
            state=State.CLAIMED,
            lease_owner="",
            lease_expires_at=F("expires_at"),
        )
        forget_steps(
            held.record_id,
            keep=keep,
            provider_operation_ids=provider_operation_ids,
            using=held.database,
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
