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

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import shared_task

from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, Release, register_reconciler
from django_idempotency.tasks import TaskInProgress, idempotent_task, message_id
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


#: The options of every task here: redelivered when its worker dies
#: (acks_late, reject_on_worker_lost), retried every half second while
#: another worker holds its key. (celery-types take default_retry_delay as
#: whole seconds, hence the countdown.)
REDELIVERED: dict[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "autoretry_for": (TaskInProgress,),
    "retry_backoff": False,
    "retry_kwargs": {"countdown": 0.5},
    "max_retries": 240,
}


@shared_task(
    bind=True,
    name="tests.live.celery_tasks.charge_once",
    **REDELIVERED,
)
@idempotent_task(key="event_id")
def charge_once(self: Any, event_id: str, amount: int) -> dict[str, Any]:
    charge = Charge.objects.create(tenant="celery", amount=amount, note=event_id)
    if _mark_start(event_id) == 1:
        time.sleep(float(os.environ.get(FIRST_RUN_SLEEP_ENV, "0")))
    return {"charge_id": charge.pk, "amount": amount, "event_id": event_id}


@shared_task(
    bind=True,
    name="tests.live.celery_tasks.charge_per_message",
    **REDELIVERED,
)
@idempotent_task(key=message_id)
def charge_per_message(self: Any, note: str, amount: int) -> dict[str, Any]:
    """``charge_once`` without an event id: keyed on the Celery message id."""
    charge = Charge.objects.create(tenant="celery", amount=amount, note=note)
    if _mark_start(note) == 1:
        time.sleep(float(os.environ.get(FIRST_RUN_SLEEP_ENV, "0")))
    return {"charge_id": charge.pk, "message": self.request.id}


# -- a payout task calling a provider -------------------------------------------------------
#
# ``send_payout`` calls a stand-in payout provider that lives in Redis (so
# that every worker process, and the test, see the same one): it counts its
# calls and keeps one transfer per idempotency key, as real providers do.
# With ``IDEMPOTENCY_TEST_PAUSE_AT=<point>`` the body leaves a marker
# ``pause-<payout id>.<pid>`` at that point and sleeps, for the test to kill
# its worker there: ``in-call`` (the provider made the transfer, its answer
# is not back), ``after-call`` (answered; set_provider_operation() not yet
# called), ``after-set-provider-operation`` (recorded; the body not yet
# committed).

PAUSE_AT_ENV = "IDEMPOTENCY_TEST_PAUSE_AT"
PAUSE_SECONDS = 60.0


class PayoutProvider:
    """The stand-in provider: Redis keys under ``idem-live-provider:<queue>:``."""

    def __init__(self, url: str, namespace: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)
        self.prefix = f"idem-live-provider:{namespace}"

    @classmethod
    def from_environment(cls) -> PayoutProvider:
        return cls(
            os.environ.get("IDEMPOTENCY_TEST_BROKER_URL", "redis://127.0.0.1:6379/12"),
            os.environ.get("IDEMPOTENCY_TEST_CELERY_QUEUE", "idempotency-live-tests"),
        )

    def transfer(self, amount: int, idempotency_key: str, on_done: Any = None) -> str:
        """One transfer per key (the same id for a repeated key); every call counted."""
        self.client.incr(f"{self.prefix}:calls")
        made = json.dumps({"id": f"tr_{time.time_ns()}", "amount": amount})
        self.client.hsetnx(f"{self.prefix}:transfers", idempotency_key, made)
        if on_done is not None:
            on_done()  # the transfer is made; its answer is not back yet
        found = self.find(idempotency_key)
        assert found is not None
        return str(found["id"])

    def find(self, idempotency_key: str) -> dict[str, Any] | None:
        found = self.client.hget(f"{self.prefix}:transfers", idempotency_key)
        return json.loads(found) if found is not None else None

    def calls(self) -> int:
        return int(self.client.get(f"{self.prefix}:calls") or 0)


def _pause_at(point: str, payout_id: str) -> None:
    if os.environ.get(PAUSE_AT_ENV) != point:
        return
    directory = Path(os.environ[MARKER_DIR_ENV])
    (directory / f"pause-{payout_id}.{os.getpid()}").touch()
    time.sleep(PAUSE_SECONDS)


@shared_task(
    bind=True,
    name="tests.live.celery_tasks.send_payout",
    **REDELIVERED,
)
@idempotent_task(key="payout_id")
def send_payout(self: Any, payout_id: str, amount: int) -> dict[str, Any]:
    _mark_start(payout_id)
    claim = self.request.idempotency
    provider_key = claim.begin_external()
    provider = PayoutProvider.from_environment()
    transfer = provider.transfer(
        amount, provider_key, on_done=lambda: _pause_at("in-call", payout_id)
    )
    _pause_at("after-call", payout_id)
    claim.set_provider_operation(transfer)
    _pause_at("after-set-provider-operation", payout_id)
    Charge.objects.create(tenant="celery", amount=amount, note=payout_id)
    return {"payout": payout_id, "transfer": transfer}


@register_reconciler("task tests.live.celery_tasks.send_payout")
def settle_payout(record: IdempotencyRecord) -> Completed | Release:
    """Asks the provider by the record's provider key, as a payout task's reconciler does."""
    transfer = PayoutProvider.from_environment().find(record.provider_key)
    if transfer is None:
        return Release()  # never made: the next delivery runs the body
    # What the body would have committed, committed with the outcome.
    Charge.objects.create(tenant="celery", amount=transfer["amount"], note=record.key)
    return Completed(body={"payout": record.key, "transfer": transfer["id"]})
