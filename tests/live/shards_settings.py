"""Settings of a sharded deployment for tests/live/test_shards_live.py.

Three PostgreSQL databases: ``default`` (``DATABASE_URL``) and the tenants'
shards ``shard_a`` and ``shard_b`` (``IDEMPOTENCY_TEST_SHARD_A_URL``,
``IDEMPOTENCY_TEST_SHARD_B_URL``); ``TenantShardRouter`` routes the records
by tenant (``IDEMPOTENCY["DATABASE"] = None``), the tenant is the
``X-Tenant`` header. Loaded by gunicorn, by ``migrate`` and by the Celery
worker (``IDEMPOTENCY_TEST_LEASE``: the lease, seconds).
"""

from __future__ import annotations

import os
from datetime import timedelta

import dj_database_url

from tests.settings import *  # noqa: F403  (the test settings, sharded)

DATABASES = {
    "default": dj_database_url.parse(os.environ["DATABASE_URL"]),
    "shard_a": dj_database_url.parse(os.environ["IDEMPOTENCY_TEST_SHARD_A_URL"]),
    "shard_b": dj_database_url.parse(os.environ["IDEMPOTENCY_TEST_SHARD_B_URL"]),
}
DATABASE_ROUTERS = ["tests.testapp.routers.TenantShardRouter"]
ROOT_URLCONF = "tests.testapp.shard_urls"
IDEMPOTENCY = {
    "DATABASE": None,
    "TENANT": "tests.testapp.shard_views.tenant_header",
    "LEASE": timedelta(seconds=float(os.environ.get("IDEMPOTENCY_TEST_LEASE", "120"))),
}
