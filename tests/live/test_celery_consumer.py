"""``idempotent_task`` in a real Celery worker: duplicated and redelivered messages run once.

A fresh PostgreSQL database, a Redis broker (a dedicated database, flushed
before and after) and real ``celery worker`` processes running
``tests.live.celery_tasks.charge_once``, configured as the docs say:
``acks_late=True``, ``task_reject_on_worker_lost=True``, retried on
``TaskInProgress``. Its side effect is a ``Charge`` row.

1. The same message (same event id and arguments) published five times at
   once: one Charge, one body start, five identical results.
2. A worker SIGKILLed (main process and pool child together) while the body
   sleeps after its uncommitted insert: Redis hands the unacknowledged
   message to a restarted worker once its visibility timeout has passed;
   the dead owner's claim is taken over once its lease has run out; the
   body runs again and commits. One Charge, two body starts.
3. Only the pool child SIGKILLed: the worker's main process notices,
   rejects the message (``WorkerLostError``) and it is requeued; the
   redelivery takes the dead child's claim over once its lease has run out
   (retrying on ``TaskInProgress`` while it still runs). One Charge.
4. A task keyed on the Celery message id (``key=message_id``), its pool
   child SIGKILLed: the requeued message (same id) runs once; the same
   arguments published again (a new message) run again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.live.celery_harness import (
    CeleryProcess,
    celery_database,
    celery_environment,
    new_queue,
    redis_db,
    require_redis,
    wait_until,
)
from tests.live.celery_tasks import body_starts
from tests.live.server import LiveDatabase

pytestmark = [pytest.mark.postgres, pytest.mark.live]

TASK = "tests.live.celery_tasks.charge_once"
#: The idempotency lease of the worker processes, and Redis's visibility
#: timeout: short, so a dead worker's message and claim come back quickly.
LEASE = 3.0
VISIBILITY_TIMEOUT = 4.0
RESULT_TIMEOUT = 45.0


@dataclass
class Setup:
    database: LiveDatabase
    broker: str
    tmp_path: Path
    processes: list[CeleryProcess]
    #: A plain client of the broker, as a producer service would have.
    producer: Celery

    def environment(self, queue: str, first_run_sleep: float) -> dict[str, str]:
        markers = self.tmp_path / "markers"
        markers.mkdir(exist_ok=True)
        return celery_environment(
            self.database,
            self.broker,
            queue,
            IDEMPOTENCY_TEST_LEASE=str(LEASE),
            IDEMPOTENCY_TEST_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT),
            IDEMPOTENCY_TEST_MARKER_DIR=str(markers),
            IDEMPOTENCY_TEST_FIRST_RUN_SLEEP=str(first_run_sleep),
        )

    def worker(self, env: dict[str, str], name: str, concurrency: int) -> CeleryProcess:
        worker = CeleryProcess.worker(env, self.tmp_path / f"{name}.log", concurrency=concurrency)
        self.processes.append(worker)
        return worker.start_worker()

    def starts(self, event_id: str) -> list[Path]:
        return body_starts(self.tmp_path / "markers", event_id)

    def charges(self, event_id: str) -> list[tuple[Any, ...]]:
        return self.database.query(
            "SELECT id, amount FROM testapp_charge WHERE note = %s ORDER BY id", [event_id]
        )

    def record(self, event_id: str) -> tuple[Any, ...] | None:
        rows = self.database.query(
            "SELECT state, fencing_token, response_body FROM django_idempotency_record "
            'WHERE tenant = %s AND "key" = %s',
            ["task", event_id],
        )
        assert len(rows) <= 1
        return rows[0] if rows else None

    def describe(self, event_id: str) -> str:
        logs = "\n".join(process.diagnostics(50) for process in self.processes)
        return (
            f"charges: {self.charges(event_id)}\nrecord: {self.record(event_id)}\n"
            f"body starts: {[path.name for path in self.starts(event_id)]}\n{logs}"
        )


@contextlib.contextmanager
def celery_setup(tmp_path: Path) -> Iterator[Setup]:
    """Redis, a fresh database and a producer; the workers the test starts are
    stopped before the database is dropped under them."""
    broker = require_redis()
    with redis_db(broker), celery_database(tmp_path) as database:
        producer = Celery("idempotency-live-producer", broker=broker, backend=broker)
        producer.conf.broker_connection_retry_on_startup = True
        setup = Setup(database, broker, tmp_path, [], producer)
        try:
            yield setup
        finally:
            for process in reversed(setup.processes):
                process.stop()
            producer.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Callable[[], Setup]]:
    """``stack()`` inside the test sets everything up, so that a missing Redis or
    PostgreSQL skips the test (or fails it, in CI) rather than erroring its setup."""
    with contextlib.ExitStack() as exits:
        yield lambda: exits.enter_context(celery_setup(tmp_path))


def send(setup: Setup, queue: str, event_id: str, amount: int = 25) -> Any:
    return setup.producer.send_task(
        TASK, kwargs={"event_id": event_id, "amount": amount}, queue=queue
    )


def event() -> str:
    return f"evt-{uuid.uuid4().hex[:12]}"


def test_the_same_message_five_times_runs_once(stack: Callable[[], Setup]) -> None:
    setup = stack()
    queue = new_queue()
    worker = setup.worker(setup.environment(queue, first_run_sleep=1.0), "worker", concurrency=4)
    event_id = event()

    sent = [send(setup, queue, event_id) for _ in range(5)]
    results = [result.get(timeout=RESULT_TIMEOUT) for result in sent]

    charges = setup.charges(event_id)
    assert len(charges) == 1, setup.describe(event_id)
    expected = {"charge_id": charges[0][0], "amount": 25, "event_id": event_id}
    assert results == [expected] * 5, setup.describe(event_id)
    assert len(setup.starts(event_id)) == 1, setup.describe(event_id)
    record = setup.record(event_id)
    assert record is not None and record[0] == "COMPLETED", setup.describe(event_id)

    # Duplicates arrived while the first ran: they were retried, not run.
    log = worker.log_text()
    assert "TaskInProgress" in log, setup.describe(event_id)

    # A later redelivery of the message gets the stored result at once.
    assert send(setup, queue, event_id).get(timeout=RESULT_TIMEOUT) == expected
    assert len(setup.charges(event_id)) == 1


def wait_for_first_start(setup: Setup, event_id: str) -> Path:
    wait_until(lambda: bool(setup.starts(event_id)), 30, lambda: setup.describe(event_id))
    time.sleep(0.2)  # well inside the body's sleep, after its insert
    return setup.starts(event_id)[0]


def test_a_worker_killed_mid_task_is_redelivered_to_a_restarted_worker_and_runs_once(
    stack: Callable[[], Setup],
) -> None:
    setup = stack()
    queue = new_queue()
    env = setup.environment(queue, first_run_sleep=60.0)
    first = setup.worker(env, "worker-1", concurrency=1)
    event_id = event()

    result = send(setup, queue, event_id)
    wait_for_first_start(setup, event_id)
    # The body has inserted its Charge and sleeps: nothing is committed yet.
    assert setup.charges(event_id) == []
    row = setup.record(event_id)
    assert row is not None and row[0] == "CLAIMED"
    first.kill()

    second = setup.worker(env, "worker-2", concurrency=1)
    answer = result.get(timeout=RESULT_TIMEOUT)

    charges = setup.charges(event_id)
    assert len(charges) == 1, setup.describe(event_id)
    assert answer == {"charge_id": charges[0][0], "amount": 25, "event_id": event_id}
    starts = setup.starts(event_id)
    assert len(starts) == 2, setup.describe(event_id)
    # The dead worker's insert rolled back with its connection; the second
    # start, in the restarted worker, is the one that committed.
    assert starts[0].name.split(".")[1] != starts[1].name.split(".")[1]
    record = setup.record(event_id)
    assert record is not None and record[0] == "COMPLETED", setup.describe(event_id)
    assert record[1] >= 2, setup.describe(event_id)  # taken over: the fencing token moved on
    assert "Took over record" in second.log_text(), setup.describe(event_id)

    # A duplicate of the message sent later: the stored result, no new Charge.
    assert send(setup, queue, event_id).get(timeout=RESULT_TIMEOUT) == answer
    assert len(setup.charges(event_id)) == 1


def test_a_pool_child_killed_mid_task_is_requeued_and_runs_once(
    stack: Callable[[], Setup],
) -> None:
    setup = stack()
    queue = new_queue()
    worker = setup.worker(setup.environment(queue, first_run_sleep=60.0), "worker", concurrency=1)
    event_id = event()

    result = send(setup, queue, event_id)
    marker = wait_for_first_start(setup, event_id)
    child = int(marker.name.split(".")[1])
    assert child != worker.pid
    os.kill(child, signal.SIGKILL)

    answer = result.get(timeout=RESULT_TIMEOUT)

    charges = setup.charges(event_id)
    assert len(charges) == 1, setup.describe(event_id)
    assert answer == {"charge_id": charges[0][0], "amount": 25, "event_id": event_id}
    assert len(setup.starts(event_id)) == 2, setup.describe(event_id)
    log = worker.log_text()
    assert "WorkerLostError" in log, setup.describe(event_id)
    record = setup.record(event_id)
    assert record is not None and record[0] == "COMPLETED", setup.describe(event_id)


def test_a_task_keyed_on_the_message_id_runs_a_redelivery_once_but_a_new_publish_again(
    stack: Callable[[], Setup],
) -> None:
    setup = stack()
    queue = new_queue()
    worker = setup.worker(setup.environment(queue, first_run_sleep=60.0), "worker", concurrency=1)
    note = event()
    kwargs = {"note": note, "amount": 9}
    task = "tests.live.celery_tasks.charge_per_message"

    result = setup.producer.send_task(task, kwargs=kwargs, queue=queue)
    marker = wait_for_first_start(setup, note)
    os.kill(int(marker.name.split(".")[1]), signal.SIGKILL)  # requeued: the same message

    answer = result.get(timeout=RESULT_TIMEOUT)
    assert answer["message"] == result.id
    assert len(setup.charges(note)) == 1, setup.describe(note)
    assert len(setup.starts(note)) == 2  # the killed start rolled back; the redelivery ran
    assert "WorkerLostError" in worker.log_text()

    # The message sent again under its id (a broker redelivering it): the stored
    # result. (The backend may answer from the first run's result: the body
    # starts counted below, after a later message in the same queue, prove it.)
    again = setup.producer.send_task(task, kwargs=kwargs, queue=queue, task_id=result.id)
    assert again.get(timeout=RESULT_TIMEOUT) == answer
    assert len(setup.charges(note)) == 1

    # The same arguments published again: a new message, a new id, and it runs.
    second = setup.producer.send_task(task, kwargs=kwargs, queue=queue)
    assert second.get(timeout=RESULT_TIMEOUT)["message"] == second.id != result.id
    assert len(setup.charges(note)) == 2, setup.describe(note)
    assert len(setup.starts(note)) == 3  # killed, redelivered, published again
