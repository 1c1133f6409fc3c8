"""A Celery task calling a provider, its worker SIGKILLed mid-call: one provider call.

Real ``celery worker`` processes, a Redis broker (a dedicated database,
flushed before and after), a fresh PostgreSQL database, and
``tests.live.celery_tasks.send_payout``: ``acks_late=True``,
``reject_on_worker_lost=True``, retried on ``TaskInProgress``, keyed on its
payout id; its body calls ``begin_external()``, a stand-in payout provider
(in Redis, so that every process sees it; one transfer per idempotency key,
every call counted), then ``set_provider_operation()``. Its reconciler
(``settle_payout``) asks that provider by the record's provider key.

Each case pauses the body at one point, SIGKILLs there (the whole worker,
main process and pool child, or only the pool child), and then:

1. the message comes back (Redis's visibility timeout for a dead worker,
   ``reject_on_worker_lost`` for a dead pool child) to a new worker process,
   which does not run the body: ``TaskOutcomeUncertain`` (after
   ``TaskInProgress`` retries while the dead owner's lease still ran);
2. recovery (the ``recover_stale_records`` task, on the worker) asks the
   reconciler, which finds the transfer and settles the record COMPLETED;
3. the message published again gets the reconciler's result.

Provider calls: 1 in every case. The table in the module's summary lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
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
from tests.live.celery_tasks import PayoutProvider, body_starts
from tests.live.processes import summary_lines
from tests.live.server import LiveDatabase

pytestmark = [pytest.mark.postgres, pytest.mark.live]

TASK = "tests.live.celery_tasks.send_payout"
RECOVER = "django_idempotency.tasks.recover_stale_records"
OPERATION = "task tests.live.celery_tasks.send_payout"
#: The workers' idempotency lease and Redis's visibility timeout: short, so
#: that a dead worker's message and record come back within the test.
LEASE = 2.0
VISIBILITY_TIMEOUT = 3.0
RESULT_TIMEOUT = 45.0


@dataclass
class Setup:
    database: LiveDatabase
    broker: str
    tmp_path: Path
    queue: str
    processes: list[CeleryProcess]
    producer: Celery

    @property
    def markers(self) -> Path:
        path = self.tmp_path / "markers"
        path.mkdir(exist_ok=True)
        return path

    def environment(self, **extra: str) -> dict[str, str]:
        return celery_environment(
            self.database,
            self.broker,
            self.queue,
            IDEMPOTENCY_TEST_LEASE=str(LEASE),
            IDEMPOTENCY_TEST_VISIBILITY_TIMEOUT=str(VISIBILITY_TIMEOUT),
            IDEMPOTENCY_TEST_MARKER_DIR=str(self.markers),
            **extra,
        )

    def worker(self, name: str, **extra: str) -> CeleryProcess:
        worker = CeleryProcess.worker(
            self.environment(**extra), self.tmp_path / f"{name}.log", concurrency=1
        )
        self.processes.append(worker)
        return worker.start_worker()

    @property
    def provider(self) -> PayoutProvider:
        return PayoutProvider(self.broker, self.queue)

    def send(self, payout_id: str, amount: int = 70) -> Any:
        return self.producer.send_task(
            TASK, kwargs={"payout_id": payout_id, "amount": amount}, queue=self.queue
        )

    def record(self, payout_id: str) -> dict[str, Any] | None:
        rows = self.database.query(
            "SELECT state, provider_key, provider_operation_id, fencing_token "
            'FROM django_idempotency_record WHERE tenant = %s AND "key" = %s',
            ["task", payout_id],
        )
        if not rows:
            return None
        state, provider_key, operation_id, token = rows[0]
        return {
            "state": state,
            "provider_key": provider_key,
            "operation_id": operation_id,
            "fencing_token": token,
        }

    def charges(self, payout_id: str) -> list[tuple[Any, ...]]:
        return self.database.query(
            "SELECT id, amount FROM testapp_charge WHERE note = %s ORDER BY id", [payout_id]
        )

    def describe(self, payout_id: str) -> str:
        logs = "\n".join(process.diagnostics(40) for process in self.processes)
        return (
            f"record: {self.record(payout_id)}\ncharges: {self.charges(payout_id)}\n"
            f"provider calls: {self.provider.calls()}\n"
            f"body starts: {[p.name for p in body_starts(self.markers, payout_id)]}\n{logs}"
        )


@contextlib.contextmanager
def celery_setup(tmp_path: Path) -> Iterator[Setup]:
    broker = require_redis()
    with redis_db(broker), celery_database(tmp_path) as database:
        producer = Celery("idempotency-live-payouts", broker=broker, backend=broker)
        producer.conf.broker_connection_retry_on_startup = True
        setup = Setup(database, broker, tmp_path, new_queue(), [], producer)
        try:
            yield setup
        finally:
            for process in reversed(setup.processes):
                process.stop()
            producer.close()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Callable[[], Setup]]:
    """``stack()`` inside the test, so that a missing service skips (or, in CI, fails) it."""
    with contextlib.ExitStack() as exits:
        yield lambda: exits.enter_context(celery_setup(tmp_path))


def paused_pid(setup: Setup, payout_id: str) -> int:
    """Wait until the body pauses at its kill point; the pid of the pool child running it."""

    def paused() -> list[Path]:
        return list(setup.markers.glob(f"pause-{payout_id}.*"))

    wait_until(lambda: bool(paused()), 30, lambda: setup.describe(payout_id))
    return int(paused()[0].name.rsplit(".", 1)[1])


@pytest.mark.parametrize(
    ("point", "kill"),
    [
        ("in-call", "worker"),
        ("after-call", "pool child"),
        ("after-set-provider-operation", "worker"),
    ],
)
def test_a_worker_killed_mid_call_never_calls_the_provider_twice(
    stack: Callable[[], Setup], point: str, kill: str
) -> None:
    setup = stack()
    payout_id = f"po-{uuid.uuid4().hex[:12]}"
    first = setup.worker("worker-1", IDEMPOTENCY_TEST_PAUSE_AT=point)

    result = setup.send(payout_id)
    child = paused_pid(setup, payout_id)
    # The provider made the transfer; the record says a call began.
    assert setup.provider.calls() == 1
    at_kill = setup.record(payout_id)
    assert at_kill is not None and at_kill["state"] == "IN_PROGRESS", setup.describe(payout_id)
    assert at_kill["provider_key"]
    assert bool(at_kill["operation_id"]) is (point == "after-set-provider-operation")

    if kill == "worker":
        first.kill()  # main process and pool child: Redis redelivers after its timeout
        setup.worker("worker-2")
    else:
        assert child != first.pid
        os.kill(child, signal.SIGKILL)  # the main process rejects: requeued at once

    # The redelivered message does not run the body: it is the reconciler's.
    with pytest.raises(Exception) as refused:
        result.get(timeout=RESULT_TIMEOUT)
    assert type(refused.value).__name__ == "TaskOutcomeUncertain", setup.describe(payout_id)
    assert len(body_starts(setup.markers, payout_id)) == 1, setup.describe(payout_id)
    assert setup.provider.calls() == 1, setup.describe(payout_id)
    assert setup.charges(payout_id) == []  # the body's own write died with it
    redelivered = setup.record(payout_id)
    assert redelivered is not None and redelivered["state"] in ("IN_PROGRESS", "UNCERTAIN")

    # Recovery, as beat runs it: the reconciler finds the transfer.
    report = setup.producer.send_task(RECOVER, queue=setup.queue).get(timeout=RESULT_TIMEOUT)
    assert report["completed"] == 1, (report, setup.describe(payout_id))
    transfer = setup.provider.find(at_kill["provider_key"])
    assert transfer is not None
    settled = setup.record(payout_id)
    assert settled is not None and settled["state"] == "COMPLETED", setup.describe(payout_id)
    # Settled by recovery's takeover (the token moved on), not by the redelivery.
    assert settled["fencing_token"] == at_kill["fencing_token"] + 1

    # The message published again: the reconciler's result, no second call.
    expected = {"payout": payout_id, "transfer": transfer["id"]}
    assert setup.send(payout_id).get(timeout=RESULT_TIMEOUT) == expected
    assert setup.send(payout_id).get(timeout=RESULT_TIMEOUT) == expected
    assert setup.provider.calls() == 1, setup.describe(payout_id)
    assert [amount for _, amount in setup.charges(payout_id)] == [70]
    assert len(body_starts(setup.markers, payout_id)) == 1

    summary_lines.append(
        f"celery payout, SIGKILL {kill} at {point}: record IN_PROGRESS -> redelivery "
        f"TaskOutcomeUncertain (body not run) -> recovery Completed -> duplicates get the "
        f"result; provider calls {setup.provider.calls()}"
    )
