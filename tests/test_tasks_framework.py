"""``idempotent_task`` under Django's Tasks framework: an enqueued key runs once.

The real database backend (``django-tasks-db``): tasks are enqueued as rows
of the test database and run by its worker, ``manage.py db_worker
--batch``, here in the test process (it runs what is ready, then returns),
so that these tests run on every database. The tasks are
``tests/testapp/background_tasks.py``; their side effect is a ``Charge``
row. Worker processes of their own, killed mid-task, are
``tests/live/test_tasks_framework_workers.py`` (PostgreSQL).
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from django_idempotency import _store as store
from django_idempotency.django_tasks import idempotent_task
from django_idempotency.exceptions import (
    TaskInProgress,
    TaskKeyMissing,
    TaskKeyReused,
    TaskOutcomeUncertain,
)
from django_idempotency.fingerprint import fingerprint
from django_idempotency.models import IdempotencyRecord
from django_idempotency.scope import Scope
from tests.testapp.background_tasks import (
    PROVIDER_DIR_ENV,
    ChargeDeclined,
    PayoutProvider,
    charge_event,
    charge_order,
    charge_order_in_context,
    send_payout,
)
from tests.testapp.models import Charge
from tests.utils import run_python

try:  # Django 6.0 and later
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task  # type: ignore[no-redef,unused-ignore]

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State


def run_worker() -> None:
    """``manage.py db_worker --batch``: run every ready task, then return.

    The worker installs its own SIGINT and SIGTERM handlers; pytest's are
    put back afterwards.
    """
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        call_command(
            "db_worker",
            "--batch",
            "--no-startup-delay",
            "--no-reload",
            "--interval=0",
            verbosity=0,
            stdout=StringIO(),
        )
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def finished(result: Any) -> Any:
    """The task result as the backend has it now (another object: results are frozen)."""
    return result.task.get_result(result.id)


def error_class(result: Any) -> type[BaseException]:
    fresh = finished(result)
    assert fresh.status == "FAILED", fresh.status
    return fresh.errors[-1].exception_class  # type: ignore[no-any-return]


def charges(note: str) -> list[int]:
    return list(Charge.objects.filter(note=note).values_list("amount", flat=True))


def record(operation: str, key: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(tenant="task", operation=operation, key=key)


def operation_of(task_object: Any) -> str:
    return f"task {task_object.module_path}"


@pytest.fixture
def key() -> str:
    return f"order-{uuid.uuid4().hex[:12]}"


# -- the same key enqueued twice ---------------------------------------------------------


def test_the_same_key_enqueued_twice_runs_once_and_both_results_are_the_first_runs(
    key: str,
) -> None:
    first = charge_order.enqueue(order_id=key, amount=5)
    second = charge_order.enqueue(key, 5)  # positionally: the same arguments

    run_worker()

    done = [finished(first), finished(second)]
    assert [result.status for result in done] == ["SUCCESSFUL", "SUCCESSFUL"]
    assert charges(key) == [5]
    charge = Charge.objects.get(note=key)
    assert done[0].return_value == done[1].return_value == {"charge": charge.pk, "amount": 5}
    assert record(operation_of(charge_order), key).state == State.COMPLETED


def test_a_task_that_takes_its_context_replays_a_result_naming_the_run_that_charged(
    key: str,
) -> None:
    """The context differs per run and is not compared: the second run is a duplicate,
    and its result, the stored one, names the first run's result id."""
    first = charge_order_in_context.enqueue(key, 7)
    second = charge_order_in_context.enqueue(key, 7)

    run_worker()

    first_done, second_done = finished(first), finished(second)
    assert (first_done.status, second_done.status) == ("SUCCESSFUL", "SUCCESSFUL")
    assert first_done.return_value["charged_by"] == str(first.id)
    assert second_done.return_value == first_done.return_value
    assert charges(key) == [7]


def test_the_key_may_be_a_callable_over_the_arguments(key: str) -> None:
    results = [charge_event.enqueue({"id": key, "amount": 3}) for _ in range(2)]

    run_worker()

    assert {finished(result).return_value for result in results} == {
        Charge.objects.get(note=key).pk
    }
    assert record(operation_of(charge_event), key).state == State.COMPLETED


# -- what the Tasks framework leaves to the caller: runs that fail are not retried -------


def test_the_same_key_with_other_arguments_fails_as_reused_and_runs_nothing(key: str) -> None:
    first = charge_order.enqueue(key, 5)
    other = charge_order.enqueue(key, 6)

    run_worker()

    assert finished(first).status == "SUCCESSFUL"
    assert error_class(other) is TaskKeyReused
    assert charges(key) == [5]


@pytest.mark.parametrize("missing", [None, ""], ids=["none", "empty"])
def test_runs_enqueued_without_a_key_fail_as_missing_and_run_nothing(missing: str | None) -> None:
    """Two orders without an id are no duplicates: neither gets the other's result."""
    first = charge_order.enqueue(missing, 5)  # type: ignore[arg-type]  # what a buggy producer sends
    second = charge_order.enqueue(missing, 5)  # type: ignore[arg-type]
    other = charge_order.enqueue(missing, 6)  # type: ignore[arg-type]

    run_worker()

    assert [error_class(result) for result in (first, second, other)] == [TaskKeyMissing] * 3
    assert "no key" in finished(first).errors[-1].traceback
    assert not Charge.objects.filter(tenant="tasks").exists()
    assert not IdempotencyRecord.objects.exists()


def test_a_run_while_another_worker_holds_the_key_fails_in_progress_without_running(
    key: str,
) -> None:
    """Another worker has claimed the key (its lease runs): this run is refused, and
    the backend does not try it again; enqueue it again later."""
    scope = Scope("task", operation_of(charge_order), key)
    arguments = {"order_id": key, "amount": 5, "decline": False}
    held = store.claim_or_take_over(
        scope,
        fingerprint(arguments),
        ttl=timedelta(hours=1),
        lease=timedelta(minutes=1),
        using="default",
    ).held
    assert held is not None

    duplicate = charge_order.enqueue(key, 5)
    run_worker()

    assert error_class(duplicate) is TaskInProgress
    assert charges(key) == []
    assert record(operation_of(charge_order), key).fencing_token == held.fencing_token


def test_a_body_that_raises_commits_nothing_and_a_new_enqueue_runs_it(key: str) -> None:
    declined = charge_order.enqueue(key, 5, decline=True)
    run_worker()

    assert error_class(declined) is ChargeDeclined
    assert charges(key) == []
    assert not IdempotencyRecord.objects.filter(key=key).exists()  # released

    again = charge_order.enqueue(key, 5)
    run_worker()

    assert finished(again).status == "SUCCESSFUL"
    assert charges(key) == [5]


# -- a provider call whose outcome is unknown: the reconciler settles it -----------------


def test_recovery_settles_a_payout_whose_answer_was_lost_and_later_runs_get_its_result(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROVIDER_DIR_ENV, str(tmp_path))
    provider = PayoutProvider(tmp_path)
    lost = send_payout.enqueue(key, 40, answer_lost=True)
    run_worker()

    assert error_class(lost) is TimeoutError
    held = record(operation_of(send_payout), key)
    assert held.state == State.UNCERTAIN and held.provider_key
    assert provider.calls() == 1

    # Enqueued again before recovery ran: not run, the provider is not called again.
    refused = send_payout.enqueue(key, 40, answer_lost=True)
    run_worker()
    assert error_class(refused) is TaskOutcomeUncertain
    assert provider.calls() == 1

    out = StringIO()
    call_command("idempotency_recover", stdout=out)

    assert "completed" in out.getvalue()
    settled = record(operation_of(send_payout), key)
    assert settled.state == State.COMPLETED
    transfer = provider.find(held.provider_key)
    assert transfer is not None
    expected = {"payout": key, "transfer": transfer[0]}
    later = send_payout.enqueue(key, 40, answer_lost=True)
    run_worker()
    assert finished(later).return_value == expected
    assert charges(key) == [40]
    assert provider.calls() == 1


# -- declaring the task ------------------------------------------------------------------


def unprotected(order_id: str) -> None:
    """A module-level function for the Tasks framework to accept as a task."""


def test_idempotent_task_above_task_is_refused_when_decorating() -> None:
    declared = task()(unprotected)

    with pytest.raises(ImproperlyConfigured, match="place it under @task"):
        idempotent_task(key="order_id")(declared)  # type: ignore[type-var]


def test_an_async_body_is_refused_when_decorating() -> None:
    async def charge_later(order_id: str) -> None:
        """Its writes could not commit with its result."""

    with pytest.raises(ImproperlyConfigured, match="async function"):
        idempotent_task(key="order_id")(charge_later)


def test_tasks_are_protected_in_a_process_where_celery_cannot_be_imported(key: str) -> None:
    """Celery absent: the decorator imports from the package and from django_tasks,
    a worker runs a key enqueued twice once, the gauges' census is taken; the
    Celery module says what to install."""
    result = run_python(
        f"""
        import sys
        sys.modules["celery"] = None  # import celery now raises ImportError

        from django_idempotency import idempotent_task
        from django_idempotency.django_tasks import idempotent_task as for_tasks
        assert idempotent_task is for_tasks

        import django
        django.setup()
        from django.core.management import call_command
        from tests.testapp.background_tasks import charge_order
        from tests.testapp.models import Charge

        results = [charge_order.enqueue({key!r}, 9) for _ in range(2)]
        call_command("db_worker", "--batch", "--no-startup-delay", "--no-reload", verbosity=0)
        values = [charge_order.get_result(result.id).return_value for result in results]
        assert values[0] == values[1], values
        print("charges", Charge.objects.filter(note={key!r}).count())
        from django_idempotency.census import observe_records
        print("census of", sorted(observe_records(database="default")))
        try:
            import django_idempotency.tasks
        except Exception as exc:
            print(type(exc).__name__, exc)
        print("celery" in sys.modules and sys.modules["celery"] is not None)
        """
    )

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "charges 1"
    assert lines.pop(1) == "census of ['default']"  # the metrics' gauges, taken without Celery
    assert lines[1] == (
        "ImproperlyConfigured django_idempotency.tasks needs Celery: "
        'pip install "django-idempotency[celery]"'
    )
    assert lines[2] == "False"


@pytest.fixture(autouse=True)
def _no_leftover_signal_handlers() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    assert signal.getsignal(signal.SIGTERM) is before
