"""Tasks of Django's Tasks framework deduplicated by ``idempotent_task``.

Run by the database backend's worker (``manage.py db_worker``), in the
test process (tests/test_tasks_framework.py) or in worker processes of
their own (tests/test_tasks_framework_workers.py). Each body's side effect
is one ``Charge`` row whose note is the task's key.

What a worker process is told by its environment:

- ``IDEMPOTENCY_TEST_MARKER_DIR``: every start of a body leaves a marker
  file ``<key>.<pid>.<n>`` there, after its insert (then still
  uncommitted), so a test knows when to kill the worker;
- ``IDEMPOTENCY_TEST_FIRST_START_SLEEP``: seconds the first start of a
  body for a key sleeps at that point, widening the window for a duplicate
  or a kill (a later start, which took a dead worker's claim over, does
  not sleep);
- ``IDEMPOTENCY_TEST_PROVIDER_DIR``: the payout provider's files (below).

The lease is short (``LEASE``), so that a dead worker's claim can be
taken over within a test.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from django_idempotency.django_tasks import idempotent_task, task_idempotency
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, Release, register_reconciler
from tests.testapp.models import Charge

try:  # Django 6.0 and later
    from django.tasks import TaskContext, task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext, task  # type: ignore[no-redef,assignment,unused-ignore]

MARKER_DIR_ENV = "IDEMPOTENCY_TEST_MARKER_DIR"
FIRST_START_SLEEP_ENV = "IDEMPOTENCY_TEST_FIRST_START_SLEEP"
PROVIDER_DIR_ENV = "IDEMPOTENCY_TEST_PROVIDER_DIR"

#: Seconds a run holds its key: a killed worker's claim is free after this.
LEASE = 2.0


def body_starts(marker_dir: Path, key: str) -> list[Path]:
    """The marker files of the body's starts for ``key``, oldest first."""
    return sorted(marker_dir.glob(f"{key}.*"), key=lambda path: path.stat().st_mtime_ns)


def _started(key: str) -> None:
    """Leave this start's marker; the key's first start then sleeps if the test asked."""
    directory = os.environ.get(MARKER_DIR_ENV)
    if not directory:
        return
    (Path(directory) / f"{key}.{os.getpid()}.{time.time_ns()}").touch()
    if len(body_starts(Path(directory), key)) == 1:
        time.sleep(float(os.environ.get(FIRST_START_SLEEP_ENV) or 0))


class ChargeDeclined(Exception):
    pass


@task()
@idempotent_task(key="order_id", lease=LEASE)
def charge_order(order_id: str, amount: int, decline: bool = False) -> dict[str, Any]:
    charge = Charge.objects.create(tenant="tasks", amount=amount, note=order_id)
    _started(order_id)
    if decline:
        raise ChargeDeclined(f"order {order_id}: declined after the charge's insert")
    return {"charge": charge.pk, "amount": amount}


@task(takes_context=True)
@idempotent_task(key="order_id", lease=LEASE)
def charge_order_in_context(
    context: TaskContext[Any, Any], order_id: str, amount: int
) -> dict[str, Any]:
    """``charge_order`` taking the task's context: its result names the run that charged."""
    charge = Charge.objects.create(tenant="tasks", amount=amount, note=order_id)
    _started(order_id)
    return {"charge": charge.pk, "charged_by": str(context.task_result.id)}


@task()
@idempotent_task(key=lambda event, **_: event["id"], lease=LEASE)
def charge_event(event: dict[str, Any]) -> int:
    """Keyed by a callable over the arguments: the event's own id."""
    return Charge.objects.create(tenant="tasks", amount=event["amount"], note=event["id"]).pk


# -- a payout through a provider ---------------------------------------------------------
#
# The stand-in provider keeps one transfer per idempotency key, as real ones
# do, in files of its own directory (so that every worker process and the
# test see it), and counts its calls.


class PayoutProvider:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def from_environment(cls) -> PayoutProvider:
        return cls(Path(os.environ[PROVIDER_DIR_ENV]))

    def transfer(self, amount: int, idempotency_key: str) -> str:
        """One transfer per key (the same id for a repeated key); every call counted."""
        with (self.directory / "calls").open("a") as calls:
            calls.write(f"{idempotency_key}\n")
        made = self.directory / f"transfer-{idempotency_key}"
        try:
            with made.open("x") as file:
                file.write(f"tr_{uuid.uuid4().hex[:12]} {amount}")
        except FileExistsError:
            pass
        found = self.find(idempotency_key)
        assert found is not None
        return found[0]

    def find(self, idempotency_key: str) -> tuple[str, int] | None:
        try:
            transfer_id, amount = (
                (self.directory / f"transfer-{idempotency_key}").read_text().split()
            )
        except FileNotFoundError:
            return None
        return transfer_id, int(amount)

    def calls(self) -> int:
        try:
            return len((self.directory / "calls").read_text().splitlines())
        except FileNotFoundError:
            return 0


@task(takes_context=True)
@idempotent_task(key="payout_id", lease=LEASE)
def send_payout(
    context: TaskContext[Any, Any], payout_id: str, amount: int, answer_lost: bool = False
) -> dict[str, Any]:
    """Pays through the provider; ``answer_lost``: the provider's answer never comes back."""
    claim = task_idempotency()
    # IN_PROGRESS and the key, committed now; held for the task's lease (without
    # lease=, begin_external() holds the record for IDEMPOTENCY["LEASE"]).
    provider_key = claim.begin_external(lease=LEASE)
    transfer = PayoutProvider.from_environment().transfer(amount, provider_key)
    _started(payout_id)  # the transfer is made; the worker may die here
    if answer_lost:
        raise TimeoutError(f"payout {payout_id}: the provider did not answer in time")
    claim.set_provider_operation(transfer)
    Charge.objects.create(tenant="tasks", amount=amount, note=payout_id)
    return {"payout": payout_id, "transfer": transfer}


@register_reconciler("task tests.testapp.background_tasks.send_payout")
def settle_payout(record: IdempotencyRecord) -> Completed | Release:
    """Asks the provider by the record's provider key, as a payout's reconciler does."""
    found = PayoutProvider.from_environment().find(record.provider_key)
    if found is None:
        return Release()  # never made: the next enqueue runs the body
    transfer, amount = found
    # What the body would have committed, committed with the outcome.
    Charge.objects.create(tenant="tasks", amount=amount, note=record.key)
    return Completed(body={"payout": record.key, "transfer": transfer})
