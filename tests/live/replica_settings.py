"""Settings for the replica tests: ``tests.settings`` with a lagging read replica.

- ``DATABASES["default"]``: ``DATABASE_URL``, the primary (the records
  database: ``IDEMPOTENCY["DATABASE"]`` keeps its default, ``"default"``).
- ``DATABASES["replica"]``: ``IDEMPOTENCY_TEST_REPLICA_URL``, a hot standby
  streaming from it (``tests/live/replica.py``), whose replay the tests
  pause to stand for replication lag.
- ``ReadReplicaRouter`` sends every read of every model to ``replica`` and
  every write to ``default``; migrations run on ``default`` only.
- ``IDEMPOTENCY_LEASE`` (seconds): ``IDEMPOTENCY["LEASE"]``, short, so that
  a record left by a killed worker is stale within the test.

Sessions are signed cookies: with every read on a replica that lags, a
session row written at login would not be found by the next request. That
is the project's concern (keep sessions off replicas that lag), not the
records'; the user the admin tests log in as exists on the replica, made
before replay was paused.
"""

from __future__ import annotations

import os

import dj_database_url

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES["replica"] = dj_database_url.parse(os.environ["IDEMPOTENCY_TEST_REPLICA_URL"])
DATABASE_ROUTERS = ["tests.configurations.routers.ReadReplicaRouter"]
SESSION_ENGINE = "django.contrib.sessions.backends.signed_cookies"

IDEMPOTENCY: dict[str, object] = {}
if os.environ.get("IDEMPOTENCY_LEASE"):
    IDEMPOTENCY["LEASE"] = float(os.environ["IDEMPOTENCY_LEASE"])
