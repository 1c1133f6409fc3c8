"""The two conditional writes every other store function is built on.

A record changes hands only by compare-and-set on its fencing token, and
goes away only by a DELETE that repeats every condition it was chosen by:
between reading a record and writing it, another worker may have taken it
over, resolved it or extended its retention, and the write must then
change nothing.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import BooleanField, Q, QuerySet
from django.db.models.expressions import RawSQL

from django_idempotency._store import wait_bounds
from django_idempotency._store.database_time import DatabaseLater, DatabaseNow
from django_idempotency.models import IdempotencyRecord


def take_over_where(
    record: IdempotencyRecord,
    still: Q,
    *,
    owner: str,
    lease: timedelta | None,
    using: str,
    wait_at_most: timedelta | None = None,
) -> int | None:
    """Hand ``record`` to ``owner`` if it is still as seen; the new fencing token, or None.

    ``still`` is what else must hold (its state, an expired lease...); the
    fencing token the caller read is always part of the condition, so of
    two workers that saw the same record, one wins and the other matches
    no row. The new lease (none if ``lease`` is None) ends that long after
    the database's current time.

    ``wait_at_most`` (PostgreSQL; MySQL/MariaDB in whole seconds): how long
    the UPDATE may wait on another transaction's lock on the row before it
    raises ``OperationalError`` (SQLSTATE 55P03; error 1205 on InnoDB), the
    database's contention, never an outage. A request's takeover needs the
    bound: the row's holder
    may be a worker cut off from the database between two statements of its
    transaction (``begin_external()``'s, say), whose locks the server keeps
    until TCP keepalive or ``idle_in_transaction_session_timeout`` ends its
    session (``wait_bounds``).
    """
    token = record.fencing_token + 1
    matching = IdempotencyRecord.objects.using(using).filter(
        still, pk=record.pk, fencing_token=record.fencing_token
    )
    values = {
        "fencing_token": token,
        "lease_owner": owner[:255],
        "lease_expires_at": None if lease is None else DatabaseLater(lease),
        "updated_at": DatabaseNow(),
    }
    connection = connections[using]
    if wait_at_most is None or connection.vendor not in ("postgresql", "mysql"):
        updated = matching.update(**values)
    elif connection.vendor == "mysql":
        updated = _update_waiting_at_most_on_innodb(matching, values, wait_at_most, using=using)
    elif connection.get_autocommit() and not connection.in_atomic_block:
        # In the UPDATE's own WHERE: a condition is evaluated on the row
        # before the row is locked, so the timeout is in force when the lock
        # is waited for, and ends with the statement's own transaction.
        bound = RawSQL(
            f"{wait_bounds.at_most('lock_timeout')} IS NOT NULL",
            wait_bounds.at_most_params(wait_at_most),
            output_field=BooleanField(),
        )
        updated = matching.filter(bound).update(**values)
    else:
        updated = _update_in_callers_transaction(matching, values, wait_at_most, using=using)
    return token if updated else None


def _update_in_callers_transaction(
    matching: QuerySet[IdempotencyRecord], values: dict[str, Any], wait: timedelta, *, using: str
) -> int:
    """The bounded UPDATE inside a transaction someone else opened: their ``lock_timeout`` kept.

    A setting made with ``set_config(..., true)`` would last until their
    transaction ends. So: a savepoint (running out of time rolls back to it,
    and the setting with it), the bound, the UPDATE, then the caller's
    value back. Two more statements, on a path only takeovers take.
    """
    connection = connections[using]
    with transaction.atomic(using=using), connection.cursor() as cursor:
        cursor.execute(
            f"SELECT current_setting('lock_timeout'), {wait_bounds.at_most('lock_timeout')}",
            wait_bounds.at_most_params(wait),
        )
        callers = cursor.fetchone()[0]
        updated = matching.update(**values)
        cursor.execute(f"SELECT {wait_bounds.exactly('lock_timeout')}", [callers])
    return updated


def _update_waiting_at_most_on_innodb(
    matching: QuerySet[IdempotencyRecord], values: dict[str, Any], wait: timedelta, *, using: str
) -> int:
    """The bounded UPDATE on MySQL/MariaDB: ``innodb_lock_wait_timeout`` for it alone.

    InnoDB's bound is a session variable in whole seconds (at least 1), with
    no transaction-local form: set before the UPDATE, the session's own value
    put back after it whatever happens. A timeout (error 1205) rolls back
    the statement only, never the caller's transaction.
    """
    seconds = max(1, math.ceil(wait.total_seconds()))
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(
            "SET @idempotency_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
            "@@SESSION.innodb_lock_wait_timeout = LEAST(@@SESSION.innodb_lock_wait_timeout, %s)",
            [seconds],
        )
        try:
            return matching.update(**values)
        finally:
            cursor.execute("SET @@SESSION.innodb_lock_wait_timeout = @idempotency_lock_wait")


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
def delete_where(records: QuerySet[IdempotencyRecord], *, using: str) -> int:
    """Delete the records matching every condition of ``records``, in one statement."""
    return records._raw_delete(using) or 0
