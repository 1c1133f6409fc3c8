"""Claims: how a key is won, taken over, or found held by somebody else.

The database's unique constraint on (tenant, operation, key) is the only
arbiter of who runs an operation; every function here either wins it (a
``Claim`` with a fencing token) or reads the record that holds it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models import F, Q

from django_idempotency._store.conditional import delete_where, take_over_where
from django_idempotency._store.connections import commit_now_alias
from django_idempotency._store.database_time import (
    DatabaseLater,
    DatabaseNow,
    clock_of,
    instant,
    time_left,
)
from django_idempotency._store.digests import NOBODY, Fingerprint, Sender
from django_idempotency._store.statements import (
    ANSWERING,
    claim_for,
    record_from_row,
    statements_for,
)
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import RESOLVED_STATES, IdempotencyRecord
from django_idempotency.scope import Scope

logger = logging.getLogger("django_idempotency")

State = IdempotencyRecord.State
_HOST = socket.gethostname()
#: How often a key may be found taken yet claimable (released, expired or
#: taken over in between) before the caller is told it is in flight rather
#: than looping.
MAX_RECLAIMS = 3
ZERO = timedelta(0)


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
    """``host:pid:thread``: who holds a lease, as recovery and operators see it."""
    owner = _this_thread.owner
    if owner is None:
        owner = _this_thread.owner = f"{_HOST}:{os.getpid()}:{threading.get_ident()}"[:255]
    return owner


class _ThisThread(threading.local):
    #: This thread's lease owner, made at its first claim: a system call
    #: (getpid) and a format per claim otherwise. Gone with the thread.
    owner: str | None = None


_this_thread = _ThisThread()


def _new_process() -> None:
    # A forked child's thread keeps the parent's thread-local values, whose
    # pid is the parent's.
    global _this_thread
    _this_thread = _ThisThread()


os.register_at_fork(after_in_child=_new_process)


def claim(
    scope: Scope,
    fingerprint: Fingerprint,
    *,
    ttl: timedelta,
    lease: timedelta,
    using: str,
    sender: Sender = NOBODY,
) -> Claim | None:
    """Insert a CLAIMED record in one atomic statement; ``None`` if the key is taken.

    The database's unique constraint on (tenant, operation, key) is the
    arbiter: on PostgreSQL ``INSERT ... ON CONFLICT DO NOTHING RETURNING``,
    elsewhere an INSERT whose IntegrityError means "lost" (in a savepoint inside
    a caller's transaction).
    Never SELECT-then-INSERT. Outside a transaction the statement commits at
    once; inside one (the caller's), it commits with it.
    """
    connection = connections[using]
    committed = not connection.in_atomic_block
    if connection.vendor == "postgresql":
        sql = claim_for(statements_for(connection), lease, ttl, None)
        # In a caller's transaction the INSERT may wait on a duplicate and
        # time out (lock_timeout, a deadlock): a savepoint keeps that from
        # aborting the caller's transaction.
        savepoint = transaction.atomic(using=using) if not committed else nullcontext()
        with savepoint, connection.cursor() as cursor:
            cursor.execute(sql, _claim_params(scope, fingerprint, sender))
            row = cursor.fetchone()
        return None if row is None else Claim(row[0], 1, scope, using, committed)
    # A savepoint only in a caller's transaction (an IntegrityError would
    # otherwise leave it to roll back): in autocommit the INSERT is a
    # transaction of its own, and BEGIN and COMMIT around it would be two
    # more round trips for every claim and every replay.
    savepoint = transaction.atomic(using=using) if not committed else nullcontext()
    try:
        with savepoint:
            record = IdempotencyRecord.objects.using(using).create(
                tenant=scope.tenant,
                operation=scope.operation,
                key=scope.key,
                fingerprint=fingerprint.stored,
                state=State.CLAIMED,
                lease_owner=lease_owner(),
                lease_expires_at=DatabaseLater(lease),
                fencing_token=1,
                principal_digest=sender.principal,
                credential_digest=sender.credential,
                created_at=DatabaseNow(),
                updated_at=DatabaseNow(),
                expires_at=DatabaseLater(ttl),
            )
    except IntegrityError:
        return None
    return Claim(record.pk, 1, scope, using, committed)


def claim_or_find(
    scope: Scope,
    fingerprint: Fingerprint,
    *,
    ttl: timedelta,
    lease: timedelta,
    using: str,
    sender: Sender = NOBODY,
) -> tuple[Claim | None, IdempotencyRecord | None]:
    """``claim()``, and when the key is taken, the record that holds it.

    Two statements for a replay, one for a first execution. (A single
    ``WITH claimed AS (INSERT ...) SELECT ...`` statement was measured: the
    planning of the CTE cost a first execution more than it saved a replay.)
    Both can be ``None``: the holder released the record in between.
    """
    connection = connections[using]
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        held = claim(scope, fingerprint, ttl=ttl, lease=lease, using=using, sender=sender)
        return held, None if held else lookup_to_answer(scope, using=using)
    # claim() and lookup_to_answer() in autocommit, on one cursor: a Django
    # cursor costs about 10 us of CPU to open, a tenth of a replay's own Python.
    statements = statements_for(connection)
    # The INSERT waits when another transaction holds an uncommitted version
    # of this scope's row: a duplicate's optimistic
    # claim, or recovery deleting a released claim while its reconciler's
    # writes wait on a lock of their own. That holder may be a worker cut
    # off from the database: bounded like any wait on a duplicate, in the
    # statement itself (its own transaction: the setting ends with it).
    sql = claim_for(statements, lease, ttl, idempotency_settings.IN_FLIGHT_WAIT)
    with connection.cursor() as cursor:
        cursor.execute(sql, _claim_params(scope, fingerprint, sender))
        claimed = cursor.fetchone()
        if claimed is not None:
            return Claim(claimed[0], 1, scope, using), None
        scoped = _scope_params(scope)
        cursor.execute(statements.find_to_answer, scoped)
        row = cursor.fetchone()
    return None, None if row is None else record_from_row(connection, row, ANSWERING, scoped)


def _scope_params(scope: Scope) -> tuple[str, str, str]:
    return scope.tenant, scope.operation, scope.key


def _claim_params(scope: Scope, fingerprint: Fingerprint, sender: Sender) -> list[Any]:
    return [
        scope.tenant,
        scope.operation,
        scope.key,
        fingerprint.stored,
        lease_owner(),
        sender.principal,
        sender.credential,
    ]


def take_over(
    record: IdempotencyRecord, scope: Scope, *, lease: timedelta, using: str
) -> Claim | None:
    """Claim a CLAIMED record whose owner's lease ran out, by compare-and-set.

    A CLAIMED owner has begun no external call, and its local work commits
    only with its completion: if it died, that work rolled back with it; if
    it is merely slow, its completion will find the fencing token moved on
    and roll back too. So the record can be run again, once. A record
    ``handed_back`` by a reconciler (``RetryFrom``) is taken at once: its
    kept steps tell the view what not to call again.
    """
    token = take_over_where(
        record,
        Q(state=State.CLAIMED)
        & (
            Q(lease_expires_at__lte=DatabaseNow())
            # Handed back (``handed_back``): the same test, in SQL.
            | Q(lease_owner="", lease_expires_at__gte=F("expires_at"))
        ),
        owner=lease_owner(),
        lease=lease,
        using=using,
        # A retry waits no longer on the row than on a duplicate in flight;
        # running out is contention: 409 with Retry-After, never a 503.
        wait_at_most=idempotency_settings.IN_FLIGHT_WAIT,
    )
    if token is None:
        return None
    if handed_back(record):
        logger.info(
            "Took over record %s (%s): its reconciler handed it back to the retry (RetryFrom).",
            record.pk,
            scope,
        )
    else:
        logger.warning(
            "Took over record %s (%s): its owner's lease ran out at %s.",
            record.pk,
            scope,
            record.lease_expires_at,
        )
    committed = not connections[using].in_atomic_block
    return Claim(record.pk, token, scope, using, committed, record.provider_key)


@dataclass(frozen=True)
class Attempt:
    """What ``claim_or_take_over`` came to: the key won, or who holds it."""

    held: Claim | None = None
    #: When the key is not won: the record that holds it (another input's, a
    #: live resolved one, or one in flight).
    record: IdempotencyRecord | None = None
    #: When neither: the state of the record last seen while the key kept
    #: changing hands ("unknown" if it vanished each time).
    last_seen: str = "unknown"


def claim_or_take_over(
    scope: Scope,
    fingerprint: Fingerprint,
    *,
    ttl: timedelta,
    lease: timedelta,
    using: str,
    sender: Sender = NOBODY,
) -> Attempt:
    """Claim the key, or take it over where that is safe; else find who holds it.

    The one loop that views and tasks share. A resolved record past its
    retention is deleted and the key claimed anew; a CLAIMED record of this
    very input whose owner's lease ran out is taken over. Otherwise the
    record that holds the key is returned. Neither, when the key kept
    changing hands meanwhile, ``MAX_RECLAIMS`` times. A new record keeps
    ``sender`` (digests of who sent the request); one taken over keeps the
    sender that created it.
    """
    last_seen = "unknown"
    for _ in range(1 + MAX_RECLAIMS):
        held, record = claim_or_find(
            scope, fingerprint, ttl=ttl, lease=lease, using=using, sender=sender
        )
        if held is not None:
            return Attempt(held)
        if record is None:
            continue  # released between the claim and the lookup
        last_seen = record.state
        if past_retention(record):
            discard_expired(record, using=using)
            continue
        if not abandoned(record, fingerprint):
            return Attempt(record=record)
        held = take_over(record, scope, lease=lease, using=using)
        if held is not None:
            return Attempt(held)
    return Attempt(last_seen=last_seen)


def past_retention(record: IdempotencyRecord) -> bool:
    """A resolved record past retention: its key may start a new operation.

    With ``TOMBSTONE_TTL`` set, only once the tombstone's time is over too:
    a tombstone's own ``expires_at``, or, for a record the purge has not
    turned into one yet, ``expires_at + TOMBSTONE_TTL``, so that the claim
    and the purge agree whichever ran first. Judged at the database's time
    of the lookup that read ``record``.
    """
    return record.is_resolved and _left(record, record.expires_at) + _tombstone_time(record) <= ZERO


def kept_as_tombstone(record: IdempotencyRecord) -> bool:
    """A resolved record past retention whose key is still refused (``TOMBSTONE_TTL``).

    A tombstone, or a record past ``expires_at`` the purge has not turned
    into one yet: either way its response is no longer replayed, and a
    retry is refused as ``idempotency_key_expired``. At the lookup's time.
    """
    if not record.is_resolved:
        return False
    left = _left(record, record.expires_at)
    if record.tombstone:
        return left > ZERO
    return left <= ZERO < left + _tombstone_time(record)


def _tombstone_time(record: IdempotencyRecord) -> timedelta:
    """How long after ``expires_at`` a resolved record's key may start anew."""
    ttl = idempotency_settings.TOMBSTONE_TTL
    if record.tombstone or ttl is None:
        # A tombstone's expires_at was moved on by the purge; one kept while
        # TOMBSTONE_TTL was on still refuses until then once it is off.
        return ZERO
    return ttl


def abandoned(record: IdempotencyRecord, fingerprint: Fingerprint) -> bool:
    """A claim for this very input whose owner's lease ran out (at the lookup's time).

    Or one a reconciler handed back to the client's retry (``handed_back``),
    whatever its lease.
    """
    return (
        record.state == State.CLAIMED
        and fingerprint.matches(record.fingerprint)
        and record.lease_expires_at is not None
        and (handed_back(record) or _left(record, record.lease_expires_at) <= ZERO)
    )


def handed_back(record: IdempotencyRecord) -> bool:
    """A CLAIMED record a reconciler handed back to the client's retry (``RetryFrom``).

    No lease owner, and a lease that ends with the record's retention
    (``owner_writes.hand_back``): no other write leaves a CLAIMED record
    so, since a live owner always names itself, for a lease far shorter
    than the retention.
    """
    using = record._state.db or "default"
    return (
        record.state == State.CLAIMED
        and record.lease_owner == ""
        and record.lease_expires_at is not None
        and instant(record.lease_expires_at, using) >= instant(record.expires_at, using)
    )


def _left(record: IdempotencyRecord, until: datetime) -> timedelta:
    """From the database's time when ``lookup()`` read ``record`` to ``until`` (this host's
    time on a host clock), between instants (``database_time.instant``)."""
    if record.read_at is None and not clock_of(connections[record._state.db or "default"]).host:
        # A record read another way carries no database time: judging it on
        # this host's clock is exactly what must not happen.
        raise ValueError(f"record {record.pk} was not read by store.lookup(): no database time")
    return time_left(record, until)


def discard_expired(record: IdempotencyRecord, *, using: str) -> bool:
    """Delete a resolved record past its retention so its key can start anew.

    With ``TOMBSTONE_TTL`` set, only past the tombstone's time too, as
    ``past_retention()`` judges it, in the statement itself.
    """
    deleted = delete_where(
        IdempotencyRecord.objects.filter(expired_and_unchanged(record)), using=using
    )
    return bool(deleted)


def expired_and_unchanged(record: IdempotencyRecord) -> Q:
    """``record``, if it is still resolved, past retention and not taken over since."""
    unchanged = Q(pk=record.pk, fencing_token=record.fencing_token, state__in=RESOLVED_STATES)
    return unchanged & forgotten(idempotency_settings.TOMBSTONE_TTL)


def forgotten(tombstone_ttl: timedelta | None) -> Q:
    """Records whose key may start anew, if resolved: past retention and any tombstone's time.

    Without tombstones: past ``expires_at``. With them: a tombstone past its
    own ``expires_at``, or any record past ``expires_at + tombstone_ttl``.
    """
    if tombstone_ttl is None:
        return Q(expires_at__lte=DatabaseNow())
    return Q(expires_at__lte=DatabaseLater(-tombstone_ttl)) | Q(
        tombstone=True, expires_at__lte=DatabaseNow()
    )


def lookup(scope: Scope, *, using: str) -> IdempotencyRecord | None:
    """The record holding ``scope``, if any: one SELECT, no lock.

    The record's ``read_at`` is the database's time of that SELECT.
    """
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute(statements_for(connection).find, _scope_params(scope))
        row = cursor.fetchone()
    return None if row is None else record_from_row(connection, row)


def lookup_to_answer(scope: Scope, *, using: str) -> IdempotencyRecord | None:
    """``lookup()``, reading only what a request's answer is decided and given from.

    The record's creation and update times, its sender's digests and its
    provider's operation id are deferred fields: read by the ORM, with one
    more query, if anything asks for them.
    """
    connection = connections[using]
    with connection.cursor() as cursor:
        scoped = _scope_params(scope)
        cursor.execute(statements_for(connection).find_to_answer, scoped)
        row = cursor.fetchone()
    return None if row is None else record_from_row(connection, row, ANSWERING, scoped)
