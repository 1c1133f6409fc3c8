"""Records routed with the tenant's data, live: two PostgreSQL shards, gunicorn, Celery.

Three fresh PostgreSQL databases on the test server: ``default`` and the
shards ``shard_a`` (tenant-a) and ``shard_b`` (tenant-b), each migrated as
``TenantShardRouter`` allows (the records' table exists in the shards only);
gunicorn (4 sync workers) serving ``tests.live.shards_settings``
(``IDEMPOTENCY["DATABASE"] = None``, a 2 s lease); a Celery worker on the
same settings, with a reconciler for the view's operation
(``tests.live.shards_reconciler``). Over HTTP:

- each tenant's record and Charge land in its shard, nowhere else;
- a failing view rolls back its Charge and releases its claim in its shard;
- a worker SIGKILLed after ``begin_external()`` leaves an IN_PROGRESS
  record in each shard; one ``recover_stale_records`` task settles both,
  each in its own shard, and the clients' retries replay the outcome;
- one ``purge_expired_records`` task purges expired records in both shards;
- 50 same-key requests per tenant at once: one execution per shard.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.live.celery_harness import (
    CeleryProcess,
    QueueClient,
    celery_environment,
    new_queue,
    redis_db,
    require_redis,
)
from tests.live.hooks import CRASH_NOTE, slow_note
from tests.live.server import (
    Call,
    LiveDatabase,
    LiveServer,
    Project,
    fire_together,
    post,
)
from tests.live.services import require_postgres

pytestmark = [pytest.mark.postgres, pytest.mark.live]

SHARDS_PROJECT = Project(
    settings="tests.live.shards_settings",
    app="tests.live.wsgi:application",
    ready_path="/shard/charges",
    ready_statuses=(405,),  # POST only: the app is loaded
)
LEASE_SECONDS = 2.0
TENANT_SHARD = {"tenant-a": "shard_a", "tenant-b": "shard_b"}


@dataclass
class Shards:
    server: LiveServer
    databases: dict[str, LiveDatabase]
    worker: CeleryProcess
    tasks: QueueClient

    def run(self, task: str, **kwargs: Any) -> Any:
        """Send ``task`` to the worker and wait for its result."""
        return self.tasks.run(task, **kwargs)

    def charge(self, tenant: str, key: str, **body: Any) -> Any:
        return post(
            f"{self.server.url}/shard/charges",
            {"amount": 5, **body},
            {"Idempotency-Key": key, "X-Tenant": tenant},
        )

    def records(self, alias: str, key: str) -> list[tuple[Any, ...]]:
        return self.databases[alias].query(
            "SELECT tenant, state, response_status, response_body FROM django_idempotency_record "
            'WHERE "key" = %s',
            [key],
        )

    def charges(self, alias: str, tenant: str) -> list[tuple[Any, ...]]:
        return self.databases[alias].query(
            "SELECT amount, note FROM testapp_charge WHERE tenant = %s", [tenant]
        )

    def describe(self) -> str:
        return f"{self.server.diagnostics(40)}\n{self.worker.diagnostics()}"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shards]:
    server_url = require_postgres()
    broker = require_redis()
    log_dir = tmp_path_factory.mktemp("shards")
    with contextlib.ExitStack() as stack:
        stack.enter_context(redis_db(broker))
        databases = {
            alias: stack.enter_context(LiveDatabase(server_url, prefix=f"idem_{alias}"))
            for alias in ("default", "shard_a", "shard_b")
        }
        env = {
            "IDEMPOTENCY_TEST_SHARD_A_URL": databases["shard_a"].url,
            "IDEMPOTENCY_TEST_SHARD_B_URL": databases["shard_b"].url,
            "IDEMPOTENCY_TEST_LEASE": str(LEASE_SECONDS),
        }
        server = LiveServer(databases["default"], project=SHARDS_PROJECT, extra_env=env)
        stack.callback(server.stop)
        for alias in databases:
            server.manage("migrate", "--noinput", "--database", alias)
        queue = new_queue()
        worker_env = celery_environment(
            databases["default"],
            broker,
            queue,
            DJANGO_SETTINGS_MODULE=SHARDS_PROJECT.settings,
            IDEMPOTENCY_TEST_CELERY_IMPORTS="tests.live.shards_reconciler",
            **env,
        )
        worker = CeleryProcess.worker(worker_env, log_dir / "worker.log", concurrency=1)
        stack.callback(worker.stop)
        worker.start_worker()
        tasks = QueueClient(broker, queue, "idempotency-live-shards")
        stack.callback(tasks.close)
        server.start()
        yield Shards(server, databases, worker, tasks)
        server.cleanup_logs()


def new_key() -> str:
    return f"shard-{uuid.uuid4().hex[:12]}"


def test_each_tenants_record_and_rows_land_in_its_shard_and_nowhere_else(shards: Shards) -> None:
    key = new_key()
    answers = {tenant: shards.charge(tenant, key, amount=7) for tenant in TENANT_SHARD}

    for tenant, alias in TENANT_SHARD.items():
        answer = answers[tenant]
        assert answer.status == 201, answer.describe()
        assert json.loads(answer.body)["database"] == alias
        other = "shard_b" if alias == "shard_a" else "shard_a"
        assert [row[:3] for row in shards.records(alias, key)] == [(tenant, "COMPLETED", 201)]
        assert shards.charges(alias, tenant) == [(7, "")]
        assert tenant not in {row[0] for row in shards.records(other, key)}
        assert shards.charges(other, tenant) == []
        assert shards.charges("default", tenant) == []
    # The records' table exists in the shards only: the router allows nothing else.
    assert shards.databases["default"].query(
        "SELECT to_regclass('django_idempotency_record') IS NULL"
    ) == [(True,)]


def test_a_failing_view_rolls_back_and_releases_in_its_shard(shards: Shards) -> None:
    key = new_key()
    failed = shards.charge("tenant-b", key, amount=11, fail=True)

    assert failed.status == 500, failed.describe()
    assert shards.records("shard_b", key) == []
    assert (11, "") not in shards.charges("shard_b", "tenant-b")
    retried = shards.charge("tenant-b", key, amount=11)
    assert retried.status == 201, retried.describe()
    assert [row[1] for row in shards.records("shard_b", key)] == ["COMPLETED"]


def test_a_crash_after_begin_external_is_settled_in_its_shard_by_celery_recovery(
    shards: Shards,
) -> None:
    key = new_key()
    crashed = {
        tenant: shards.charge(tenant, key, amount=13, external=True, note=CRASH_NOTE)
        for tenant in TENANT_SHARD
    }
    for tenant, alias in TENANT_SHARD.items():
        assert crashed[tenant].status is None, crashed[tenant].describe()  # the worker died
        assert [row[:2] for row in shards.records(alias, key)] == [(tenant, "IN_PROGRESS")]
        assert shards.charges(alias, tenant).count((13, CRASH_NOTE)) == 0  # rolled back
    time.sleep(LEASE_SECONDS + 0.5)

    report = shards.run("django_idempotency.tasks.recover_stale_records")

    assert report["completed"] >= 2, (report, shards.describe())
    for tenant, alias in TENANT_SHARD.items():
        [(_, state, status, body)] = shards.records(alias, key)
        assert (state, status) == ("COMPLETED", 201)
        assert json.loads(bytes(body)) == {"reconciled": True, "database": alias}
        replay = shards.charge(tenant, key, amount=13, external=True, note=CRASH_NOTE)
        assert replay.status == 201, replay.describe()
        assert replay.replayed
        assert json.loads(replay.body) == {"reconciled": True, "database": alias}


def test_one_purge_task_purges_both_shards(shards: Shards) -> None:
    keys = {tenant: new_key() for tenant in TENANT_SHARD}
    for tenant, key in keys.items():
        assert shards.charge(tenant, key).status == 201
        shards.databases[TENANT_SHARD[tenant]].query(
            "UPDATE django_idempotency_record SET expires_at = now() - interval '1 minute' "
            'WHERE "key" = %s RETURNING id',
            [key],
        )

    report = shards.run("django_idempotency.tasks.purge_expired_records", pause_factor=0)

    assert report["deleted"] >= 2, (report, shards.describe())
    for tenant, key in keys.items():
        assert shards.records(TENANT_SHARD[tenant], key) == []


def test_fifty_same_key_requests_per_tenant_run_once_per_shard(shards: Shards) -> None:
    key = new_key()
    note = f"race-{key}{slow_note(0.3)}"
    calls = [
        Call(
            f"{shards.server.url}/shard/charges",
            {"amount": 17, "note": note},
            {"Idempotency-Key": key, "X-Tenant": tenant},
        )
        for tenant in TENANT_SHARD
        for _ in range(50)
    ]

    results = fire_together(calls, timeout=60)

    described = "\n".join(
        result.describe() for result in results if result.status not in (201, 409)
    )
    assert {result.status for result in results} <= {201, 409}, described
    for tenant, alias in TENANT_SHARD.items():
        assert shards.charges(alias, tenant).count((17, note)) == 1, shards.describe()
        assert [row[:2] for row in shards.records(alias, key)] == [(tenant, "COMPLETED")]
        assert shards.charges("default", tenant) == []
