"""The demo project's settings on a fleet host (``tests/fleet/hosts.py`` sets the environment).

- Every wait on the database is bounded, as a host cut off the network
  needs: libpq's ``connect_timeout``, TCP keepalives (an idle connection to
  a vanished server is noticed) and ``tcp_user_timeout`` (data sent and
  never acknowledged fails the connection); the values come from
  ``FLEET_PG_*`` variables so the tests and docs/fleet.md quote the same.
- Each host runs its own ``celery beat``, on purpose (a common
  misconfiguration): recovery and purge every ``FLEET_BEAT_INTERVAL``
  seconds instead of every minute, same entry and task names as shipped.
- ``tests.fleet.recovery_audit`` is imported by the Celery worker: it
  writes a line for every settlement recovery commits, so the test can
  count them per record.
- Requests arrive through the load balancer under any Host name.
- ``tests.fleet.fleet_urls`` adds a view that holds its record's row lock
  for as long as asked (the partition test's).
"""

from __future__ import annotations

import os

from django_idempotency.tasks import BEAT_SCHEDULE
from tests.live.payments_settings import *  # noqa: F403
from tests.live.payments_settings import DATABASES, IDEMPOTENCY

ALLOWED_HOSTS = ["*"]

DATABASES["default"]["OPTIONS"] = {
    "connect_timeout": int(os.environ.get("FLEET_PG_CONNECT_TIMEOUT", "3")),
    "keepalives": 1,
    "keepalives_idle": int(os.environ.get("FLEET_PG_KEEPALIVES_IDLE", "5")),
    "keepalives_interval": int(os.environ.get("FLEET_PG_KEEPALIVES_INTERVAL", "2")),
    "keepalives_count": int(os.environ.get("FLEET_PG_KEEPALIVES_COUNT", "3")),
    # Milliseconds.
    "tcp_user_timeout": int(os.environ.get("FLEET_PG_TCP_USER_TIMEOUT_MS", "20000")),
}

IDEMPOTENCY = {
    **IDEMPOTENCY,
    "IN_FLIGHT": os.environ.get("FLEET_IN_FLIGHT", "conflict"),
    # How long a duplicate (or a takeover) waits on another session's lock
    # on the record before answering 409.
    "IN_FLIGHT_WAIT": float(os.environ.get("FLEET_IN_FLIGHT_WAIT", "3")),
}
ROOT_URLCONF = "tests.fleet.fleet_urls"

_interval = float(os.environ.get("FLEET_BEAT_INTERVAL", "1"))
CELERY_BEAT_SCHEDULE = {
    name: {**entry, "schedule": _interval} for name, entry in BEAT_SCHEDULE.items()
}
CELERY_IMPORTS = ["tests.fleet.recovery_audit"]
