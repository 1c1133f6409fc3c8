"""Records routed with the tenant's data: IDEMPOTENCY["DATABASE"] = None and a router by tenant.

Three databases on the suite's engine (SQLite files, or PostgreSQL with
DATABASE_URL): ``default`` and two shards (tests/settings.py), and
``TenantShardRouter`` sending tenant-a's records to ``shard_a`` and
tenant-b's to ``shard_b``. The live proof, over HTTP with gunicorn and a
Celery worker on two PostgreSQL shards, is tests/live/test_shards_live.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.contrib.auth.models import User
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connections
from django.test import Client, override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import purge, recovery, testing
from django_idempotency._store import routing as databases
from django_idempotency.models import IdempotencyRecord
from django_idempotency.tasks import idempotent_task
from tests.testapp.models import Charge
from tests.testapp.routers import TenantShardRouter, shard_of
from tests.utils import SHARD_TEST_ALIASES, post, record_in, routed_by_tenant, sharded

ALIASES = SHARD_TEST_ALIASES
pytestmark = pytest.mark.django_db(databases=ALIASES, transaction=True)
State = IdempotencyRecord.State
CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"


@pytest.fixture(autouse=True)
def router() -> Iterator[type[TenantShardRouter]]:
    with routed_by_tenant():
        TenantShardRouter.asked.clear()
        yield TenantShardRouter


def charge(tenant: str, key: str, url: str = "/shard/charges", **data: Any) -> Any:
    client = APIClient(raise_request_exception=False)
    return post(client, url, {"amount": 5, **data}, key, HTTP_X_TENANT=tenant)


def records(alias: str) -> list[tuple[str, str, str]]:
    rows = IdempotencyRecord.objects.using(alias).values_list("tenant", "key", "state")
    return sorted(rows)


def charges(alias: str) -> list[tuple[str, int]]:
    return sorted(Charge.objects.using(alias).values_list("tenant", "amount"))


def stuck_in(alias: str, **fields: Any) -> IdempotencyRecord:
    return record_in(
        alias,
        **{
            "state": State.CLAIMED,
            "response_status": None,
            "response_body": None,
            "response_headers": [],
            "lease_expires_at": timezone.now() - timedelta(minutes=1),
            **fields,
        },
    )


def expired_in(alias: str, **fields: Any) -> IdempotencyRecord:
    return record_in(alias, expires_at=timezone.now() - timedelta(minutes=1), **fields)


# --- the request flow -------------------------------------------------------


def test_each_tenants_record_and_rows_land_in_its_shard_and_nowhere_else() -> None:
    first = charge("tenant-a", "same-key")
    second = charge("tenant-b", "same-key")

    assert (first.status_code, first.json()["database"]) == (201, "shard_a")
    assert (second.status_code, second.json()["database"]) == (201, "shard_b")
    assert records("shard_a") == [("tenant-a", "same-key", State.COMPLETED)]
    assert records("shard_b") == [("tenant-b", "same-key", State.COMPLETED)]
    assert records("default") == []
    assert charges("shard_a") == [("tenant-a", 5)]
    assert charges("shard_b") == [("tenant-b", 5)]
    assert charges("default") == []


def test_the_routers_are_asked_once_per_request_with_the_scope_as_hints(
    router: type[TenantShardRouter],
) -> None:
    charge("tenant-a", "k1")
    replay = charge("tenant-a", "k1")
    reused = charge("tenant-a", "k1", amount=6)

    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert reused.status_code == 422
    asked = router.asked
    assert [kind for kind, _ in asked] == ["write", "write", "write"]  # never a read
    for _, hints in asked:
        assert (hints["tenant"], hints["operation"]) == ("tenant-a", "charge")
        assert hints["request"].headers["X-Tenant"] == "tenant-a"
    assert charges("shard_a") == [("tenant-a", 5)]


def test_a_failing_view_rolls_back_and_releases_in_its_shard() -> None:
    failed = charge("tenant-b", "k-fail", fail=True)

    assert failed.status_code == 500
    assert records("shard_b") == []  # released: the retry runs
    assert charges("shard_b") == []  # rolled back with the claim's transaction
    retried = charge("tenant-b", "k-fail")
    assert retried.status_code == 201
    assert records("shard_b") == [("tenant-b", "k-fail", State.COMPLETED)]
    assert charges("shard_b") == [("tenant-b", 5)]


def test_a_fixed_database_is_exposed_to_the_view_and_no_router_is_asked(
    router: type[TenantShardRouter],
) -> None:
    with override_settings(IDEMPOTENCY=sharded(DATABASE="shard_b")):
        answer = charge("tenant-a", "k-fixed")

    assert (answer.status_code, answer.json()["database"]) == (201, "shard_b")
    assert records("shard_b") == [("tenant-a", "k-fixed", State.COMPLETED)]
    assert router.asked == []


@contextmanager
def writes_by_database() -> Iterator[set[str]]:
    """The aliases that received an INSERT, UPDATE or DELETE meanwhile."""
    written: set[str] = set()

    def watch(alias: str) -> Callable[..., Any]:
        def wrapper(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
            if sql.lstrip().split(None, 1)[0].upper() in {"INSERT", "UPDATE", "DELETE"}:
                written.add(alias)
            return execute(sql, *args)

        return wrapper

    with ExitStack() as stack:
        for alias in ALIASES:
            stack.enter_context(connections[alias].execute_wrapper(watch(alias)))
        yield written


def writes_elsewhere(tenant: str, key: str, url: str) -> set[str]:
    """Where a protected view wrote outside ``request.idempotency.database``."""
    with writes_by_database() as written:
        answer = charge(tenant, key, url)
    assert answer.status_code == 201, answer.content
    return written - {answer.json()["database"]}


def test_a_view_writing_with_using_the_records_database_writes_nowhere_else() -> None:
    assert writes_elsewhere("tenant-a", "k-good", "/shard/charges") == set()


def test_a_view_leaving_its_writes_to_the_routers_is_flagged() -> None:
    assert writes_elsewhere("tenant-b", "k-bad", "/shard/misrouted") == {"default"}
    assert charges("default") == [("tenant-b", 5)]  # outside the completion's transaction


@idempotent_task(key="event_id")
def ship(event_id: str, tenant: str) -> int:
    return Charge.objects.using(shard_of(tenant)).create(tenant=tenant, amount=1).pk


def test_idempotent_task_routes_with_the_tasks_hints(router: type[TenantShardRouter]) -> None:
    first = ship("event-1", "tenant-b")
    again = ship("event-1", "tenant-b")

    assert first == again
    assert records("shard_b") == [("task", "event-1", State.COMPLETED)]
    assert charges("shard_b") == [("tenant-b", 1)]
    assert len(router.asked) == 2  # once per run
    hints = router.asked[0][1]
    assert hints["tenant"] == "task"
    assert hints["operation"] == f"task {__name__}.ship"
    assert hints["arguments"] == {"event_id": "event-1", "tenant": "tenant-b"}
    assert hints["task"].__name__ == "ship"


# --- the databases that hold records ----------------------------------------


def test_the_records_databases_are_those_the_routers_let_records_migrate_to() -> None:
    assert databases.record_databases() == ["shard_a", "shard_b"]
    with override_settings(IDEMPOTENCY=sharded(DATABASE="default")):
        assert databases.record_databases() == ["default"]


def test_recovery_sweeps_every_shard_and_honours_database() -> None:
    stuck_in("shard_a", key="stuck-a")
    stuck_in("shard_b", key="stuck-b")

    only_a = recovery.recover_stale_records(database="shard_a")
    assert only_a.released == 1
    assert records("shard_a") == []
    assert [key for _, key, _ in records("shard_b")] == ["stuck-b"]

    stuck_in("shard_a", key="stuck-a2")
    listed = call(["idempotency_recover", "--dry-run"])
    assert "shard_a\t" in listed and "shard_b\t" in listed
    assert "2 stale record(s) would be handled" in listed
    assert "released 2," in call(["idempotency_recover"])
    assert records("shard_a") == records("shard_b") == []


@contextmanager
def records_table_missing(alias: str) -> Iterator[None]:
    """A shard whose records table is not there (never migrated, or being restored)."""
    table = IdempotencyRecord._meta.db_table
    quote = connections[alias].ops.quote_name
    with connections[alias].cursor() as cursor:
        cursor.execute(f"ALTER TABLE {quote(table)} RENAME TO {quote(table + '_away')}")
    try:
        yield
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"ALTER TABLE {quote(table + '_away')} RENAME TO {quote(table)}")


def test_a_broken_shard_stops_neither_recovery_nor_purge_of_the_others() -> None:
    """Both still fail visibly, naming the shard; the healthy shard is settled meanwhile."""
    stuck_in("shard_b", key="stuck-b")
    expired_in("shard_b", key="old-b")

    with records_table_missing("shard_a"):
        with pytest.raises(DatabaseError) as recovering:
            recovery.recover_stale_records()
        with pytest.raises(DatabaseError) as purging:
            purge.purge_expired_records(pause_factor=0)

    for failed in (recovering, purging):
        assert "records database 'shard_a' failed" in "\n".join(failed.value.__notes__)
    assert records("shard_b") == []


def test_purge_sweeps_every_shard_and_honours_database() -> None:
    expired_in("shard_a", key="old-a")
    expired_in("shard_b", key="old-b")
    record_in("shard_b", key="young-b")

    assert purge.expired_count() == 2
    assert "1 expired record(s)" in call(["idempotency_purge", "--dry-run", "--database=shard_b"])
    assert "deleted 1 record(s)" in call(["idempotency_purge", "--database=shard_b"])
    assert [key for _, key, _ in records("shard_a")] == ["old-a"]
    assert purge.purge_expired_records(pause_factor=0).deleted == 1
    assert records("shard_a") == []
    assert [key for _, key, _ in records("shard_b")] == ["young-b"]


def test_key_rotation_sweeps_every_shard_and_honours_database() -> None:
    plain_a = record_in("shard_a", key="plain-a")
    plain_b = record_in("shard_b", key="plain-b")

    def sealed(record: IdempotencyRecord) -> bool:
        return IdempotencyRecord.objects.using(record._state.db).get(pk=record.pk).response_sealed

    with override_settings(IDEMPOTENCY=sharded(ENCRYPTION_KEYS=[Fernet.generate_key().decode()])):
        assert "encrypted 1" in call(["idempotency_rotate_keys", "--database=shard_b"])
        assert (sealed(plain_a), sealed(plain_b)) == (False, True)
        assert "encrypted 1" in call(["idempotency_rotate_keys"])
    assert sealed(plain_a)


@pytest.mark.parametrize("command", ["idempotency_recover", "idempotency_purge"])
def test_a_database_without_records_is_refused_by_the_commands(command: str) -> None:
    with pytest.raises(CommandError, match="'default' holds no idempotency records"):
        call([command, "--database=default"])


def test_expire_leases_covers_every_shard() -> None:
    for alias in ("shard_a", "shard_b"):
        stuck_in(alias, lease_expires_at=timezone.now() + timedelta(hours=1))

    assert testing.expire_leases() == 2
    assert len(recovery.stale_records(limit=10)) == 2


def call(arguments: list[str]) -> str:
    from io import StringIO

    out = StringIO()
    call_command(*arguments, stdout=out)
    return out.getvalue()


# --- the admin ----------------------------------------------------------------


@pytest.fixture
def operator() -> Client:
    user = User.objects.create_superuser("operator", "op@example.com", "secret")
    client = Client()
    client.force_login(user)
    return client


def test_the_admin_lists_one_shard_at_a_time_with_a_database_selector(operator: Client) -> None:
    record_in("shard_a", tenant="tenant-a", key="in-a")
    record_in("shard_b", tenant="tenant-b", key="in-b")

    first = operator.get(CHANGELIST).content.decode()
    second = operator.get(CHANGELIST, {"database": "shard_b"}).content.decode()

    assert "By database" in first
    assert "in-a" in first and "in-b" not in first
    assert "in-b" in second and "in-a" not in second
    assert "?database=shard_b&amp;state=stuck" in second  # the counts stay on the shard
    assert operator.get(CHANGELIST, {"database": "default"}).status_code == 400


def test_the_admin_shows_no_selector_with_one_records_database(operator: Client) -> None:
    with override_settings(IDEMPOTENCY=sharded(DATABASE="shard_a")):
        page = operator.get(CHANGELIST).content.decode()
    assert "By database" not in page


def test_the_record_page_reads_the_shard_of_the_list_it_came_from(operator: Client) -> None:
    in_a = record_in("shard_a", tenant="tenant-a", key="page-a")
    record_in("shard_b", tenant="tenant-b", key="page-b", pk=in_a.pk)  # the same id

    page = operator.get(
        f"{CHANGELIST}{in_a.pk}/change/", {"_changelist_filters": "database=shard_b"}
    )

    assert page.status_code == 200
    assert "page-b" in page.content.decode() and "page-a" not in page.content.decode()


def test_an_admin_action_writes_in_the_records_own_shard(operator: Client) -> None:
    in_a = stuck_in("shard_a", tenant="tenant-a", key="act-a")
    in_b = stuck_in("shard_b", tenant="tenant-b", key="act-b", pk=in_a.pk)  # the same id

    page = operator.post(
        f"{CHANGELIST}?database=shard_b",
        {"action": "release", "_selected_action": [in_b.pk]},
    )
    assert "act-b" in page.content.decode()  # the confirmation page, from shard_b
    assert f'{CHANGELIST}?database=shard_b" class="button cancel-link"' in page.content.decode()
    done = operator.post(
        f"{CHANGELIST}?database=shard_b",
        {
            "action": "release",
            "_selected_action": [in_b.pk],
            "apply": "1",
            "reexecute": "on",
            f"token-{in_b.pk}": in_b.fencing_token,
            f"state-{in_b.pk}": in_b.state,
        },
        follow=True,
    )

    assert "1 record was released" in done.content.decode()
    assert records("shard_b") == []
    assert [key for _, key, _ in records("shard_a")] == ["act-a"]


def test_extend_retention_writes_in_the_records_own_shard(operator: Client) -> None:
    in_a = record_in("shard_a", key="keep-a")
    in_b = record_in("shard_b", key="keep-b", pk=in_a.pk)

    operator.post(
        f"{CHANGELIST}?database=shard_b",
        {"action": "extend_retention", "_selected_action": [in_b.pk], "apply": "1", "hours": 48},
    )

    def expiry(alias: str) -> Any:
        return IdempotencyRecord.objects.using(alias).get(pk=in_a.pk).expires_at

    assert expiry("shard_b") > timezone.now() + timedelta(hours=47)
    assert expiry("shard_a") == in_a.expires_at


# --- the checks -----------------------------------------------------------------


class RecordsNowhereRouter:
    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        return False if app_label == "django_idempotency" else None


def test_no_database_for_the_records_is_an_error() -> None:
    with override_settings(DATABASE_ROUTERS=[f"{__name__}.RecordsNowhereRouter"]):
        ids = {message.id for message in run_checks()}
    assert "django_idempotency.E023" in ids


def test_routed_records_databases_pass_the_checks() -> None:
    ids = {message.id for message in run_checks()}
    assert not {i for i in ids if i and i.startswith("django_idempotency.E")}


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_intent_pools_and_test_mirrors_are_not_swept_as_records_databases(
    settings: Any,
) -> None:
    """Routers often allow every migration; those aliases are other names of a records database."""
    default = settings.DATABASES["default"]
    settings.DATABASES = {
        **settings.DATABASES,
        "intents": {**default},
        "mirror": {**default, "TEST": {"MIRROR": "default"}},
    }
    settings.IDEMPOTENCY = {
        **settings.IDEMPOTENCY,
        "DATABASE": None,
        "INTENT_DATABASES": {"default": "intents"},
    }
    settings.DATABASE_ROUTERS = []  # every alias allows every migration
    swept = databases.record_databases()
    assert "default" in swept
    assert "intents" not in swept and "mirror" not in swept


def test_a_tenant_routed_where_no_records_live_is_a_clear_configuration_error() -> None:
    """Not a raw "relation does not exist": the router sends "tenant-z" to ``default``."""
    with pytest.raises(ImproperlyConfigured, match="tenant 'tenant-z' in 'default'"):
        APIClient().post(
            "/shard/charges",
            {"amount": 5},
            format="json",
            HTTP_IDEMPOTENCY_KEY="k-z",
            HTTP_X_TENANT="tenant-z",
        )
    assert records("shard_a") == records("shard_b") == []
