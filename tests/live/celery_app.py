"""The Celery app of the live tests' worker and beat processes.

    DATABASE_URL=postgres://.../idem_celery_xxx \\
    IDEMPOTENCY_TEST_BROKER_URL=redis://127.0.0.1:6379/12 \\
    IDEMPOTENCY_TEST_CELERY_QUEUE=q-1234 \\
    python -m celery -A tests.live.celery_app worker

Configured from the environment (``tests.live.celery_harness`` sets it):

- ``IDEMPOTENCY_TEST_BROKER_URL``: the Redis broker, also the result backend;
- ``IDEMPOTENCY_TEST_CELERY_QUEUE``: the one queue every task goes to and
  the worker consumes, unique per test so runs never see each other's
  messages;
- ``IDEMPOTENCY_TEST_BEAT_INTERVAL``: seconds; when set, the beat schedule
  is ``django_idempotency.tasks.BEAT_SCHEDULE`` as shipped (entry names and
  task names), only with this interval, which proves the shipped task names
  are the registered ones;
- ``IDEMPOTENCY_TEST_VISIBILITY_TIMEOUT``: seconds after which Redis hands an
  unacknowledged message (its worker died) to another worker;
- ``IDEMPOTENCY_TEST_CELERY_IMPORTS``: more modules to import, comma-separated
  (a test's reconciler).

Tasks are acknowledged late and rejected (requeued) when their worker
process is lost, the settings ``idempotent_task`` is documented with.
"""

from __future__ import annotations

import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.live.celery_settings")
django.setup()

from celery import Celery  # noqa: E402  (after django.setup(): the tasks import models)

from django_idempotency.tasks import BEAT_SCHEDULE  # noqa: E402

BROKER_URL_ENV = "IDEMPOTENCY_TEST_BROKER_URL"
QUEUE_ENV = "IDEMPOTENCY_TEST_CELERY_QUEUE"
BEAT_INTERVAL_ENV = "IDEMPOTENCY_TEST_BEAT_INTERVAL"
VISIBILITY_TIMEOUT_ENV = "IDEMPOTENCY_TEST_VISIBILITY_TIMEOUT"
IMPORTS_ENV = "IDEMPOTENCY_TEST_CELERY_IMPORTS"


def beat_schedule(interval: float) -> dict[str, dict[str, Any]]:
    """The shipped ``BEAT_SCHEDULE``, every entry firing every ``interval`` seconds."""
    return {name: {**entry, "schedule": interval} for name, entry in BEAT_SCHEDULE.items()}


broker_url = os.environ.get(BROKER_URL_ENV, "redis://127.0.0.1:6379/12")
visibility_timeout = float(os.environ.get(VISIBILITY_TIMEOUT_ENV, "3600"))
beat_interval = os.environ.get(BEAT_INTERVAL_ENV)
#: More task or reconciler modules, comma-separated (a test's own reconciler).
extra_imports = [name for name in os.environ.get(IMPORTS_ENV, "").split(",") if name]

app = Celery("idempotency_live_tests")
app.conf.update(
    broker_url=broker_url,
    result_backend=broker_url,
    result_expires=3600,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": visibility_timeout,
        # Look for abandoned messages every second, not every 100 s.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_default_queue=os.environ.get(QUEUE_ENV, "idempotency-live-tests"),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    imports=["django_idempotency.tasks", "tests.live.celery_tasks", *extra_imports],
    beat_schedule=beat_schedule(float(beat_interval)) if beat_interval else {},
    timezone="UTC",
)
