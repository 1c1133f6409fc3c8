"""The optimistic mode's records: written once, finished, at the end of the view's transaction.

``@idempotent(optimistic=True)`` claims nothing before the view runs. It
looks the key up with the plain ``lookup()``, in autocommit (a replay is
that one statement), and only when no record answers opens the view's
transaction, which ends with ``record_finished``: one INSERT of the record
with its outcome, arbitrated by the same unique constraint on (tenant,
operation, key) as a claim. One commit, no UPDATE, no dead row version.
A record past retention is deleted right before, in the same transaction
(``discard_expired_waiting_at_most``).
"""

from __future__ import annotations

import json
from datetime import timedelta

from django.db import IntegrityError, connections, transaction
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL

from django_idempotency._store import wait_bounds
from django_idempotency._store.claims import expired_and_unchanged
from django_idempotency._store.conditional import delete_where
from django_idempotency._store.digests import NOBODY, Fingerprint, Sender
from django_idempotency._store.sealing import seal
from django_idempotency._store.statements import statements_for
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse, Verdict
from django_idempotency.scope import Scope


def record_finished(
    scope: Scope,
    fingerprint: Fingerprint,
    verdict: Verdict,
    response: StoredResponse,
    *,
    ttl: timedelta,
    using: str,
    sender: Sender = NOBODY,
    wait: timedelta,
) -> bool:
    """Insert the finished record; False, and nothing written, when the scope is taken.

    One plain INSERT, on every database: the unique constraint's
    IntegrityError means "taken". Inside a transaction that error leaves it
    to roll back (on PostgreSQL it is aborted), so it is marked for
    rollback here: the optimistic mode rolls the view's writes back when
    its record lost anyway, which is why no savepoint (two more round
    trips) or ``ON CONFLICT DO NOTHING`` (a speculative insertion, 48 more
    bytes of WAL) is spent on keeping it alive. (MariaDB's ``INSERT IGNORE``
    would also hide other errors as warnings.)

    Inside the view's transaction the unique index decides at this moment
    whether this request's work commits: a duplicate whose record is not
    committed yet makes this statement wait for it, on PostgreSQL at most
    ``wait`` (a ``lock_timeout`` set inside the statement itself, then
    SQLSTATE 55P03), and one that committed makes it lose. Outside one it
    commits at once. What is written passes ``sealing.seal``, as a
    completion's does.
    """
    sealed = seal(response)
    stored = sealed.response
    connection = connections[using]
    sql = statements_for(connection)
    params = [
        scope.tenant,
        scope.operation,
        scope.key,
        fingerprint.stored,
        verdict.value,
        stored.status,
        json.dumps(stored.headers),
        stored.body,
        sealed.sealed,
    ]
    if connection.vendor == "postgresql":
        params.append(wait_bounds.milliseconds(wait))
    params += [
        sender.principal,
        sender.credential,
        *sql.clock.later_params(connection, ttl),
        *sql.clock.now_params(connection),
        *sql.clock.now_params(connection),
    ]
    try:
        with connection.cursor() as cursor:
            cursor.execute(sql.insert_finished, params)
    except IntegrityError:
        if connection.in_atomic_block:
            transaction.set_rollback(True, using=using)
        return False
    return True


def discard_expired_waiting_at_most(
    record: IdempotencyRecord, *, using: str, wait: timedelta
) -> bool:
    """``discard_expired()`` inside the view's transaction, right before ``record_finished``.

    The DELETE commits only with the new record, under the expired one's
    own condition (resolved, past retention, not taken over since), so a
    duplicate doing the same waits for this one and then finds nothing to
    delete. That wait, on PostgreSQL, lasts at most ``wait``: a
    ``lock_timeout`` set in the DELETE's own WHERE, evaluated on the row
    before it is locked. It stays in force for the rest of the transaction,
    which is only the record's INSERT (bounded the same) and the COMMIT.
    """
    doomed = IdempotencyRecord.objects.filter(expired_and_unchanged(record))
    if connections[using].vendor == "postgresql":
        bound = RawSQL(
            f"{wait_bounds.exactly('lock_timeout')} IS NOT NULL",
            [wait_bounds.milliseconds(wait)],
            output_field=BooleanField(),
        )
        doomed = doomed.filter(bound)
    return bool(delete_where(doomed, using=using))
