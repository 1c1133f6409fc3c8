"""``idempotent_task`` in real ``db_worker`` processes of Django's Tasks framework.

The database backend (``django-tasks-db``) on PostgreSQL: tasks enqueued
from the test as rows of the run's test database, run by ``python -m
django db_worker`` processes with the test settings
(``tests.live.db_workers``). The tasks are
``tests/testapp/background_tasks.py``, with a lease of two seconds; their
side effect is a ``Charge`` row, and each start of a body leaves a marker
file after its (uncommitted) insert. Each test starts two workers.

1. The same key enqueued twice, picked up by two workers at once: one
   runs the body, the other's run fails with ``TaskInProgress`` (the
   framework does not retry it); enqueued again, it gets the stored result.
2. A worker SIGKILLed mid-task: its task stays RUNNING and no worker runs
   it again. What the user does: enqueue the same key again once the lease
   has run out; that run takes the dead worker's claim over, and the
   charge is made once.
3. A body slower than its lease, still running: the key enqueued again
   after the lease takes it over and charges; the slow run's commit is
   refused by the fencing token (``TaskInProgress``), its charge rolled back.
4. A worker SIGKILLed after its body called the provider: the record is
   IN_PROGRESS, and enqueueing the key again does not call the provider
   again (``TaskInProgress``, then ``TaskOutcomeUncertain``). Recovery
   (``manage.py idempotency_recover``) asks the task's reconciler, which
   finds the transfer; enqueued again, the task returns its result.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from django_idempotency.exceptions import TaskInProgress, TaskOutcomeUncertain
from django_idempotency.models import IdempotencyRecord
from tests.live.db_workers import POLL_INTERVAL, DbWorker, wait_until
from tests.testapp.background_tasks import (
    FIRST_START_SLEEP_ENV,
    LEASE,
    MARKER_DIR_ENV,
    PROVIDER_DIR_ENV,
    PayoutProvider,
    body_starts,
    charge_order,
    charge_order_in_context,
    send_payout,
)
from tests.testapp.models import Charge

pytestmark = [pytest.mark.postgres, pytest.mark.live, pytest.mark.django_db(transaction=True)]
State = IdempotencyRecord.State
#: Seconds to wait for a worker to finish a task it can run at once.
RESULT_TIMEOUT = 20.0


class Workers:
    """Two workers, started together, sharing the test's marker and provider directories."""

    def __init__(self, directory: Path, first_start_sleep: float) -> None:
        self.markers = directory / "markers"
        self.provider = PayoutProvider(directory / "provider")
        self.markers.mkdir()
        self.provider.directory.mkdir()
        environment = {
            MARKER_DIR_ENV: str(self.markers),
            PROVIDER_DIR_ENV: str(self.provider.directory),
            FIRST_START_SLEEP_ENV: str(first_start_sleep),
        }
        self.all = [DbWorker(directory, environment) for _ in range(2)]

    def start(self) -> Workers:
        for worker in self.all:
            worker.spawn()
        for worker in self.all:
            worker.wait_until_ready()
        return self

    def stop(self) -> None:
        for worker in self.all:
            worker.stop()

    def running(self, result: Any) -> DbWorker:
        """The worker that took ``result`` from the queue."""
        (worker_id,) = state_of(result).worker_ids
        return next(worker for worker in self.all if worker.worker_id == worker_id)

    def starts(self, key: str) -> list[Path]:
        return body_starts(self.markers, key)

    def wait_for_start(self, key: str) -> None:
        wait_until(lambda: bool(self.starts(key)), RESULT_TIMEOUT, self.diagnostics)

    def diagnostics(self) -> str:
        return "\n".join(worker.diagnostics() for worker in self.all)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[[float], Workers]]:
    """``workers(first_start_sleep)`` starts two; they are stopped before the test
    database is flushed under them."""
    started: list[Workers] = []

    def start(first_start_sleep: float) -> Workers:
        started.append(Workers(tmp_path, first_start_sleep))
        return started[-1].start()

    try:
        yield start
    finally:
        for each in started:
            each.stop()


def state_of(result: Any) -> Any:
    return result.task.get_result(result.id)


def wait_for_end(result: Any, workers: Workers) -> Any:
    wait_until(
        lambda: state_of(result).is_finished,
        RESULT_TIMEOUT,
        lambda: f"{state_of(result).status}\n{workers.diagnostics()}",
    )
    return state_of(result)


def error_class(result: Any) -> type[BaseException]:
    assert result.status == "FAILED", result.status
    return result.errors[-1].exception_class  # type: ignore[no-any-return]


def charges(key: str) -> list[int]:
    return list(Charge.objects.filter(note=key).values_list("amount", flat=True))


def record(task: Any, key: str) -> IdempotencyRecord:
    operation = f"task {task.module_path}"
    return IdempotencyRecord.objects.get(tenant="task", operation=operation, key=key)


def new_key(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:12]}"


def after_the_lease(since: float) -> None:
    """Sleep until the lease of a claim made by ``since`` (monotonic) has run out."""
    time.sleep(max(0.0, since + LEASE + 0.3 - time.monotonic()))


def test_the_same_key_on_two_workers_at_once_charges_once(
    workers: Callable[[float], Workers],
) -> None:
    both = workers(1.5)
    key = new_key("order")

    results = [charge_order_in_context.enqueue(key, 12) for _ in range(2)]
    ended = [wait_for_end(result, both) for result in results]

    by_status = {result.status: result for result in ended}
    assert set(by_status) == {"SUCCESSFUL", "FAILED"}, both.diagnostics()
    assert error_class(by_status["FAILED"]) is TaskInProgress
    assert {result.worker_ids[0] for result in ended} == {w.worker_id for w in both.all}
    assert charges(key) == [12]
    assert len(both.starts(key)) == 1
    # The framework does not retry the refused run: enqueued again, it gets the result.
    again = wait_for_end(charge_order_in_context.enqueue(key, 12), both)
    charged = by_status["SUCCESSFUL"]
    assert again.return_value == charged.return_value
    assert again.return_value["charged_by"] == charged.id
    assert charges(key) == [12]


def test_a_killed_workers_task_stays_running_and_an_enqueue_after_the_lease_charges_once(
    workers: Callable[[float], Workers],
) -> None:
    both = workers(60.0)
    key = new_key("order")

    lost = charge_order.enqueue(key, 25)
    both.wait_for_start(key)
    claimed_by = time.monotonic()
    assert charges(key) == []  # inserted, not committed
    assert record(charge_order, key).state == State.CLAIMED
    doomed = both.running(lost)
    doomed.kill()

    after_the_lease(claimed_by)
    time.sleep(10 * POLL_INTERVAL)  # ten looks for ready tasks by the other worker
    # The backend never runs a RUNNING task again: it stays as the dead worker left it.
    left = state_of(lost)
    assert (left.status, left.worker_ids) == ("RUNNING", [doomed.worker_id])
    assert len(both.starts(key)) == 1
    assert charges(key) == []

    # What the user does: enqueue the key again. Past the lease, it takes the claim over.
    retried = wait_for_end(charge_order.enqueue(key, 25), both)

    assert retried.status == "SUCCESSFUL", both.diagnostics()
    assert retried.worker_ids != [doomed.worker_id]
    assert charges(key) == [25]
    taken = record(charge_order, key)
    assert (taken.state, taken.fencing_token) == (State.COMPLETED, 2)
    assert state_of(lost).status == "RUNNING"
    duplicate = wait_for_end(charge_order.enqueue(key, 25), both)
    assert duplicate.return_value == retried.return_value
    assert charges(key) == [25]
    assert len(both.starts(key)) == 2


def test_a_body_still_running_past_its_lease_is_taken_over_and_its_late_commit_refused(
    workers: Callable[[float], Workers],
) -> None:
    """No time limit stops a slow body: the key enqueued again after the lease runs it
    again; the first run's commit then fails on the fencing token and rolls back."""
    both = workers(LEASE + 3.0)  # the first start outlives its lease, then finishes
    key = new_key("slow")

    slow = charge_order.enqueue(key, 30)
    both.wait_for_start(key)
    after_the_lease(time.monotonic())
    taken_over = wait_for_end(charge_order.enqueue(key, 30), both)

    assert taken_over.status == "SUCCESSFUL", both.diagnostics()
    assert record(charge_order, key).fencing_token == 2
    late = wait_for_end(slow, both)
    assert error_class(late) is TaskInProgress
    assert charges(key) == [30]
    assert len(both.starts(key)) == 2
    assert record(charge_order, key).state == State.COMPLETED
    duplicate = wait_for_end(charge_order.enqueue(key, 30), both)
    assert duplicate.return_value == taken_over.return_value


def test_recovery_settles_a_payout_whose_worker_died_after_the_provider_call(
    workers: Callable[[float], Workers], monkeypatch: pytest.MonkeyPatch
) -> None:
    both = workers(60.0)
    monkeypatch.setenv(PROVIDER_DIR_ENV, str(both.provider.directory))  # for the reconciler
    key = new_key("payout")

    lost = send_payout.enqueue(key, 40)
    both.wait_for_start(key)  # the transfer is made; the body sleeps
    claimed_by = time.monotonic()
    both.running(lost).kill()
    left = record(send_payout, key)
    assert left.state == State.IN_PROGRESS and left.provider_key
    assert both.provider.calls() == 1

    # Enqueued again at once: the dead owner's lease still runs.
    early = wait_for_end(send_payout.enqueue(key, 40), both)
    assert error_class(early) is TaskInProgress
    # After the lease: the provider may have been called, so the body never runs again.
    after_the_lease(claimed_by)
    late = wait_for_end(send_payout.enqueue(key, 40), both)
    assert error_class(late) is TaskOutcomeUncertain
    assert both.provider.calls() == 1
    assert state_of(lost).status == "RUNNING"

    # Recovery, as cron runs it: the reconciler finds the transfer by the provider key.
    printed = StringIO()
    call_command("idempotency_recover", stdout=printed)

    assert record(send_payout, key).state == State.COMPLETED, printed.getvalue()
    transfer = both.provider.find(left.provider_key)
    assert transfer is not None
    answered = wait_for_end(send_payout.enqueue(key, 40), both)
    assert answered.return_value == {"payout": key, "transfer": transfer[0]}
    assert charges(key) == [40]
    assert both.provider.calls() == 1
    assert len(both.starts(key)) == 1
