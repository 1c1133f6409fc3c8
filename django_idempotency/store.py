"""Claim, complete, release: the only module that writes idempotency records.

Every write by an owner is conditional on the fencing token it was handed
at claim time, so an owner that lost its lease changes nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import RESOLVED_STATES, IdempotencyRecord
from django_idempotency.responses import Outcome, StoredResponse
from django_idempotency.scope import Scope

logger = logging.getLogger("django_idempotency")

State = IdempotencyRecord.State
OWNED_STATES = (State.CLAIMED, State.IN_PROGRESS)
_HOST = socket.gethostname()


@dataclass(frozen=True)
class Claim:
    """What the winner of a claim holds: the record and its fencing token."""

    record_id: int
    fencing_token: int
    scope: Scope
    database: str


def lease_owner() -> str:
    return f"{_HOST}:{os.getpid()}:{threading.get_ident()}"[:255]


_CLAIM_COLUMNS = (
    "tenant",
    "operation",
    "key",
    "fingerprint",
    "state",
    "lease_owner",
    "lease_expires_at",
    "created_at",
    "updated_at",
    "expires_at",
    # Constant on insert, spelled in the SQL below.
    "fencing_token",
    "provider_key",
    "provider_operation_id",
    "response_headers",
)


def _claim_sql(quote: Callable[[str], str]) -> str:
    table = quote(IdempotencyRecord._meta.db_table)
    columns = ", ".join(quote(name) for name in _CLAIM_COLUMNS)
    scope = ", ".join(quote(name) for name in ("tenant", "operation", "key"))
    return (
        f"INSERT INTO {table} ({columns}) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 1, '', '', '[]') "
        f"ON CONFLICT ({scope}) DO NOTHING RETURNING {quote('id')}"
    )


def claim(
    scope: Scope, fingerprint: str, *, ttl: timedelta, lease: timedelta, using: str
) -> Claim | None:
    """Insert a CLAIMED record in one atomic statement; ``None`` if the key is taken.

    The database's unique constraint on (tenant, operation, key) is the
    arbiter: on PostgreSQL ``INSERT ... ON CONFLICT DO NOTHING RETURNING``,
    elsewhere an INSERT inside a savepoint whose IntegrityError means "lost".
    Never SELECT-then-INSERT. Outside a transaction the statement commits at
    once; inside one (the caller's), it commits with it.
    """
    now = timezone.now()
    connection = connections[using]
    if connection.vendor == "postgresql":
        sql = _claim_sql(connection.ops.quote_name)
        params: list[Any] = [
            scope.tenant,
            scope.operation,
            scope.key,
            fingerprint,
            State.CLAIMED.value,
            lease_owner(),
            now + lease,
            now,
            now,
            now + ttl,
        ]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is None:
            return None
        return Claim(record_id=row[0], fencing_token=1, scope=scope, database=using)
    try:
        with transaction.atomic(using=using):
            record = IdempotencyRecord.objects.using(using).create(
                tenant=scope.tenant,
                operation=scope.operation,
                key=scope.key,
                fingerprint=fingerprint,
                state=State.CLAIMED,
                lease_owner=lease_owner(),
                lease_expires_at=now + lease,
                fencing_token=1,
                created_at=now,
                updated_at=now,
                expires_at=now + ttl,
            )
    except IntegrityError:
        return None
    return Claim(record_id=record.pk, fencing_token=1, scope=scope, database=using)


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
            lease_expires_at=now + lease,
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
    return Claim(record_id=record.pk, fencing_token=token, scope=scope, database=using)


def lookup(scope: Scope, *, using: str) -> IdempotencyRecord | None:
    return (
        IdempotencyRecord.objects.using(using)
        .filter(tenant=scope.tenant, operation=scope.operation, key=scope.key)
        .first()
    )


def complete(held: Claim, outcome: Outcome, response: StoredResponse, *, ttl: timedelta) -> None:
    """Store the outcome; run inside the view's transaction so both commit together."""
    now = timezone.now()
    updated = (
        IdempotencyRecord.objects.using(held.database)
        .filter(pk=held.record_id, fencing_token=held.fencing_token, state__in=OWNED_STATES)
        .update(
            state=outcome.value,
            response_status=response.status,
            response_headers=response.headers,
            response_body=response.body,
            lease_owner="",
            lease_expires_at=None,
            updated_at=now,
            expires_at=now + ttl,
        )
    )
    if not updated:
        logger.warning(
            "Stale owner: record %s (%s) was taken over; its outcome is not stored "
            "and the view's writes are rolled back.",
            held.record_id,
            held.scope,
        )
        raise StaleOwner(held.record_id)


def release(held: Claim) -> bool:
    """Delete a CLAIMED record so that a retry runs the view again."""
    deleted, _ = (
        IdempotencyRecord.objects.using(held.database)
        .filter(pk=held.record_id, fencing_token=held.fencing_token, state=State.CLAIMED)
        .delete()
    )
    if not deleted:
        logger.warning(
            "Stale owner: record %s (%s) was not released; it changed hands or state.",
            held.record_id,
            held.scope,
        )
    return bool(deleted)


def discard_expired(record: IdempotencyRecord, *, using: str) -> bool:
    """Delete a resolved record past its retention so its key can start anew."""
    deleted, _ = (
        IdempotencyRecord.objects.using(using)
        .filter(
            pk=record.pk,
            fencing_token=record.fencing_token,
            state__in=RESOLVED_STATES,
            expires_at__lte=timezone.now(),
        )
        .delete()
    )
    return bool(deleted)
