"""Edge cases of database time, routed records, replicas and the intents' pools.

Written as reproductions when these were found: each of the first seven
failed on the code of that time, and each now guards its fix:

- an intents alias mapped to itself stays a records database;
- a tenant routed where records may not migrate is refused, never written
  where no sweep looks;
- a record's admin History shows only its own database's actions;
- check E033 compares backends, not ENGINE paths (a wrapping engine);
- MySQL/MariaDB with a DATABASES TIME_ZONE: times read back true, and
  recovery takes no live lease (the host clock is used there, with W007);
- the admin's age column follows the database clock.

The others passed then and cover paths no other test does (each fails when
``store.database_time.uses_host_clock()`` is forced to True): no record read
goes to ``db_for_read``; the wait mode,
``idempotent_task``, ``Retry(after=...)`` and an operator's release on a
host whose clock runs ahead never take over a live lease.
"""

from __future__ import annotations

import contextlib
import datetime
import types
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar
from unittest import mock

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, connections
from django.test import Client, override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import _store as store
from django_idempotency import purge, recovery
from django_idempotency._store import routing as databases
from django_idempotency._store.database_time import DatabaseLater, DatabaseNow, database_now
from django_idempotency._store.digests import FingerprintHasher
from django_idempotency.admin import IdempotencyRecordAdmin
from django_idempotency.checks import check_settings
from django_idempotency.models import IdempotencyRecord
from django_idempotency.scope import Scope
from tests.factories import RecordFactory
from tests.utils import SHARD_TEST_ALIASES, post, record_in, routed_by_tenant

pytestmark = pytest.mark.django_db(databases=SHARD_TEST_ALIASES, transaction=True)
State = IdempotencyRecord.State
CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"


@pytest.fixture
def operator() -> Client:
    user = User.objects.create_superuser("operator", "op@example.com", "secret")
    client = Client()
    client.force_login(user)
    return client


# --- 4. INTENT_DATABASES ------------------------------------------------------------


def test_intent_databases_mapping_a_shard_to_itself_keeps_it_swept() -> None:
    """A mapping of an alias to itself is the same as no mapping (connections.py:61 says so).

    databases.py:_intent_aliases() drops every mapped-to alias from the records
    databases, so {"shard_a": "shard_a"} removes shard_a itself: recovery,
    purge, key rotation, the admin and the checks never look at it again, while
    requests keep writing records there.
    """
    expired = record_in(
        "shard_a",
        tenant="tenant-a",
        state=State.COMPLETED,
        expires_at=timezone.now() - timedelta(minutes=1),
    )
    with routed_by_tenant(INTENT_DATABASES={"shard_a": "shard_a", "shard_b": "shard_b"}):
        swept = databases.record_databases()
        report = purge.purge_expired_records(batch_size=10, pause_factor=0)

    with routed_by_tenant(INTENT_DATABASES={"shard_a": "shard_a", "shard_b": "shard_b"}):
        refused = [message.id for message in check_settings()]
    assert swept == ["shard_a", "shard_b"]
    assert "django_idempotency.E023" not in refused  # "no database holds the records"
    assert report.deleted == 1
    assert not IdempotencyRecord.objects.using("shard_a").filter(pk=expired.pk).exists()


#: The same backend under another ENGINE path (GeoDjango's, of a database with PostGIS).
#: PostGIS and GeoDjango's MySQL would do in a project with GDAL installed.
SAME_VENDOR_ENGINE = {
    "postgresql": "tests.wrapped_engines.postgresql",
    "mysql": "tests.wrapped_engines.mysql",
    "sqlite": "tests.wrapped_engines.sqlite3",
}


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_an_intents_alias_of_the_same_backend_under_another_engine_path_is_no_error(
    settings: Any,
) -> None:
    """checks.py _intent_alias_mismatch compares ENGINE strings, not backends (E033).

    Records in a PostGIS database (ENGINE django.contrib.gis.db.backends.postgis)
    and a pooled alias for the intents with the plain PostgreSQL ENGINE reach
    one database through one backend; so do wrapping engines (connection
    pools, metrics). E033 is an Error: manage.py check, runserver and migrate
    refuse to start. The servers are asked anyway by E032.
    """
    engine = SAME_VENDOR_ENGINE[connection.vendor]
    settings.DATABASES = {
        **settings.DATABASES,
        "pooled": {**connections["default"].settings_dict, "ENGINE": engine},
    }
    with override_settings(IDEMPOTENCY={"INTENT_DATABASES": {"default": "pooled"}}):
        found = [message.id for message in check_settings()]
    assert "django_idempotency.E033" not in found


# --- 2. routing ---------------------------------------------------------------------


def test_a_record_is_never_written_where_no_sweep_looks() -> None:
    """The router's answer is used unchecked (databases.py:51, protection.py:119).

    TenantShardRouter (the suite's own) sends tenants without a shard to
    ``default``, where allow_migrate() says records do not live. The request
    claims and completes there; recovery, the purge and the admin only walk
    record_databases() = [shard_a, shard_b], so a crash there is never
    recovered and the record is never purged. Either answer would do: refuse
    (a 5xx / ImproperlyConfigured) or keep the record out of ``default``.
    """
    key = f"orphan-{uuid.uuid4()}"
    with routed_by_tenant():
        answer = post(
            APIClient(raise_request_exception=False),
            "/shard/charges",
            {"amount": 5},
            key,
            HTTP_X_TENANT="tenant-without-shard",
        )
        swept = databases.record_databases()

    assert "default" not in swept
    written_outside = IdempotencyRecord.objects.using("default").filter(key=key).exists()
    assert not written_outside, (
        f"answered {answer.status_code}; the record went to 'default', which no "
        f"sweep of {swept} ever visits"
    )


def test_the_history_page_shows_only_the_shards_own_actions(operator: Client) -> None:
    """Record ids repeat across shards; LogEntry keeps only the id (admin_actions.py:443).

    The history page of shard_a's record N lists what operators did to
    shard_b's record N (Django's history_view filters LogEntry by object_id
    and content type only). So do the "Recent actions" links of the admin
    index, which open shard_a's record for an action taken on shard_b's.
    """
    in_a = record_in("shard_a", tenant="tenant-a", key="hist-a")
    in_b = record_in("shard_b", tenant="tenant-b", key="hist-b", pk=in_a.pk)  # the same id
    with routed_by_tenant():
        done = operator.post(
            f"{CHANGELIST}?database=shard_b",
            {
                "action": "extend_retention",
                "_selected_action": [in_b.pk],
                "apply": "1",
                "hours": 48,
            },
        )
        assert done.status_code == 302
        history_of_a = operator.get(
            f"{CHANGELIST}{in_a.pk}/history/", {"_changelist_filters": "database=shard_a"}
        )

    assert history_of_a.status_code == 200
    page = history_of_a.content.decode()
    assert "hist-a" in page  # the shard_a record's own page
    assert "Retention extended" not in page, "shard_b's action shown in shard_a's history"


# --- 1. time from the database --------------------------------------------------------


def fingerprint_of(text: str) -> Any:
    hasher = FingerprintHasher()
    hasher.update(text)
    return hasher.finish()


@contextlib.contextmanager
def database_time_zone(alias: str, zone: str) -> Iterator[None]:
    """DATABASES[alias]["TIME_ZONE"]: a legacy MySQL database that stores local times.

    Django supports it under USE_TZ=True on backends without time zones: it
    reads and writes datetimes in that zone instead of UTC.
    """
    wrapper = connections[alias]
    before = wrapper.settings_dict.get("TIME_ZONE")
    wrapper.settings_dict["TIME_ZONE"] = zone
    for cached in ("timezone", "timezone_name"):
        wrapper.__dict__.pop(cached, None)
    try:
        yield
    finally:
        wrapper.settings_dict["TIME_ZONE"] = before
        for cached in ("timezone", "timezone_name"):
            wrapper.__dict__.pop(cached, None)


mysql_only = pytest.mark.skipif(
    connection.vendor != "mysql", reason="DATABASES TIME_ZONE with UTC_TIMESTAMP: MySQL/MariaDB"
)


@mysql_only
def test_mysql_database_time_zone_claim_times_read_back_true() -> None:
    """store/database_time.py:96 writes UTC_TIMESTAMP(6) whatever the database's TIME_ZONE.

    With DATABASES["default"]["TIME_ZONE"] = "America/New_York" Django reads
    every datetime column as New York time, so a claim made now reads back
    as created five hours ago (four in summer), its lease long over.
    """
    scope = Scope("anonymous", "tests.review.mysql-tz", str(uuid.uuid4()))
    with database_time_zone("default", "America/New_York"):
        held = store.claim(
            scope,
            fingerprint_of("x"),
            ttl=timedelta(hours=1),
            lease=timedelta(minutes=2),
            using="default",
        )
        assert held is not None
        record = IdempotencyRecord.objects.get(pk=held.record_id)
        now = timezone.now()

    assert abs(record.created_at - now) < timedelta(minutes=1), (record.created_at, now)
    assert record.lease_expires_at is not None
    assert record.lease_expires_at > now, "the lease just taken reads as expired"


@mysql_only
def test_mysql_database_time_zone_recovery_takes_no_live_lease() -> None:
    """The same cause, on records whose times Django wrote (before the upgrade, factories, the ORM).

    Django stored New York wall-clock time; recovery compares it with
    UTC_TIMESTAMP(6), five hours later, and takes over a record whose owner
    holds its lease for another hour.
    """
    with database_time_zone("default", "America/New_York"):
        live = RecordFactory.create(
            state=State.IN_PROGRESS,
            lease_owner="owner:1:1",
            lease_expires_at=timezone.now() + timedelta(hours=1),
            response_status=None,
            response_body=None,
            response_headers=[],
        )
        stale = recovery.stale_records(limit=10)
        report = recovery.recover_stale_records(batch_size=10)

    assert [record.pk for record in stale] == []
    assert report.handled == 0
    after = IdempotencyRecord.objects.get(pk=live.pk)
    assert (after.fencing_token, after.lease_owner) == (1, "owner:1:1")


@contextlib.contextmanager
def host_clock(offset: timedelta) -> Iterator[None]:
    """This process's clock runs ``offset`` ahead: timezone.now() and timesince's datetime.now()."""
    real = timezone.now

    class AnyDatetime(type):
        def __instancecheck__(cls, instance: Any) -> bool:
            return isinstance(instance, datetime.datetime)

    class Shifted(datetime.datetime, metaclass=AnyDatetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.datetime.now(tz) + offset

    shifted_module = types.SimpleNamespace(**vars(datetime))
    shifted_module.datetime = Shifted
    with (
        mock.patch("django.utils.timezone.now", lambda: real() + offset),
        mock.patch("django.utils.timesince.datetime", shifted_module),
    ):
        yield


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite's clock is the host's")
def test_the_admin_age_column_follows_the_database_clock(operator: Client) -> None:
    """admin.py:362 ``timesince(record.created_at)``: this host's clock, not the database's.

    A display only, but the list the operator decides from: on an admin host
    ten minutes ahead a record created a second ago is "10 minutes" old (and
    one hours ahead of a fresh claim, "stuck"-looking). The row is read with
    the database's time (``read_at``); age should be measured against it.
    """
    record = RecordFactory.create(state=State.COMPLETED)
    IdempotencyRecord.objects.filter(pk=record.pk).update(created_at=DatabaseNow())
    from django.contrib import admin

    model_admin = admin.site._registry[IdempotencyRecord]
    assert isinstance(model_admin, IdempotencyRecordAdmin)
    request = operator.get(CHANGELIST).wsgi_request
    with host_clock(timedelta(minutes=10)):
        shown = model_admin.get_queryset(request).get(pk=record.pk)
        age = model_admin.age(shown)

    assert age.startswith("0"), f"a record created just now is shown {age!r} old"


# --- 3. replicas (holds: kept as in-process coverage) ------------------------------------


class ReadsAreForbiddenRouter:
    """Any record read left to the routers (db_for_read) is a bug: it would go to a replica."""

    reads: ClassVar[list[dict[str, Any]]] = []

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        if model._meta.app_label == "django_idempotency":
            self.reads.append(hints)
        return None


def test_no_record_read_is_left_to_db_for_read(operator: Client) -> None:
    """Held before the fixes too: the store, admin, recovery, purge pin their alias."""
    ReadsAreForbiddenRouter.reads.clear()
    key = str(uuid.uuid4())
    stuck = RecordFactory.create(
        state=State.CLAIMED,
        response_status=None,
        response_body=None,
        response_headers=[],
        lease_expires_at=timezone.now() - timedelta(minutes=1),
    )
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.ReadsAreForbiddenRouter"]):
        client = APIClient()
        assert post(client, "/api-view/charges", {"amount": 5}, key).status_code == 201
        assert post(client, "/api-view/charges", {"amount": 5}, key).status_code == 201
        assert post(client, "/api-view/charges", {"amount": 6}, key).status_code == 422
        assert operator.get(CHANGELIST, {"state": "stuck"}).status_code == 200
        assert operator.get(f"{CHANGELIST}{stuck.pk}/change/").status_code == 200
        assert operator.get(f"{CHANGELIST}{stuck.pk}/history/").status_code == 200
        operator.post(
            CHANGELIST,
            {
                "action": "extend_retention",
                "_selected_action": [stuck.pk],
                "apply": "1",
                "hours": 1,
            },
        )
        recovery.stale_records(limit=10)
        recovery.leased_records()
        recovery.recover_stale_records(batch_size=10)
        purge.expired_count()
        purge.purge_expired_records(batch_size=10, pause_factor=0)
    assert ReadsAreForbiddenRouter.reads == []


# --- 1. database time, the paths test_database_time.py leaves out (hold: coverage) -------

on_a_database_clock = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite's clock is the host's"
)
LEASE = timedelta(minutes=2)


def running_claim_of(key: str) -> IdempotencyRecord:
    from tests.test_database_time import running_claim

    return running_claim(key)


@on_a_database_clock
def test_wait_mode_on_a_host_ahead_never_takes_over() -> None:
    key = str(uuid.uuid4())
    running = running_claim_of(key)
    more = {"IN_FLIGHT": "wait", "IN_FLIGHT_WAIT": 0.3}
    with (
        override_settings(IDEMPOTENCY={**getattr(settings, "IDEMPOTENCY", {}), **more}),
        host_clock(timedelta(minutes=10)),
    ):
        duplicate = post(APIClient(), "/api-view/charges", {"amount": 5}, key)

    assert duplicate.status_code == 409, duplicate.content
    after = IdempotencyRecord.objects.get(pk=running.pk)
    assert (after.state, after.fencing_token) == (State.CLAIMED, 1)


@on_a_database_clock
def test_idempotent_task_on_a_host_ahead_never_takes_over() -> None:
    from django_idempotency.exceptions import TaskInProgress
    from django_idempotency.tasks import idempotent_task

    ran: list[str] = []

    @idempotent_task(key="event_id", operation="tests.review.task")
    def handle(event_id: str) -> str:
        ran.append(event_id)
        return event_id

    event = str(uuid.uuid4())
    held = store.claim(
        Scope("task", "tests.review.task", event),
        _task_fingerprint(event),
        ttl=timedelta(hours=1),
        lease=LEASE,
        using="default",
    )
    assert held is not None
    with host_clock(timedelta(minutes=10)), pytest.raises(TaskInProgress):
        handle(event)
    assert ran == []


def _task_fingerprint(event: str) -> Any:
    from django_idempotency._protection.task import _arguments
    from django_idempotency.fingerprint import fingerprint

    def handle(event_id: str) -> str:  # the same signature
        return event_id

    return fingerprint(_arguments(handle, (event,), {}))


@on_a_database_clock
def test_retry_after_postpones_on_the_database_clock() -> None:
    operation = f"tests.review.retry-{uuid.uuid4()}"
    recovery.register_reconciler(operation)(lambda record: recovery.Retry(after=300))
    record = RecordFactory.create(
        operation=operation,
        state=State.UNCERTAIN,
        response_status=None,
        response_body=None,
        response_headers=[],
    )
    IdempotencyRecord.objects.filter(pk=record.pk).update(
        lease_expires_at=DatabaseLater(-timedelta(seconds=1))
    )
    try:
        with host_clock(-timedelta(minutes=10)):
            report = recovery.recover_stale_records(batch_size=10)
    finally:
        recovery._reconcilers.pop(operation, None)
    assert report.retried == 1
    lease_ends = IdempotencyRecord.objects.get(pk=record.pk).lease_expires_at
    assert lease_ends is not None
    remaining = lease_ends - database_now("default")
    assert timedelta(minutes=4) < remaining <= timedelta(minutes=5), remaining


@on_a_database_clock
def test_an_operator_on_a_host_ahead_cannot_release_a_live_lease(operator: Client) -> None:
    running = running_claim_of(str(uuid.uuid4()))
    with host_clock(timedelta(minutes=10)):
        operator.post(
            CHANGELIST,
            {
                "action": "release",
                "_selected_action": [running.pk],
                "apply": "1",
                "reexecute": "on",
                f"token-{running.pk}": running.fencing_token,
                f"state-{running.pk}": running.state,
            },
        )
    after = IdempotencyRecord.objects.get(pk=running.pk)
    assert (after.state, after.fencing_token) == (State.CLAIMED, 1)
