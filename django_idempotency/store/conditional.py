"""The two conditional writes every other store function is built on.

A record changes hands only by compare-and-set on its fencing token, and
goes away only by a DELETE that repeats every condition it was chosen by:
between reading a record and writing it, another worker may have taken it
over, resolved it or extended its retention, and the write must then
change nothing.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import connections
from django.db.models import BooleanField, Q, QuerySet
from django.db.models.expressions import RawSQL

from django_idempotency.models import IdempotencyRecord
from django_idempotency.store.database_time import DatabaseLater, DatabaseNow

__all__ = [
    "as_lock_timeout",
    "delete_where",
    "take_over_where",
]


def as_lock_timeout(wait: timedelta) -> str:
    """``wait`` as ``set_config('lock_timeout', ...)`` takes it: milliseconds, never 0."""
    return str(max(1, round(wait.total_seconds() * 1000)))


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

    ``wait_at_most`` (PostgreSQL, outside a transaction): how long the
    UPDATE may wait on another transaction's lock on the row before it
    raises ``OperationalError`` (SQLSTATE 55P03). A request's takeover needs
    the bound: the row's holder may be a worker cut off from the database
    between two statements of its transaction (``begin_external()``'s, say),
    whose locks the server keeps until TCP keepalive or
    ``idle_in_transaction_session_timeout`` ends its session.
    """
    token = record.fencing_token + 1
    matching = IdempotencyRecord.objects.using(using).filter(
        still, pk=record.pk, fencing_token=record.fencing_token
    )
    connection = connections[using]
    if (
        wait_at_most is not None
        and connection.vendor == "postgresql"
        and not connection.in_atomic_block
    ):
        # In the UPDATE's own WHERE: a condition is evaluated on the row
        # before the row is locked, so the timeout is in force when the lock
        # is waited for, and lasts only as long as this statement's own
        # transaction (autocommit). No extra round trip. Inside a caller's
        # transaction the setting would outlive the statement: not there.
        milliseconds = as_lock_timeout(wait_at_most)
        matching = matching.filter(
            RawSQL(
                "set_config('lock_timeout', %s, true) IS NOT NULL",
                (milliseconds,),
                output_field=BooleanField(),
            )
        )
    updated = matching.update(
        fencing_token=token,
        lease_owner=owner[:255],
        lease_expires_at=None if lease is None else DatabaseLater(lease),
        updated_at=DatabaseNow(),
    )
    return token if updated else None


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
