"""The hot path's SQL (store/statements.py) reads and writes what the ORM would.

Run on every database of the suite, under both settings of USE_TZ: some
backends convert datetimes only with it, and the converters are cached.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import _store as store
from django_idempotency._store.digests import FingerprintHasher
from django_idempotency._store.statements import claim_for, statements_for
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse, Verdict
from django_idempotency.scope import Scope
from tests.factories import RecordFactory
from tests.utils import raw_body

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
FIELDS = [field.attname for field in IdempotencyRecord._meta.concrete_fields]


def scope_of(record: IdempotencyRecord) -> Scope:
    return Scope(record.tenant, record.operation, record.key)


@pytest.mark.parametrize("use_tz", [True, False, True], ids=["tz", "naive", "tz-again"])
def test_a_looked_up_record_is_the_one_the_orm_reads(use_tz: bool) -> None:
    with override_settings(USE_TZ=use_tz):
        record = RecordFactory.create(
            response_headers=[["Content-Type", "application/json"], ["Location", "/é/1"]],
            response_body=b"\x00\xff binary",
            lease_expires_at=timezone.now(),
            provider_key="p" * 64,
        )
        found = store.lookup(scope_of(record), using="default")
        expected = IdempotencyRecord.objects.get(pk=record.pk)

    assert found is not None
    for name in FIELDS:
        value, wanted = getattr(found, name), getattr(expected, name)
        assert value == wanted, name
        assert type(value) is type(wanted), name
        if hasattr(wanted, "tzinfo"):
            assert (value.tzinfo is None) == (wanted.tzinfo is None), name


def test_a_looked_up_record_is_a_saved_instance_of_its_database() -> None:
    record = RecordFactory.create()

    found = store.lookup(scope_of(record), using="default")

    assert found is not None
    assert (found._state.db, found._state.adding) == ("default", False)
    assert found == record
    found.provider_operation_id = "op_1"
    found.save(update_fields=["provider_operation_id"])  # an UPDATE, as of any saved instance
    assert IdempotencyRecord.objects.get(pk=record.pk).provider_operation_id == "op_1"


def test_the_statements_of_django_db_connection_are_those_of_its_database() -> None:
    """``django.db.connection`` is a proxy (unhashable): asked through it, the same statements."""
    assert statements_for(connection) is statements_for(connections["default"])


def test_init_signal_receivers_get_the_records_the_store_reads() -> None:
    """Records are built without ``Model.__init__`` only while nothing listens to its signals."""
    from django.db.models.signals import post_init

    record = RecordFactory.create()
    seen: list[object] = []

    def receiver(sender: type, instance: object, **kwargs: object) -> None:
        seen.append(instance)

    post_init.connect(receiver, sender=IdempotencyRecord)
    try:
        found = store.lookup(scope_of(record), using="default")
    finally:
        post_init.disconnect(receiver, sender=IdempotencyRecord)
    unheard = store.lookup(scope_of(record), using="default")

    assert seen == [found]
    assert unheard == found


@pytest.mark.parametrize("use_tz", [True, False, True], ids=["tz", "naive", "tz-again"])
@pytest.mark.parametrize("init_receiver", [False, True], ids=["direct", "from_db"])
def test_a_record_looked_up_to_answer_defers_only_what_answering_does_not_read(
    use_tz: bool, init_receiver: bool
) -> None:
    """What is read equals the ORM's; what is not is deferred, and the ORM loads it on access."""
    from django.db.models.signals import post_init

    def receiver(sender: type, instance: object, **kwargs: object) -> None:
        pass

    unread = {"created_at", "updated_at", "principal_digest", "credential_digest"}
    unread.add("provider_operation_id")
    with override_settings(USE_TZ=use_tz):
        record = RecordFactory.create(
            response_headers=[["Content-Type", "application/json"]],
            response_body=b"\x00\xff",
            lease_expires_at=timezone.now(),
            provider_operation_id="op_7",
            principal_digest="p" * 20,
        )
        if init_receiver:
            post_init.connect(receiver, sender=IdempotencyRecord)
        try:
            found = store.lookup_to_answer(scope_of(record), using="default")
        finally:
            post_init.disconnect(receiver, sender=IdempotencyRecord)
        expected = IdempotencyRecord.objects.get(pk=record.pk)

        assert found is not None
        assert found.get_deferred_fields() == unread
        # The database's time of the read, where the database keeps the time.
        assert (found.read_at is not None) == statements_for(connection).find_reads_time
        for name in set(FIELDS) - unread:
            value, wanted = getattr(found, name), getattr(expected, name)
            assert (value, type(value)) == (wanted, type(wanted)), name
        assert found.provider_operation_id == "op_7"  # loaded now, by the ORM
        assert found.created_at == expected.created_at


@pytest.mark.postgres  # elsewhere a claim is the ORM's INSERT, its times computed apart
@pytest.mark.parametrize("in_transaction", [False, True], ids=["autocommit", "atomic"])
def test_a_claim_spells_its_lease_and_retention_exactly(in_transaction: bool) -> None:
    """Two views' durations, one connection: each claim's record ends where its own say."""
    hasher = FingerprintHasher()
    hasher.update("same input")
    times = []
    durations = [(timedelta(seconds=90), timedelta(hours=3))]
    durations.append((timedelta(seconds=7.5), timedelta(days=40)))
    for lease, ttl in durations:
        scope = Scope("anonymous", "tests.spelled", f"{lease}-{ttl}")
        block = transaction.atomic() if in_transaction else contextlib.nullcontext()
        with block:
            held = store.claim_or_take_over(
                scope, hasher.finish(), ttl=ttl, lease=lease, using="default"
            ).held
        assert held is not None
        record = IdempotencyRecord.objects.get(pk=held.record_id)
        assert record.lease_expires_at is not None
        lease_and_retention = (record.lease_expires_at, record.expires_at)
        times.append(tuple(end - record.created_at for end in lease_and_retention))

    assert times == [
        (timedelta(seconds=90), timedelta(hours=3)),
        (timedelta(seconds=7.5), timedelta(days=40)),
    ]


def test_claim_statements_made_for_ever_new_durations_are_not_kept_without_end() -> None:
    statements = statements_for(connection)
    made = [
        claim_for(statements, timedelta(seconds=seconds), timedelta(hours=1), None)
        for seconds in range(1, 201)
    ]

    assert len(statements.claims) <= 64
    assert len(set(made)) == 200
    assert "interval '0 hours 200.000000 seconds'" in made[-1]
    assert claim_for(statements, timedelta(seconds=200), timedelta(hours=1), None) is made[-1]


@pytest.mark.parametrize("use_tz", [True, False])
def test_completion_stores_the_response_and_never_shortens_retention(use_tz: bool) -> None:
    with override_settings(USE_TZ=use_tz):
        now = timezone.now()
        extended = RecordFactory.create(state=State.CLAIMED, expires_at=now + timedelta(days=30))
        fresh = RecordFactory.create(state=State.CLAIMED, expires_at=now + timedelta(minutes=1))
        stored = StoredResponse(201, [["Location", "/charges/ü"]], b"\x00body")
        for record in (extended, fresh):
            held = store.Claim(record.pk, record.fencing_token, scope_of(record), "default")
            store.complete(held, Verdict.COMPLETED, stored, ttl=timedelta(hours=24))
        extended.refresh_from_db()
        fresh.refresh_from_db()

    assert extended.expires_at == now + timedelta(days=30)
    assert now + timedelta(hours=24) <= fresh.expires_at <= now + timedelta(hours=25)
    for record in (extended, fresh):
        assert record.state == State.COMPLETED and record.lease_expires_at is None
        assert record.response_headers == [["Location", "/charges/ü"]]
        assert raw_body(record) == b"\x00body"


@pytest.mark.parametrize("use_tz", [True, False])
def test_the_purge_works_under_either_time_zone_setting(use_tz: bool) -> None:
    from django_idempotency import purge

    with override_settings(USE_TZ=use_tz):
        gone = [
            RecordFactory.create(expires_at=timezone.now() - timedelta(minutes=i))
            for i in (1, 2, 3)
        ]
        kept = RecordFactory.create()
        report = purge.purge_expired_records(batch_size=2, batch_seconds=60)

    assert (report.deleted, report.batches) == (3, 2)
    remaining = set(IdempotencyRecord.objects.values_list("pk", flat=True))
    assert remaining == {kept.pk} and not remaining & {record.pk for record in gone}


def test_claim_durations_are_spelled_so_postgresql_14_can_read_them() -> None:
    """Django 5.2 (supported here) runs on PostgreSQL 14, whose interval input reads
    each number of a literal as a 32-bit int (DecodeInterval's strtoint: "interval
    field value out of range" past 2147483647). The default retention, 24 hours, is
    86,400,000,000 microseconds: spelled as one number, every claim fails there."""
    import re

    from django_idempotency.conf import idempotency_settings

    sql = claim_for(
        statements_for(connection),
        idempotency_settings.LEASE,
        idempotency_settings.TTL,
        idempotency_settings.IN_FLIGHT_WAIT,
    )
    literals = re.findall(r"interval '([^']*)'", sql)
    numbers = [int(n) for literal in literals for n in re.findall(r"-?\d+", literal)]

    assert literals
    assert all(abs(number) <= 2**31 - 1 for number in numbers), literals


HOUR = timedelta(hours=1)


@pytest.mark.postgres
def test_a_wait_bound_longer_than_postgresqls_largest_lock_timeout_is_that_largest() -> None:
    """An ``IN_FLIGHT_WAIT`` of 40 days: claims still run, bounded by 24.8 days."""
    hasher = FingerprintHasher()
    hasher.update("same input")
    scope = Scope("anonymous", "tests.longest-wait", "k")
    with override_settings(IDEMPOTENCY={"IN_FLIGHT_WAIT": timedelta(days=40)}):
        first, again = (
            store.claim_or_take_over(
                scope, hasher.finish(), ttl=HOUR, lease=timedelta(minutes=2), using="default"
            )
            for _ in range(2)
        )

    assert first.held is not None
    assert again.held is None and again.record is not None


def _claimed(name: str) -> store.Claim:
    """A claim of this process's, for a scope named ``name``."""
    hasher = FingerprintHasher()
    hasher.update("same input")
    held = store.claim(
        Scope("anonymous", "tests.complete", name),
        hasher.finish(),
        ttl=HOUR,
        lease=HOUR,
        using="default",
    )
    assert held is not None
    return held


@pytest.mark.parametrize("state", [State.CLAIMED, State.IN_PROGRESS, State.UNCERTAIN])
def test_a_completion_completes_any_unresolved_record_of_its_owner(state: str) -> None:
    held = _claimed(state)
    IdempotencyRecord.objects.filter(pk=held.record_id).update(state=state)

    store.complete(held, Verdict.COMPLETED, StoredResponse(201, [], b"{}"), ttl=HOUR)

    assert IdempotencyRecord.objects.get(pk=held.record_id).state == State.COMPLETED


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED])
def test_a_completion_leaves_a_record_resolved_meanwhile_as_it_is(state: str) -> None:
    """Resolved by somebody else with the owner's token unchanged: the owner writes nothing."""
    from django_idempotency.exceptions import StaleOwner

    held = _claimed(state)
    IdempotencyRecord.objects.filter(pk=held.record_id).update(state=state, response_status=299)

    with pytest.raises(StaleOwner):
        store.complete(held, Verdict.COMPLETED, StoredResponse(201, [], b"{}"), ttl=HOUR)

    record = IdempotencyRecord.objects.get(pk=held.record_id)
    assert (record.state, record.response_status, record.fencing_token) == (state, 299, 1)
