"""Expired keys (``IDEMPOTENCY["TOMBSTONE_TTL"]``): a late retry is refused, never run again.

Past retention a record is kept as a tombstone (scope and fingerprint, no
response) for ``TOMBSTONE_TTL``: a retry of the same request inside that
window gets 422 ``idempotency_key_expired`` and runs nothing, one of other
input 422 ``idempotency_key_reused``; after it, the key starts a new
operation. The purge makes tombstones and later deletes them, each judged
by the database's clock, on the expiry index: tests move ``expires_at`` in
the database (``DatabaseLater``) rather than sleep.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any
from unittest import mock

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import _store as store
from django_idempotency import checks, purge
from django_idempotency._store.database_time import DatabaseLater, database_now, uses_host_clock
from django_idempotency._store.statements import statements_for
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from django_idempotency.tasks import idempotent_task
from tests.factories import RecordFactory
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
TOMBSTONE_TTL = timedelta(days=7)
#: The two-commit path.
URLS = ["/api-view/charges"]


@pytest.fixture
def tombstones(settings: Any) -> Iterator[None]:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "TOMBSTONE_TTL": TOMBSTONE_TTL}
    yield


@contextlib.contextmanager
def host_clock(offset: timedelta) -> Iterator[None]:
    """This process's clock runs ``offset`` off; the database's does not."""
    real = timezone.now
    with mock.patch("django.utils.timezone.now", lambda: real() + offset):
        yield


def expire(record: IdempotencyRecord, ago: timedelta) -> None:
    """Set ``record``'s expiry ``ago`` before the database's now."""
    IdempotencyRecord.objects.filter(pk=record.pk).update(expires_at=DatabaseLater(-ago))


def only_record() -> IdempotencyRecord:
    return IdempotencyRecord.objects.get()


def refused(response: Any, code: str) -> bool:
    return bool(response.status_code == 422 and response.json()["code"] == code)


def first_request(url: str, key: str) -> IdempotencyRecord:
    response = post(APIClient(), url, {"amount": 5}, key)
    assert response.status_code == 201, response.content
    return only_record()


# -- the claim: refused inside the window, anew after it ------------------------------


@pytest.mark.usefixtures("tombstones")
@pytest.mark.parametrize("url", URLS)
def test_a_late_retry_before_the_purge_ran_is_refused_and_runs_nothing(url: str) -> None:
    key = str(uuid.uuid4())
    record = first_request(url, key)
    expire(record, timedelta(days=2))  # past retention, the purge not run yet

    retry = post(APIClient(), url, {"amount": 5}, key)

    assert refused(retry, "idempotency_key_expired"), retry.content
    assert "Idempotent-Replayed" not in retry.headers
    assert Charge.objects.count() == 1
    assert only_record().pk == record.pk  # not discarded


@pytest.mark.usefixtures("tombstones")
def test_a_late_redelivery_of_a_webhook_is_refused_naming_its_keys_source() -> None:
    """A webhook's sender sent no Idempotency-Key: it is told where its key came from."""
    api = APIClient()
    event = {"id": "evt_1", "data": {"object": {"id": "pi_1"}}, "amount": 5}
    api.post("/keyed/body-field", event, format="json")
    expire(only_record(), timedelta(days=2))

    late = api.post("/keyed/body-field", event, format="json")

    assert refused(late, "idempotency_key_expired"), late.content
    assert "the body field 'data.object.id'" in late.json()["detail"]
    assert "Idempotency-Key" not in late.json()["detail"]
    assert Charge.objects.count() == 1


@pytest.mark.usefixtures("tombstones")
@pytest.mark.parametrize("url", URLS)
def test_a_late_retry_of_a_tombstone_is_refused_and_runs_nothing(url: str) -> None:
    key = str(uuid.uuid4())
    record = first_request(url, key)
    expire(record, timedelta(hours=1))
    assert purge.purge_expired_records(pause_factor=0).tombstoned == 1

    retry = post(APIClient(), url, {"amount": 5}, key)

    assert refused(retry, "idempotency_key_expired"), retry.content
    assert Charge.objects.count() == 1
    assert only_record().tombstone


@pytest.mark.usefixtures("tombstones")
@pytest.mark.parametrize("purged", [False, True], ids=["before-the-purge", "tombstone"])
def test_other_input_inside_the_window_is_a_reused_key(purged: bool) -> None:
    key = str(uuid.uuid4())
    record = first_request(URLS[0], key)
    expire(record, timedelta(hours=1))
    if purged:
        purge.purge_expired_records(pause_factor=0)

    other = post(APIClient(), URLS[0], {"amount": 6}, key)

    assert refused(other, "idempotency_key_reused"), other.content
    assert Charge.objects.count() == 1


@pytest.mark.usefixtures("tombstones")
@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("purged", [False, True], ids=["never-a-tombstone", "tombstone"])
def test_after_the_window_the_key_starts_a_new_operation(url: str, purged: bool) -> None:
    key = str(uuid.uuid4())
    record = first_request(url, key)
    expire(record, timedelta(hours=1))
    if purged:
        assert purge.purge_expired_records(pause_factor=0).tombstoned == 1
        expire(only_record(), timedelta(seconds=1))  # the tombstone's own expiry
    else:
        expire(record, TOMBSTONE_TTL + timedelta(seconds=1))

    again = post(APIClient(), url, {"amount": 5}, key)

    assert again.status_code == 201, again.content
    assert "Idempotent-Replayed" not in again.headers
    assert Charge.objects.count() == 2
    fresh = only_record()
    assert fresh.pk != record.pk and not fresh.tombstone and fresh.state == State.COMPLETED


@pytest.mark.parametrize("url", URLS)
def test_without_tombstone_ttl_a_key_past_retention_starts_anew(url: str) -> None:
    key = str(uuid.uuid4())
    record = first_request(url, key)
    expire(record, timedelta(seconds=1))

    assert post(APIClient(), url, {"amount": 5}, key).status_code == 201
    assert Charge.objects.count() == 2


def test_a_tombstone_kept_while_the_setting_was_on_refuses_until_its_own_expiry(
    settings: Any,
) -> None:
    """Turning TOMBSTONE_TTL off keeps the tombstones made: they were promised."""
    key = str(uuid.uuid4())
    record = first_request(URLS[0], key)
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        tombstone=True, response_body=None, response_headers=[]
    )

    retry = post(APIClient(), URLS[0], {"amount": 5}, key)

    assert refused(retry, "idempotency_key_expired"), retry.content
    assert Charge.objects.count() == 1


@pytest.mark.usefixtures("tombstones")
def test_a_live_record_still_replays() -> None:
    key = str(uuid.uuid4())
    first_request(URLS[0], key)

    replay = post(APIClient(), URLS[0], {"amount": 5}, key)

    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"


@pytest.mark.usefixtures("tombstones")
def test_the_refusal_costs_what_a_replay_costs() -> None:
    """The claim's INSERT conflicts with the tombstone and the lookup reads it: no more."""
    key = str(uuid.uuid4())
    record = first_request(URLS[0], key)
    with CaptureQueriesContext(connection) as replay:
        post(APIClient(), URLS[0], {"amount": 5}, key)
    expire(record, timedelta(hours=1))
    purge.purge_expired_records(pause_factor=0)

    with CaptureQueriesContext(connection) as refusal:
        response = post(APIClient(), URLS[0], {"amount": 5}, key)

    assert refused(response, "idempotency_key_expired")
    assert len(refusal.captured_queries) == len(replay.captured_queries)


# -- the purge: tombstones made, then deleted, by the database's clock -----------------


@pytest.mark.usefixtures("tombstones")
def test_the_purge_makes_a_tombstone_its_expiry_moved_on_by_the_ttl() -> None:
    sealed = RecordFactory.create(response_sealed=True)
    failed = RecordFactory.create(state=State.FAILED, response_status=402)
    live = RecordFactory.create()
    unresolved = RecordFactory.create(
        state=State.UNCERTAIN, response_status=None, response_body=None, response_headers=[]
    )
    for record in (sealed, failed, unresolved):
        expire(record, timedelta(hours=1))
    before = {r.pk: r.expires_at for r in IdempotencyRecord.objects.all()}

    report = purge.purge_expired_records(pause_factor=0)

    assert (report.deleted, report.tombstoned, report.batches) == (0, 2, 1)
    for record in (sealed, failed):
        after = IdempotencyRecord.objects.get(pk=record.pk)
        assert after.tombstone and after.state == record.state
        assert after.response_body is None and after.response_headers == []
        assert not after.response_sealed
        assert (after.fingerprint, after.key, after.tenant) == (
            record.fingerprint,
            record.key,
            record.tenant,
        )
        assert after.expires_at == before[record.pk] + TOMBSTONE_TTL
    for untouched in (live, unresolved):
        after = IdempotencyRecord.objects.get(pk=untouched.pk)
        assert not after.tombstone and after.response_headers == untouched.response_headers
        assert after.expires_at == before[untouched.pk]


@pytest.mark.usefixtures("tombstones")
def test_a_second_purge_leaves_tombstones_alone_until_their_own_expiry() -> None:
    record = RecordFactory.create()
    expire(record, timedelta(hours=1))
    assert purge.purge_expired_records(pause_factor=0).tombstoned == 1

    again = purge.purge_expired_records(pause_factor=0)

    assert (again.deleted, again.tombstoned, again.batches) == (0, 0, 0)
    assert purge.expired_count() == purge.tombstone_count() == 0
    expire(record, timedelta(seconds=1))
    assert (purge.expired_count(), purge.tombstone_count()) == (1, 0)
    last = purge.purge_expired_records(pause_factor=0)
    assert (last.deleted, last.tombstoned) == (1, 0)
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.usefixtures("tombstones")
def test_a_record_past_its_tombstone_s_time_already_is_deleted_at_once() -> None:
    """Never made a tombstone only to be met again by the same scan."""
    old = RecordFactory.create()
    expire(old, TOMBSTONE_TTL + timedelta(hours=1))
    recent = RecordFactory.create()
    expire(recent, timedelta(hours=1))

    report = purge.purge_expired_records(pause_factor=0)

    assert (report.deleted, report.tombstoned) == (1, 1)
    assert list(IdempotencyRecord.objects.values_list("pk", "tombstone")) == [(recent.pk, True)]


@pytest.mark.usefixtures("tombstones")
def test_steps_go_with_their_tombstone_and_not_before() -> None:
    record = RecordFactory.create(provider_key="p" * 64)
    now = timezone.now()
    for name in ("authorize", "capture"):
        IdempotencyStep.objects.create(
            record=record, name=name, provider_key=name, begun_at=now, updated_at=now
        )
    expire(record, timedelta(hours=1))

    purge.purge_expired_records(pause_factor=0)
    assert IdempotencyStep.objects.filter(record_id=record.pk).count() == 2  # a tombstone yet

    expire(record, timedelta(seconds=1))
    assert purge.purge_expired_records(pause_factor=0).deleted == 1
    assert not IdempotencyStep.objects.exists()


@pytest.mark.usefixtures("tombstones")
def test_batches_mix_deletions_and_tombstones_oldest_first() -> None:
    tombstones = [RecordFactory.create(tombstone=True, response_body=None) for _ in range(3)]
    for i, record in enumerate(tombstones):
        expire(record, timedelta(hours=10 - i))
    expiring = [RecordFactory.create() for _ in range(4)]
    for i, record in enumerate(expiring):
        expire(record, timedelta(hours=5 - i))

    report = purge.purge_expired_records(batch_size=2, batch_seconds=60, pause_factor=0)

    assert (report.deleted, report.tombstoned, report.batches) == (3, 4, 4)
    left = IdempotencyRecord.objects.values_list("pk", "tombstone")
    assert sorted(left) == sorted((record.pk, True) for record in expiring)


@pytest.mark.usefixtures("tombstones")
def test_a_batch_scans_on_from_the_expiry_its_records_had() -> None:
    first = [RecordFactory.create() for _ in range(2)]
    for i, record in enumerate(first):
        expire(record, timedelta(hours=3, seconds=i))
    later = RecordFactory.create()
    expire(later, timedelta(hours=1))
    expiries = dict(IdempotencyRecord.objects.values_list("pk", "expires_at"))

    batch = store.purge_to_tombstones_batch(limit=2, using="default", tombstone_ttl=TOMBSTONE_TTL)

    assert (batch.deleted, batch.tombstoned) == (0, 2)
    assert batch.reached == max(expiries[record.pk] for record in first)
    following = store.purge_to_tombstones_batch(
        limit=2, using="default", tombstone_ttl=TOMBSTONE_TTL, after=batch.reached
    )
    assert (following.deleted, following.tombstoned) == (0, 1)
    assert following.reached == expiries[later.pk]


@pytest.mark.usefixtures("tombstones")
def test_a_batch_is_one_statement_on_postgresql() -> None:
    for hours in (1, 2):
        expire(RecordFactory.create(), timedelta(hours=hours))
    expire(RecordFactory.create(tombstone=True), timedelta(hours=3))

    with CaptureQueriesContext(connection) as captured:
        batch = store.purge_to_tombstones_batch(
            limit=10, using="default", tombstone_ttl=TOMBSTONE_TTL
        )

    assert (batch.deleted, batch.tombstoned) == (1, 2)
    statements = [query["sql"] for query in captured.captured_queries]
    if connection.vendor == "postgresql":
        assert len(statements) == 1, statements
        assert "SKIP LOCKED" in statements[0] and "ORDER BY" in statements[0]
    else:  # the batch, its DELETE and its UPDATE
        assert len(statements) == 3, statements


def test_without_tombstone_ttl_the_purge_deletes_as_before() -> None:
    records = [RecordFactory.create() for _ in range(2)]
    for record in records:
        expire(record, timedelta(hours=1))

    with CaptureQueriesContext(connection) as captured:
        report = purge.purge_expired_records(pause_factor=0)

    assert (report.deleted, report.tombstoned, report.batches) == (2, 0, 1)
    assert not IdempotencyRecord.objects.exists()
    if connection.vendor == "postgresql":
        # Today's statement, to its first parameter.
        [sql] = [query["sql"] for query in captured.captured_queries]
        assert sql.startswith(statements_for(connection).purge.split("%s")[0])
        assert "tombstone" not in sql


@pytest.mark.usefixtures("tombstones")
def test_the_purge_and_the_claim_judge_by_the_database_s_clock() -> None:
    """A host clock days ahead neither makes tombstones early nor lets a key run anew."""
    if uses_host_clock(connection):
        pytest.skip("this database's times are the host's: SQLite, or MySQL storing a zone")
    key = str(uuid.uuid4())
    record = first_request(URLS[0], key)  # expires in 24 hours, by the database
    unexpired = RecordFactory.create()
    IdempotencyRecord.objects.filter(pk=unexpired.pk).update(
        expires_at=DatabaseLater(timedelta(hours=1))
    )

    with host_clock(timedelta(days=30)):
        report = purge.purge_expired_records(pause_factor=0)
        replay = post(APIClient(), URLS[0], {"amount": 5}, key)
    assert (report.deleted, report.tombstoned) == (0, 0)
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"

    # Inside the window by the database, past it by a host 30 days ahead: refused.
    expire(record, timedelta(hours=1))
    with host_clock(timedelta(days=30)):
        retry = post(APIClient(), URLS[0], {"amount": 5}, key)
    assert refused(retry, "idempotency_key_expired"), retry.content
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get(pk=record.pk).expires_at < database_now("default")


# -- the command, the task, the admin -------------------------------------------------


def run_command(*args: str) -> str:
    out = StringIO()
    call_command("idempotency_purge", *args, stdout=out)
    return out.getvalue().strip()


@pytest.mark.usefixtures("tombstones")
def test_the_command_reports_tombstones() -> None:
    expire(RecordFactory.create(), timedelta(hours=1))
    expire(RecordFactory.create(tombstone=True), timedelta(hours=1))

    assert run_command("--dry-run") == ("1 expired record(s) would be deleted, 1 made tombstones.")
    output = run_command("--pause-factor", "0")
    assert output.startswith("deleted 1 record(s) and made 1 tombstone(s) in 1 batch(es);")


@pytest.mark.usefixtures("tombstones")
def test_the_celery_task_reports_tombstones() -> None:
    from django_idempotency import tasks

    expire(RecordFactory.create(), timedelta(hours=1))

    result = tasks.purge_expired_records.apply(kwargs={"pause_factor": 0}).get()

    assert (result["deleted"], result["tombstoned"]) == (0, 1)


executed: list[str] = []


@idempotent_task(key="event_id", operation="task tests.tombstones")
def handle_event(event_id: str) -> int:
    executed.append(event_id)
    return len(executed)


@pytest.mark.usefixtures("tombstones")
def test_a_task_redelivered_inside_the_window_does_not_run_again() -> None:
    executed.clear()
    event_id = str(uuid.uuid4())
    assert handle_event(event_id) == 1
    expire(only_record(), timedelta(hours=1))
    assert handle_event(event_id) == 1  # past retention, not purged yet: the stored result
    purge.purge_expired_records(pause_factor=0)

    assert handle_event(event_id) is None  # its result was purged with the response
    assert executed == [event_id]

    expire(only_record(), timedelta(seconds=1))
    assert handle_event(event_id) == 2


@pytest.mark.usefixtures("tombstones")
def test_the_admin_lists_tombstones_and_says_why_the_body_is_gone(
    admin_client: Any,
) -> None:
    tombstone = RecordFactory.create(tombstone=True, response_body=None, key="buried-key")
    RecordFactory.create(key="live-key")
    changelist = "/admin/django_idempotency/idempotencyrecord/"

    listed = admin_client.get(changelist, {"expires": "tombstone"})
    page = admin_client.get(f"{changelist}{tombstone.pk}/change/")

    assert listed.status_code == 200
    text = listed.content.decode()
    assert "buried-key" in text and "live-key" not in text
    assert "purged past retention" in page.content.decode()


# -- the setting ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, timedelta(0), "7 days", True])
def test_a_tombstone_ttl_that_is_not_a_positive_duration_is_e035(value: Any) -> None:
    with override_settings(IDEMPOTENCY={"TOMBSTONE_TTL": value}):
        assert "django_idempotency.E035" in {m.id for m in checks.check_settings()}


@pytest.mark.parametrize("value", [None, 3600, 0.5, timedelta(days=30)])
def test_none_or_a_positive_duration_is_a_tombstone_ttl(value: Any) -> None:
    with override_settings(IDEMPOTENCY={"TOMBSTONE_TTL": value}):
        assert "django_idempotency.E035" not in {m.id for m in checks.check_settings()}
        resolved = idempotency_settings.TOMBSTONE_TTL
    if value is None:
        assert resolved is None
    else:
        assert resolved == (value if isinstance(value, timedelta) else timedelta(seconds=value))


# The steps of a record the purge turns into a tombstone, then deletes.
#
# A tombstone keeps the scope and the fingerprint; its steps go with it when
# the purge deletes it (ON DELETE CASCADE, a trigger on SQLite), on every
# vendor, through the one-statement PostgreSQL purge and the other vendors'.
# And a handed-back or UNCERTAIN record past ``expires_at`` is never made a
# tombstone: only resolved records are.

TTL = timedelta(days=7)


def with_step(record: IdempotencyRecord, name: str = "authorize") -> None:
    IdempotencyStep.objects.create(
        record=record,
        name=name,
        provider_key="v1:" + "b" * 60,
        provider_operation_id="au_1",
        begun_at=timezone.now(),
        updated_at=timezone.now(),
    )


def test_a_tombstones_steps_go_with_it(settings: Any) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "TOMBSTONE_TTL": TTL}
    record = RecordFactory.create()
    with_step(record)
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(-timedelta(hours=1)))

    assert purge.purge_expired_records(pause_factor=0).tombstoned == 1
    assert IdempotencyRecord.objects.get().tombstone
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(-timedelta(seconds=1)))
    assert purge.purge_expired_records(pause_factor=0).deleted == 1

    assert not IdempotencyRecord.objects.exists()
    assert not IdempotencyStep.objects.exists()


@pytest.mark.parametrize("state", [State.CLAIMED, State.UNCERTAIN, State.IN_PROGRESS])
def test_an_unresolved_record_with_steps_past_expires_at_is_never_buried(
    settings: Any, state: str
) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "TOMBSTONE_TTL": TTL}
    record = RecordFactory.create(
        state=state,
        lease_owner="",
        response_status=None,
        response_headers=[],
        response_body=None,
    )
    with_step(record)
    IdempotencyRecord.objects.update(
        expires_at=DatabaseLater(-TTL - timedelta(hours=1)),
        lease_expires_at=DatabaseLater(-TTL - timedelta(hours=1)),
    )

    report = purge.purge_expired_records(pause_factor=0)

    assert (report.deleted, report.tombstoned) == (0, 0)
    assert IdempotencyStep.objects.count() == 1
