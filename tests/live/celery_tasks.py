"""Tasks run by the live tests' Celery worker (imported by ``tests.live.celery_app``).

``charge_once`` is a consumer written as the docs say: acknowledged late,
requeued when its worker process is lost, retried while another worker
holds the same message, and deduplicated by ``idempotent_task`` on the
message's event id. Its side effect is one ``Charge`` row (note = event id).

Every start of the body leaves a marker file ``<event id>.<pid>.<n>`` in
``IDEMPOTENCY_TEST_MARKER_DIR``, written after the Charge insert (which is
then still uncommitted), so a test knows when to kill the worker, and which
process to kill. The body's first start sleeps
``IDEMPOTENCY_TEST_FIRST_RUN_SLEEP`` seconds, widening the window for
duplicates and for the kill; a redelivery's start does not.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import shared_task

from django_idempotency.tasks import TaskInProgress, idempotent_task
from tests.testapp.models import Charge

MARKER_DIR_ENV = "IDEMPOTENCY_TEST_MARKER_DIR"
FIRST_RUN_SLEEP_ENV = "IDEMPOTENCY_TEST_FIRST_RUN_SLEEP"


def body_starts(marker_dir: Path, event_id: str) -> list[Path]:
    """The marker files of the body's starts for ``event_id``, oldest first."""
    return sorted(marker_dir.glob(f"{event_id}.*"), key=lambda path: path.stat().st_mtime_ns)


def _mark_start(event_id: str) -> int:
    """Leave this start's marker; return how many starts there were, this one included."""
    directory = os.environ.get(MARKER_DIR_ENV)
    if not directory:
        return 1
    marker_dir = Path(directory)
    (marker_dir / f"{event_id}.{os.getpid()}.{time.time_ns()}").touch()
    return len(body_starts(marker_dir, event_id))


@shared_task(
    bind=True,
    name="tests.live.celery_tasks.charge_once",
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(TaskInProgress,),
    retry_backoff=False,
    retry_kwargs={"countdown": 0.5},  # celery-types take default_retry_delay as whole seconds
    max_retries=240,
)
@idempotent_task(key="event_id")
def charge_once(self: Any, event_id: str, amount: int) -> dict[str, Any]:
    charge = Charge.objects.create(tenant="celery", amount=amount, note=event_id)
    if _mark_start(event_id) == 1:
        time.sleep(float(os.environ.get(FIRST_RUN_SLEEP_ENV, "0")))
    return {"charge_id": charge.pk, "amount": amount, "event_id": event_id}
