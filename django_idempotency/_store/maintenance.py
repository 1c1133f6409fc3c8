"""The store's writes for recovery, retention, operators and key rotation.

Nobody owns the records these functions handle: they take them over (by
the same compare-and-set as a takeover by a request), delete them past
retention, or rewrite their stored responses, each write conditional on the
record still being as it was read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BooleanField, Case, F, Q, Value, When
from django.db.models.expressions import RawSQL

from django_idempotency._store import wait_bounds
from django_idempotency._store.claims import Claim, forgotten, lease_owner
from django_idempotency._store.conditional import delete_where, take_over_where
from django_idempotency._store.database_time import (
    DatabaseNow,
    database_now,
    shifted,
    with_read_time,
)
from django_idempotency._store.errors import is_serialization_failure
from django_idempotency._store.sealing import (
    UnreadableRecord,
    encrypt,
    reseal,
)
from django_idempotency._store.statements import statements_for
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import RESOLVED_STATES, UNRESOLVED_STATES, IdempotencyRecord
from django_idempotency.scope import Scope


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
        try:
            record, token, owner = _take_over_oldest_stale(connection, lease)
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
        if token is not None:
            record.fencing_token, record.lease_owner = token, owner
            # As seen by the SELECT, a moment before the UPDATE: never later
            # than the lease really ends.
            if record.read_at is not None:
                record.lease_expires_at = shifted(record.read_at, lease, using)
            scope = Scope(record.tenant, record.operation, record.key)
            return record, Claim(record.pk, token, scope, using, provider_key=record.provider_key)


#: How often recovery looks again after a serialization failure before giving up.
_MAX_CONFLICTS = 10


def _ended_by_the_server_if_cut_off() -> RawSQL:
    """A condition that has the server end this transaction if it idles past IN_FLIGHT_WAIT.

    Between recovery's SELECT ... FOR UPDATE and its UPDATE the row is
    locked, and the record's owner, late but alive, may be waiting to
    complete it. A recovery worker cut off from the database right there (a
    partition: no RST reaches the server) would keep that lock until TCP
    keepalive ends its session, minutes or hours; the gap is otherwise one
    round trip. In the SELECT's own WHERE, evaluated before any row is
    locked: no extra statement, and the setting ends with the transaction.
    """
    wait = max(idempotency_settings.IN_FLIGHT_WAIT, timedelta(seconds=1))
    return RawSQL(
        f"{wait_bounds.at_most('idle_in_transaction_session_timeout')} IS NOT NULL",
        wait_bounds.at_most_params(wait),
        output_field=BooleanField(),
    )


def _take_over_oldest_stale(
    connection: BaseDatabaseWrapper, lease: timedelta
) -> tuple[IdempotencyRecord | None, int | None, str]:
    using = connection.alias
    opens_its_transaction = connection.get_autocommit() and not connection.in_atomic_block
    with transaction.atomic(using=using):
        stale = IdempotencyRecord.objects.using(using).filter(
            state__in=UNRESOLVED_STATES, lease_expires_at__lte=DatabaseNow()
        )
        if opens_its_transaction and connection.vendor == "postgresql":
            stale = stale.filter(_ended_by_the_server_if_cut_off())
        stale = with_read_time(stale, "read_time")
        if connection.features.has_select_for_update_skip_locked:
            stale = stale.select_for_update(skip_locked=True)
        elif connection.features.has_select_for_update:
            stale = stale.select_for_update()
        record = stale.order_by("lease_expires_at").first()
        if record is None:
            return None, None, ""
        record.read_at = getattr(record, "read_time", None) or database_now(using)
        owner = lease_owner()
        token = take_over_where(
            record,
            Q(state__in=UNRESOLVED_STATES, lease_expires_at__lte=DatabaseNow()),
            owner=owner,
            lease=lease,
            using=using,
        )
    return record, token, owner


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
    if connection.vendor == "postgresql":
        start = after or _EPOCH  # timestamptz on PostgreSQL, whatever USE_TZ says
        with connection.cursor() as cursor:
            cursor.execute(statements_for(connection).purge, [start, limit])
            deleted, reached = cursor.fetchone()
        return deleted, reached
    expired = IdempotencyRecord.objects.using(using).filter(
        state__in=RESOLVED_STATES, expires_at__lte=DatabaseNow()
    )
    batch = expired if after is None else expired.filter(expires_at__gte=after)
    batch = batch.order_by("expires_at")[:limit]
    rows = list(batch.values_list("pk", "expires_at"))
    if not rows:
        return 0, after
    # The conditions again: a record could have been re-used in between.
    deleted = delete_where(expired.filter(pk__in=[pk for pk, _ in rows]), using=using)
    return deleted, rows[-1][1]


@dataclass(frozen=True)
class PurgedBatch:
    """What one batch of ``purge_to_tombstones_batch`` did."""

    #: Records deleted: tombstones past their own expiry, and records past
    #: retention and the tombstones' time both.
    deleted: int
    #: Records past retention turned into tombstones.
    tombstoned: int
    #: The latest expiry among them as the scan met it: where the next batch starts.
    reached: datetime | None


def purge_to_tombstones_batch(
    *, limit: int, using: str, tombstone_ttl: timedelta, after: datetime | None = None
) -> PurgedBatch:
    """``purge_expired_batch`` with tombstones (``TOMBSTONE_TTL``): up to ``limit`` records.

    Each resolved record past ``expires_at`` is either deleted (a tombstone
    past its own expiry, or a record past ``expires_at + tombstone_ttl``) or
    made a tombstone: its stored response dropped, ``expires_at`` moved on
    by ``tombstone_ttl``. So the scan on the expiry index meets each record
    once per change, never a tombstone before it is due to go. Pass
    ``reached`` back as ``after``, as for ``purge_expired_batch``.
    """
    connection = connections[using]
    if connection.vendor == "postgresql":
        start = after or _EPOCH
        seconds = tombstone_ttl.total_seconds()
        with connection.cursor() as cursor:
            cursor.execute(
                statements_for(connection).purge_to_tombstones,
                [start, limit, -seconds, seconds, -seconds],
            )
            deleted, tombstoned, reached = cursor.fetchone()
        return PurgedBatch(deleted, tombstoned, reached)
    expired = IdempotencyRecord.objects.using(using).filter(
        state__in=RESOLVED_STATES, expires_at__lte=DatabaseNow()
    )
    batch = expired if after is None else expired.filter(expires_at__gte=after)
    rows = list(batch.order_by("expires_at")[:limit].values_list("pk", "expires_at"))
    if not rows:
        return PurgedBatch(0, 0, after)
    # The conditions again, in each statement: a record could have been
    # re-used in between. They exclude each other: no row is both.
    chosen = expired.filter(pk__in=[pk for pk, _ in rows])
    deleted = delete_where(chosen.filter(forgotten(tombstone_ttl)), using=using)
    tombstoned = chosen.exclude(forgotten(tombstone_ttl)).update(
        response_body=None,
        response_headers=[],
        response_sealed=False,
        tombstone=True,
        expires_at=F("expires_at") + tombstone_ttl,
        updated_at=DatabaseNow(),
    )
    return PurgedBatch(deleted, tombstoned, rows[-1][1])


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
    token = take_over_where(
        record,
        Q(state=seen_state) & ~Q(lease_owner__gt="", lease_expires_at__gt=DatabaseNow()),
        owner=f"operator:{operator}",
        lease=lease if seen_state not in RESOLVED_STATES else None,
        using=using,
    )
    if token is None:
        return None
    record.fencing_token = token
    scope = Scope(record.tenant, record.operation, record.key)
    return Claim(record.pk, token, scope, using, provider_key=record.provider_key)


def extend_retention(record_ids: list[int], *, until: datetime, using: str) -> int:
    """Keep records recognisable until at least ``until``; never shortens.

    A record handed back to the client's retry (``claims.handed_back``: its
    lease ends with its retention) keeps its lease ending with it, or it
    would no longer be recognised as handed back and its retry refused 409.
    """
    handed_back = Q(
        state=IdempotencyRecord.State.CLAIMED,
        lease_owner="",
        lease_expires_at__gte=F("expires_at"),
    )
    return (
        IdempotencyRecord.objects.using(using)
        .filter(pk__in=record_ids, expires_at__lt=until)
        .update(
            # Before expires_at: MySQL and MariaDB assign left to right, and
            # the condition reads the expires_at the record had.
            lease_expires_at=Case(
                When(handed_back, then=Value(until)), default=F("lease_expires_at")
            ),
            expires_at=until,
            updated_at=DatabaseNow(),
        )
    )


def expire_leases(*, using: str) -> int:
    """End every unresolved record's lease now (``testing.expire_leases``)."""
    return (
        IdempotencyRecord.objects.using(using)
        .filter(state__in=UNRESOLVED_STATES)
        .update(lease_expires_at=DatabaseNow())
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
        if sealed:
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
