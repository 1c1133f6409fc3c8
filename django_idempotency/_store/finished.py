"""The optimistic mode's records: written once, finished, at the end of the view's transaction.

``@idempotent(optimistic=True)`` claims nothing before the view runs. Its
view's transaction begins with ``lookup_waiting_at_most`` and ends with
``record_finished``: one conditional INSERT of the record with its outcome,
arbitrated by the same unique constraint on (tenant, operation, key) as a
claim. One commit, no UPDATE, no dead row version.
"""

from __future__ import annotations

import json
from datetime import timedelta

from django.db import IntegrityError, connections, transaction

from django_idempotency._store import wait_bounds
from django_idempotency._store.claims import lookup
from django_idempotency._store.digests import NOBODY, Fingerprint, Sender
from django_idempotency._store.sealing import seal
from django_idempotency._store.statements import record_from_row, statements_for
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse, Verdict
from django_idempotency.scope import Scope


def lookup_waiting_at_most(
    scope: Scope, *, using: str, wait: timedelta
) -> IdempotencyRecord | None:
    """``lookup()``, as the first statement of a transaction whose lock waits end after ``wait``.

    On PostgreSQL one statement sets ``lock_timeout`` for the rest of the
    transaction and reads the record: a duplicate running the same view
    waits at most ``wait`` on the winner's rows (a business unique key, the
    record's own index entry) before giving up with SQLSTATE 55P03, instead
    of holding its connection for the winner's whole run. Elsewhere the
    plain lookup: MariaDB's ``innodb_lock_wait_timeout`` is per session, not
    per transaction, and SQLite has one writer at a time.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        return lookup(scope, using=using)
    with connection.cursor() as cursor:
        cursor.execute(
            statements_for(connection).find_waiting_at_most,
            [wait_bounds.milliseconds(wait), scope.tenant, scope.operation, scope.key],
        )
        row = cursor.fetchone()
    # One row whatever is found: the record's columns are NULL without one.
    return None if row is None or row[0] is None else record_from_row(connection, row)


def record_finished(
    scope: Scope,
    fingerprint: Fingerprint,
    verdict: Verdict,
    response: StoredResponse,
    *,
    ttl: timedelta,
    using: str,
    sender: Sender = NOBODY,
) -> bool:
    """Insert the finished record, unless the scope is taken; whether it was inserted.

    On PostgreSQL ``INSERT ... ON CONFLICT DO NOTHING``; elsewhere the INSERT
    in a savepoint whose IntegrityError means "taken" (MariaDB's ``INSERT
    IGNORE`` would also hide other errors, turning them into warnings).
    Inside the view's transaction the unique index decides at this moment
    whether this request's work commits: a duplicate whose record is not
    committed yet makes this statement wait for it (up to the transaction's
    ``lock_timeout``), and one that committed makes it lose. Outside one it
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
        sender.principal,
        sender.credential,
        *sql.clock.later_params(connection, ttl),
        *sql.clock.now_params(connection),
        *sql.clock.now_params(connection),
    ]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(sql.insert_finished, params)
            return bool(cursor.rowcount == 1)
    try:
        with transaction.atomic(using=using), connection.cursor() as cursor:
            cursor.execute(sql.insert_finished, params)
    except IntegrityError:
        return False
    return True
