"""Leases and retention are judged by the records database's clock, never this host's.

Each test shifts this process's clock (``django.utils.timezone.now``, which
every time Django and the package compute goes through) as a host with a
drifting clock would see it, and checks that nothing about leases or
retention moves with it. On the code that read this host's clock, each of these failed:
a host ten minutes ahead took the running claim over, recovery took a live
record, the purge deleted unexpired records.

The same is proven with real processes under libfaketime in
``tests/live/test_clock_skew_live.py``. SQLite's clock is the host's (one
host serves a SQLite file), so these run on PostgreSQL and MariaDB.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection, connections, transaction
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import _store as store
from django_idempotency import recovery
from django_idempotency._protection.answers import until_recovery
from django_idempotency._protection.retention import seconds_left
from django_idempotency._store.database_time import (
    DatabaseLater,
    database_later,
    database_now,
    uses_host_clock,
)
from django_idempotency._store.digests import Fingerprint, FingerprintHasher
from django_idempotency._store.statements import FIELD_NAMES, record_from_row, statements_for
from django_idempotency.admin import stuck
from django_idempotency.models import IdempotencyRecord
from django_idempotency.purge import purge_expired_records
from django_idempotency.scope import Scope
from tests.factories import RecordFactory, UserFactory
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _database_clock() -> None:
    """Asked per test: the configuration (USE_TZ, TIME_ZONE) decides on MySQL."""
    if uses_host_clock(connection):
        pytest.skip("this database's times are the host's: SQLite, or MySQL storing a zone")


State = IdempotencyRecord.State
URL = "/api-view/charges"
CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"
LEASE = timedelta(minutes=2)


@contextlib.contextmanager
def host_clock(offset: timedelta) -> Iterator[None]:
    """This process's clock runs ``offset`` off; the database's does not."""
    real = timezone.now
    with mock.patch("django.utils.timezone.now", lambda: real() + offset):
        yield


def fingerprint_of(text: str) -> Fingerprint:
    hasher = FingerprintHasher()
    hasher.update(text)
    return hasher.finish()


def running_claim(key: str) -> IdempotencyRecord:
    """A request's record as its owner leaves it while it works: CLAIMED, its lease running."""
    response = post(APIClient(), URL, {"amount": 5}, key)
    assert response.status_code == 201
    record = IdempotencyRecord.objects.get(key=key)
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        state=State.CLAIMED,
        lease_owner="owner:1:1",
        lease_expires_at=DatabaseLater(LEASE),
        response_status=None,
        response_body=None,
        response_headers=[],
    )
    return IdempotencyRecord.objects.get(pk=record.pk)


@pytest.mark.parametrize("skew", [timedelta(minutes=10), timedelta(days=3)])
def test_a_duplicate_on_a_host_ahead_is_in_flight_not_a_takeover(skew: timedelta) -> None:
    key = str(uuid.uuid4())
    running = running_claim(key)

    with host_clock(skew):
        duplicate = post(APIClient(), URL, {"amount": 5}, key)

    assert duplicate.status_code == 409, duplicate.content
    assert duplicate.json()["code"] == "idempotency_request_in_progress"
    after = IdempotencyRecord.objects.get(pk=running.pk)
    assert (after.fencing_token, after.state) == (1, State.CLAIMED)
    assert Charge.objects.filter(tenant=running.tenant).count() == 1


def test_an_owner_behind_takes_a_lease_on_the_database_clock() -> None:
    """An owner 10 minutes behind: its lease would have ended 8 minutes ago on its own clock."""
    key = str(uuid.uuid4())
    scope = Scope("anonymous", "tests.owner-behind", key)
    fingerprint = fingerprint_of("same input")
    with host_clock(-timedelta(minutes=10)):
        held = store.claim(scope, fingerprint, ttl=timedelta(hours=1), lease=LEASE, using="default")
    assert held is not None

    attempt = store.claim_or_take_over(
        scope, fingerprint, ttl=timedelta(hours=1), lease=LEASE, using="default"
    )

    assert attempt.held is None
    assert attempt.record is not None and attempt.record.fencing_token == 1
    assert attempt.record.read_at is not None
    assert attempt.record.lease_expires_at is not None
    remaining = attempt.record.lease_expires_at - attempt.record.read_at
    assert LEASE - timedelta(seconds=30) < remaining <= LEASE


def test_an_abandoned_claim_is_taken_over_when_the_database_says_its_lease_ran_out() -> None:
    """The other side: a host 10 minutes behind still takes over a lease that really ended."""
    key = str(uuid.uuid4())
    running = running_claim(key)
    IdempotencyRecord.objects.filter(pk=running.pk).update(
        lease_expires_at=DatabaseLater(-timedelta(seconds=1))
    )

    with host_clock(-timedelta(minutes=10)):
        retry = post(APIClient(), URL, {"amount": 5}, key)

    assert retry.status_code == 201, retry.content
    assert IdempotencyRecord.objects.get(pk=running.pk).fencing_token == 2


def test_renewals_and_intents_extend_the_lease_from_the_database_clock() -> None:
    scope = Scope("anonymous", "tests.renewal", str(uuid.uuid4()))
    held = store.claim(
        scope, fingerprint_of("x"), ttl=timedelta(hours=1), lease=LEASE, using="default"
    )
    assert held is not None
    writes: list[Callable[[], None]] = [
        lambda: store.renew_lease(held, lease=LEASE),
        lambda: store.begin_external(held, "p" * 64, lease=LEASE),
        lambda: store.set_provider_operation(held, "op_1", lease=LEASE),
    ]
    for write in writes:
        with host_clock(-timedelta(minutes=10)):
            write()
        lease_ends = IdempotencyRecord.objects.get(pk=held.record_id).lease_expires_at
        assert lease_ends is not None
        assert lease_ends > database_now("default") + LEASE - timedelta(seconds=30)


def test_recovery_on_a_host_ahead_takes_nothing_whose_lease_runs() -> None:
    record = RecordFactory.create(
        state=State.IN_PROGRESS,
        lease_owner="owner:1:1",
        response_status=None,
        response_body=None,
        response_headers=[],
    )
    IdempotencyRecord.objects.filter(pk=record.pk).update(lease_expires_at=DatabaseLater(LEASE))

    with host_clock(timedelta(minutes=10)):
        report = recovery.recover_stale_records(batch_size=10)
        stale = recovery.stale_records(limit=10)
        leased, _first_end = recovery.leased_records()
        stuck_now = list(IdempotencyRecord.objects.filter(stuck()))

    assert (report.handled, report.stale, stale, leased, stuck_now) == (0, 0, [], 1, [])
    after = IdempotencyRecord.objects.get(pk=record.pk)
    assert (after.state, after.fencing_token, after.lease_owner) == (
        State.IN_PROGRESS,
        1,
        "owner:1:1",
    )


def test_a_purge_run_days_ahead_deletes_nothing_unexpired() -> None:
    kept = RecordFactory.create_batch(3, state=State.COMPLETED)
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(timedelta(hours=24)))
    expired = RecordFactory.create(state=State.COMPLETED)
    IdempotencyRecord.objects.filter(pk=expired.pk).update(
        expires_at=DatabaseLater(-timedelta(seconds=1))
    )

    with host_clock(timedelta(days=3)):
        purged = purge_expired_records(batch_size=100)

    assert purged.deleted == 1
    assert sorted(IdempotencyRecord.objects.values_list("pk", flat=True)) == sorted(
        record.pk for record in kept
    )


def test_a_key_past_retention_is_judged_on_the_database_clock() -> None:
    """Five hours ahead, a record kept for a day still replays; it is not discarded."""
    key = str(uuid.uuid4())
    first = post(APIClient(), URL, {"amount": 5}, key)
    with host_clock(timedelta(hours=5)):
        replay = post(APIClient(), URL, {"amount": 5}, key)
    assert replay.status_code == first.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_the_completion_sets_retention_from_the_database_clock() -> None:
    key = str(uuid.uuid4())
    with host_clock(timedelta(days=3)):
        assert post(APIClient(), URL, {"amount": 5}, key).status_code == 201
    record = IdempotencyRecord.objects.get(key=key)
    ttl = timedelta(hours=24)  # tests/settings.py
    assert record.expires_at < database_later("default", ttl) + timedelta(seconds=5)
    assert record.created_at < database_now("default") + timedelta(seconds=5)


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="now() vs statement_timestamp() is PostgreSQL's"
)
def test_times_are_the_statement_s_not_the_transaction_s() -> None:
    """Inside a long transaction (a caller's), ``now()`` is its start."""
    scope = Scope("anonymous", "tests.long-transaction", str(uuid.uuid4()))
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT now(), pg_sleep(0.3)")
            began = cursor.fetchone()[0]
        held = store.claim(scope, fingerprint_of("y"), ttl=LEASE, lease=LEASE, using="default")
        assert held is not None
        found = store.lookup(scope, using="default")
    assert found is not None and found.read_at is not None
    assert found.created_at - began >= timedelta(seconds=0.3)
    assert found.read_at - began >= timedelta(seconds=0.3)


def test_a_lookup_reads_the_database_time_in_the_same_statement() -> None:
    key = str(uuid.uuid4())
    post(APIClient(), URL, {"amount": 5}, key)
    scope_record = IdempotencyRecord.objects.get(key=key)
    scope = Scope(scope_record.tenant, scope_record.operation, key)
    with host_clock(timedelta(days=3)), CaptureQueriesContext(connection) as queries:
        found = store.lookup(scope, using="default")
    assert len(queries) == 1
    assert found is not None and found.read_at is not None
    assert abs(found.read_at - database_now("default")) < timedelta(seconds=5)
    assert not uses_host_clock(connection)


def test_the_admin_judges_leases_and_expiry_on_the_database_clock() -> None:
    """Two hours ahead: nothing is stuck or expired yet, and the lease still shows as held."""
    soon = RecordFactory.create(state=State.COMPLETED)
    IdempotencyRecord.objects.filter(pk=soon.pk).update(
        expires_at=DatabaseLater(timedelta(minutes=30))
    )
    running = running_claim(str(uuid.uuid4()))
    admin = Client()
    admin.force_login(UserFactory.create(is_staff=True, is_superuser=True))

    with host_clock(timedelta(hours=2)):
        expired = admin.get(CHANGELIST, {"expires": "expired"})
        within_hour = admin.get(CHANGELIST, {"expires": "hour"})
        stuck_page = admin.get(CHANGELIST, {"state": "stuck"})
        record_page = admin.get(f"{CHANGELIST}{running.pk}/change/")

    assert expired.context["cl"].result_count == 0
    assert [record.pk for record in within_hour.context["cl"].result_list] == [soon.pk]
    assert stuck_page.context["cl"].result_count == 0
    assert list(IdempotencyRecord.objects.filter(stuck())) == []
    assert record_page.status_code == 200
    assert record_page.context["adminform"].form.instance.read_at is not None


# -- daylight saving under USE_TZ=False (PostgreSQL) ------------------------------------

#: New York's clocks go back from 01:59:59 EDT to 01:00 EST: that hour's wall times twice.
FALL_BACK = datetime(2026, 11, 1, 6, 0, tzinfo=UTC)
#: And forward from 01:59:59 EST to 03:00 EDT: an hour of wall times that never happen.
SPRING_FORWARD = datetime(2027, 3, 14, 7, 0, tzinfo=UTC)


@pytest.fixture
def naive_new_york() -> Iterator[None]:
    """USE_TZ=False in a zone with daylight saving: times come back as naive wall times."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's timestamptz; elsewhere the columns hold wall times themselves")
    with override_settings(USE_TZ=False, TIME_ZONE="America/New_York"):
        yield
    connection.close()  # its session's time zone was New York's


def read_at(moment: datetime, *, state: str = State.COMPLETED, **times: datetime) -> Any:
    """A record as ``store.lookup()`` returns it when the database's time is ``moment``.

    Its times (``expires_at``, ``lease_expires_at``) are given as instants;
    the row goes through the lookup's own conversion, as the database sends it.
    """
    record = RecordFactory.create(state=state, fingerprint=fingerprint_of("dst").stored)
    scope = Scope(record.tenant, record.operation, record.key)
    database = connections["default"]
    with database.cursor() as cursor:
        cursor.execute(statements_for(database).find, [scope.tenant, scope.operation, scope.key])
        row = list(cursor.fetchone())

    def epoch_microseconds(instant: datetime) -> int:
        return (instant - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)

    for name, instant in times.items():
        row[FIELD_NAMES.index(name)] = epoch_microseconds(instant)
    row[len(FIELD_NAMES)] = epoch_microseconds(moment)
    return record_from_row(database, row)


def test_in_the_repeated_hour_retention_is_judged_by_the_instant(
    naive_new_york: None, settings: Any
) -> None:
    """Read at 01:45 EDT, kept until 01:15 EST (30 minutes later): not expired."""
    record = read_at(
        FALL_BACK - timedelta(minutes=15), expires_at=FALL_BACK + timedelta(minutes=15)
    )

    assert record.expires_at < record.read_at  # as wall times: 01:15 before 01:45
    assert not store.past_retention(record)  # its key is not discarded and run again
    settings.IDEMPOTENCY = {"TOMBSTONE_TTL": 3600, "ADVERTISE_RETENTION": True}
    assert not store.past_retention(record)
    assert not store.kept_as_tombstone(record)  # not refused as idempotency_key_expired
    assert seconds_left(record) == 30 * 60
    assert store.past_retention(read_at(FALL_BACK + timedelta(minutes=90), expires_at=FALL_BACK))


def test_in_the_repeated_hour_a_running_lease_is_not_abandoned(naive_new_york: None) -> None:
    """Read at 01:59 EDT, the lease ends at 01:01 EST: two minutes to go."""
    record = read_at(
        FALL_BACK - timedelta(minutes=1),
        state=State.CLAIMED,
        lease_expires_at=FALL_BACK + timedelta(minutes=1),
    )

    assert not store.abandoned(record, fingerprint_of("dst"))
    assert until_recovery(record) == 120  # not past: the floor would be 5
    uncertain = read_at(
        FALL_BACK - timedelta(minutes=1),
        state=State.UNCERTAIN,
        lease_expires_at=FALL_BACK + timedelta(minutes=5),
    )
    assert until_recovery(uncertain) == 6 * 60


def test_across_spring_forward_durations_are_exact(naive_new_york: None, settings: Any) -> None:
    """Read at 01:59 EST, kept until 03:01 EDT: two minutes left, not 62."""
    settings.IDEMPOTENCY = {"ADVERTISE_RETENTION": True}
    record = read_at(
        SPRING_FORWARD - timedelta(minutes=1), expires_at=SPRING_FORWARD + timedelta(minutes=1)
    )

    assert seconds_left(record) == 120
