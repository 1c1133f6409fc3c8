"""``idempotent_task`` bodies that call a provider: the claim's context, UNCERTAIN, reconcilers.

In-process, on the real test database (``transaction=True``: every write
really commits, as in a worker). The provider is a stand-in in this process
that counts its calls and keeps one transfer per provider key, as a payment
provider keeps one operation per idempotency key. The real-worker proof
(a worker SIGKILLed mid-call) is ``tests/live/test_celery_provider_calls.py``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, shared_task
from celery.signals import task_retry
from django.core.checks import CheckMessage

from django_idempotency import recovery
from django_idempotency._protection.task import TASK_TENANT
from django_idempotency.checks import check_celery_timeouts
from django_idempotency.context import IdempotencyContext
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, Failed, Release, recover_stale_records
from django_idempotency.tasks import (
    TaskFailed,
    TaskInProgress,
    TaskOutcomeUncertain,
    idempotent_task,
    message_id,
    task_idempotency,
)
from django_idempotency.testing import expire_leases, simulate_crash_after_begin_external
from tests.telemetry import attributes_of_the_span_around
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State


class ProviderTimeout(Exception):
    """The provider did not answer in time: the transfer may or may not exist."""


@dataclass
class Provider:
    """A payout provider: one transfer per idempotency key, every call counted."""

    calls: int = 0
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Answer the next call with a timeout, after doing the transfer.
    time_out: bool = False

    def transfer(self, amount: int, idempotency_key: str) -> dict[str, Any]:
        self.calls += 1
        transfer = self.transfers.setdefault(
            idempotency_key, {"id": f"tr_{uuid.uuid4().hex[:10]}", "amount": amount}
        )
        if self.time_out:
            self.time_out = False
            raise ProviderTimeout(idempotency_key)
        return transfer

    def find(self, idempotency_key: str) -> dict[str, Any] | None:
        return self.transfers.get(idempotency_key)


provider = Provider()
seen: dict[str, Any] = {}
PAYOUT = f"task {__name__}.send_payout"


@shared_task(bind=True, name="tests.test_task_external_calls.send_payout")
@idempotent_task(key="payout_id")
def send_payout(self: Any, payout_id: str, amount: int) -> dict[str, Any]:
    """Calls the provider as the docs say: intent first, then the call, then its id."""
    seen["request"], seen["bound"] = self.request, self.request.idempotency
    seen["accessor"] = task_idempotency()
    claim = self.request.idempotency
    provider_key = claim.begin_external()
    transfer = provider.transfer(amount, idempotency_key=provider_key)
    claim.set_provider_operation(transfer["id"])
    Charge.objects.create(tenant="task", amount=amount, note=payout_id)
    return {"payout": payout_id, "transfer": transfer["id"]}


@idempotent_task(key="payout_id", operation="task tests.unbound-payout")
def unbound_payout(payout_id: str, amount: int) -> str:
    """An unbound task (or a plain function): the accessor is its way in."""
    claim = task_idempotency()
    transfer = provider.transfer(amount, idempotency_key=claim.begin_external())
    claim.set_provider_operation(transfer["id"])
    return str(transfer["id"])


@shared_task(bind=True, name="tests.test_task_external_calls.payout_retried_by_celery")
@idempotent_task(key="payout_id", operation="task tests.retried-payout")
def payout_retried_by_celery(self: Any, payout_id: str, amount: int) -> str:
    """Asks Celery to retry when the provider times out, as tasks often do."""
    seen.setdefault("starts", 0)
    seen["starts"] += 1
    try:
        transfer = provider.transfer(amount, idempotency_key=task_idempotency().begin_external())
    except ProviderTimeout as exc:
        raise self.retry(exc=exc, countdown=0, max_retries=3) from exc
    return str(transfer["id"])


@shared_task(
    bind=True,
    name="tests.test_task_external_calls.payout_autoretried",
    autoretry_for=(TaskInProgress,),
    max_retries=None,
    default_retry_delay=0,
)
@idempotent_task(key="payout_id", operation="task tests.autoretried-payout")
def payout_autoretried(self: Any, payout_id: str, amount: int) -> str:
    seen.setdefault("starts", 0)
    seen["starts"] += 1
    transfer = provider.transfer(amount, idempotency_key=task_idempotency().begin_external())
    return str(transfer["id"])


@shared_task(bind=True, name="tests.test_task_external_calls.note_message")
@idempotent_task(key=message_id, operation="task tests.note-message")
def note_message(self: Any, amount: int) -> int:
    """A task whose arguments carry no id: keyed on the Celery message id."""
    return Charge.objects.create(tenant="task", amount=amount, note="message").pk


@pytest.fixture(autouse=True)
def _fresh_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    global provider
    provider = Provider()
    seen.clear()
    monkeypatch.setattr(recovery, "_reconcilers", {})
    yield


@pytest.fixture
def payout_id() -> str:
    return f"po-{uuid.uuid4().hex[:12]}"


def record(key: str, operation: str = PAYOUT) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(tenant=TASK_TENANT, operation=operation, key=key)


def settle_from_the_provider(record: IdempotencyRecord) -> Completed | Release:
    """The reconciler a payout task registers: asks the provider by the record's key."""
    transfer = provider.find(record.provider_key)
    if transfer is None:
        return Release()
    payout = record.key
    Charge.objects.create(tenant="task", amount=transfer["amount"], note=payout)
    return Completed(body={"payout": payout, "transfer": transfer["id"]})


# -- the context ---------------------------------------------------------------------------


def test_the_body_reaches_its_claim_through_the_request_and_the_accessor(payout_id: str) -> None:
    result = send_payout.apply(args=(payout_id, 40)).get()

    claim = seen["bound"]
    assert isinstance(claim, IdempotencyContext)
    assert seen["accessor"] is claim
    assert (claim.tenant, claim.operation, claim.key) == (TASK_TENANT, PAYOUT, payout_id)
    stored = record(payout_id)
    assert stored.state == State.COMPLETED
    assert stored.provider_key == claim.provider_key
    assert stored.provider_operation_id == result["transfer"]
    assert claim.fencing_token == stored.fencing_token
    # Duplicates get the stored result; the provider was called once.
    assert send_payout.apply(args=(payout_id, 40)).get() == result
    assert provider.calls == 1


def test_the_accessor_is_only_there_while_a_body_runs(payout_id: str) -> None:
    with pytest.raises(RuntimeError, match="only available while the body"):
        task_idempotency()
    transfer = unbound_payout(payout_id, 5)  # a plain call: no Celery at all
    assert record(payout_id, "task tests.unbound-payout").provider_operation_id == transfer
    with pytest.raises(RuntimeError):
        task_idempotency()


def test_a_bound_tasks_request_drops_the_context_after_the_run(payout_id: str) -> None:
    send_payout.apply(args=(payout_id, 1)).get()
    assert seen["request"].idempotency is None


# -- a body that fails after begin_external() ---------------------------------------------


def test_a_body_failing_after_begin_external_leaves_the_record_uncertain(payout_id: str) -> None:
    provider.time_out = True
    with pytest.raises(ProviderTimeout):
        send_payout(payout_id, 40)

    stored = record(payout_id)
    assert stored.state == State.UNCERTAIN  # never released: the transfer exists
    assert stored.provider_key and provider.find(stored.provider_key) is not None
    assert Charge.objects.filter(note=payout_id).count() == 0  # the body's writes rolled back

    # The redelivery does not run the body: the provider is not called again.
    with pytest.raises(TaskOutcomeUncertain, match="reconciler"):
        send_payout(payout_id, 40)
    assert provider.calls == 1
    assert record(payout_id).state == State.UNCERTAIN


def test_the_uncertain_run_and_its_refused_redelivery_say_so_on_their_spans(
    payout_id: str,
) -> None:
    provider.time_out = True
    failed = attributes_of_the_span_around(lambda: send_payout(payout_id, 40))
    redelivered = attributes_of_the_span_around(lambda: send_payout(payout_id, 40))

    assert failed["idempotency.task.outcome"] == "uncertain"
    assert redelivered["idempotency.task.outcome"] == "refused"
    assert redelivered["idempotency.refusal"] == "outcome_uncertain"


def test_the_reconciler_of_the_task_settles_it_and_duplicates_get_its_result(
    payout_id: str,
) -> None:
    recovery.register_reconciler(PAYOUT)(settle_from_the_provider)
    provider.time_out = True
    with pytest.raises(ProviderTimeout):
        send_payout(payout_id, 40)

    report = recover_stale_records()

    assert report.completed == 1
    transfer = provider.find(record(payout_id).provider_key)
    assert transfer is not None
    expected = {"payout": payout_id, "transfer": transfer["id"]}
    assert record(payout_id).state == State.COMPLETED
    # Later deliveries of the message return the reconciler's body, as JSON.
    assert send_payout(payout_id, 40) == expected
    assert send_payout.apply(args=(payout_id, 40)).get() == expected
    assert provider.calls == 1
    assert Charge.objects.filter(note=payout_id).count() == 1  # the reconciler's, committed


def test_a_reconciler_that_releases_lets_the_next_delivery_run_with_the_same_key(
    payout_id: str,
) -> None:
    def never_happened(record: IdempotencyRecord) -> Release:
        seen["asked_with"] = record.provider_key
        return Release()

    recovery.register_reconciler(PAYOUT)(never_happened)
    provider.time_out = True
    with pytest.raises(ProviderTimeout):
        send_payout(payout_id, 40)
    first_key = record(payout_id).provider_key
    provider.transfers.clear()  # say the provider really had nothing

    assert recover_stale_records().released == 1
    assert not IdempotencyRecord.objects.filter(key=payout_id).exists()

    result = send_payout(payout_id, 40)
    assert seen["asked_with"] == first_key
    assert record(payout_id).provider_key == first_key  # the provider deduplicates both
    assert result["transfer"] == record(payout_id).provider_operation_id
    assert provider.calls == 2


def test_a_record_settled_as_failed_raises_task_failed_with_its_body(payout_id: str) -> None:
    def refused(record: IdempotencyRecord) -> Failed:
        return Failed(status=402, body={"error": "insufficient_funds"})

    recovery.register_reconciler(PAYOUT)(refused)
    provider.time_out = True
    with pytest.raises(ProviderTimeout):
        send_payout(payout_id, 40)
    assert recover_stale_records().failed == 1

    with pytest.raises(TaskFailed) as failed:
        send_payout(payout_id, 40)
    assert failed.value.result == {"error": "insufficient_funds"}
    assert provider.calls == 1


@pytest.mark.postgres
def test_a_worker_killed_mid_call_leaves_in_progress_then_recovery_settles(
    payout_id: str,
) -> None:
    """``SimulatedCrash``: the intent committed, the process "died" (no cleanup)."""
    recovery.register_reconciler(PAYOUT)(settle_from_the_provider)
    with simulate_crash_after_begin_external(), pytest.raises(BaseException) as crash:
        send_payout(payout_id, 40)
    assert type(crash.value).__name__ == "SimulatedCrash"
    assert record(payout_id).state == State.IN_PROGRESS

    # While the lease runs the owner may be at work: retry later.
    with pytest.raises(TaskInProgress):
        send_payout(payout_id, 40)
    expire_leases()
    # Past the lease, no owner will finish it: the reconciler's, not a retry's.
    with pytest.raises(TaskOutcomeUncertain):
        send_payout(payout_id, 40)
    assert provider.calls == 0  # the "crash" came before the call

    # The reconciler finds no transfer: released, and the redelivery runs.
    assert recover_stale_records().released == 1
    result = send_payout(payout_id, 40)
    assert provider.calls == 1
    assert send_payout(payout_id, 40) == result


# -- Celery retries ---------------------------------------------------------------------------


def test_a_celery_retry_after_begin_external_does_not_call_again(payout_id: str) -> None:
    """``self.retry()`` after a provider timeout: the retry finds the record UNCERTAIN."""
    provider.time_out = True

    outcome = payout_retried_by_celery.apply(args=(payout_id, 7))

    assert isinstance(outcome.result, TaskOutcomeUncertain), outcome.result
    assert seen["starts"] == 1
    assert provider.calls == 1
    assert record(payout_id, "task tests.retried-payout").state == State.UNCERTAIN


def test_autoretry_for_task_in_progress_does_not_loop_on_an_uncertain_record(
    payout_id: str,
) -> None:
    retries: list[Any] = []

    def count(**kwargs: Any) -> None:
        retries.append(kwargs)

    task_retry.connect(count)
    try:
        provider.time_out = True
        first = payout_autoretried.apply(args=(payout_id, 7))
        again = payout_autoretried.apply(args=(payout_id, 7))
    finally:
        task_retry.disconnect(count)

    assert isinstance(first.result, ProviderTimeout)
    assert isinstance(again.result, TaskOutcomeUncertain)
    assert not isinstance(again.result, TaskInProgress)
    assert retries == []
    assert seen["starts"] == 1 and provider.calls == 1


# -- keyed on the Celery message id ---------------------------------------------------------


def test_the_message_id_key_runs_a_redelivery_once_and_a_second_publish_again() -> None:
    message = str(uuid.uuid4())

    first = note_message.apply(args=(3,), task_id=message).get()
    redelivered = note_message.apply(args=(3,), task_id=message).get()
    published_again = note_message.apply(args=(3,)).get()  # a new message, new id

    assert redelivered == first
    assert published_again != first
    assert Charge.objects.filter(note="message").count() == 2
    assert record(message, "task tests.note-message").state == State.COMPLETED


def test_the_message_id_key_needs_a_celery_message() -> None:
    with pytest.raises(RuntimeError, match="needs a Celery message"):
        note_message.run(3)


def test_a_retry_keeps_the_message_id() -> None:
    """``self.retry()`` sends the same task id: a retried message is the same message."""
    ids: list[str] = []

    @shared_task(bind=True, name="tests.test_task_external_calls.keeps_its_id")
    @idempotent_task(key=message_id, operation="task tests.keeps-its-id")
    def keeps_its_id(self: Any) -> str:
        ids.append(self.request.id)
        if len(ids) == 1:
            raise self.retry(countdown=0)
        return str(self.request.id)

    outcome = keeps_its_id.apply()
    assert outcome.get() == ids[0] == ids[1]


# -- lease, time limit, visibility timeout ----------------------------------------------------


@pytest.fixture
def celery_app() -> Iterator[Celery]:
    """A Celery app made current for the check, with one idempotent task; restored after."""
    from celery import _state

    previous = _state.get_current_app()
    app = Celery("idempotency-check-tests", broker="redis://127.0.0.1:6379/15", set_as_current=True)
    try:
        yield app
    finally:
        previous.set_current()


def register_payout(app: Celery, *, lease: float | None, time_limit: int | None) -> None:
    options: dict[str, Any] = {"name": "check.payout", "shared": False, "time_limit": time_limit}

    @app.task(**options)  # type: ignore[untyped-decorator]
    @idempotent_task(key="payout_id", operation="task check.payout", lease=lease)
    def payout(payout_id: str) -> None:
        return None


def ids(messages: list[CheckMessage]) -> list[str]:
    """The ids about ``check.payout`` (this module's shared tasks join every new app too)."""
    return [str(message.id) for message in messages if message.obj == "check.payout"]


@pytest.mark.parametrize(
    ("visibility", "lease", "time_limit", "expected"),
    [
        (3600, 300, 300, []),
        (60, None, None, ["django_idempotency.W020"]),  # IDEMPOTENCY["LEASE"]: two minutes
        (200, 100, 300, ["django_idempotency.W021", "django_idempotency.W020"]),
        (3600, 100, 300, ["django_idempotency.W021"]),
        (None, 300, None, []),  # Redis's default visibility timeout: an hour
        (None, 7200, None, ["django_idempotency.W020"]),
    ],
)
def test_the_visibility_timeout_must_outlast_every_idempotent_tasks_lease_and_time_limit(
    celery_app: Celery,
    visibility: float | None,
    lease: float | None,
    time_limit: int | None,
    expected: list[str],
) -> None:
    if visibility is not None:
        celery_app.conf.broker_transport_options = {"visibility_timeout": visibility}
    register_payout(celery_app, lease=lease, time_limit=time_limit)

    assert ids(check_celery_timeouts()) == expected


@pytest.mark.parametrize("bind", [False, True])
def test_the_timeout_checks_see_the_lease_through_celerys_autoretry_wrapper(
    celery_app: Celery, bind: bool
) -> None:
    """The layout the docs show: ``autoretry_for`` replaces ``task.run`` with Celery's wrapper."""
    celery_app.conf.broker_transport_options = {"visibility_timeout": 45}

    options: dict[str, Any] = {
        "name": "check.payout",
        "shared": False,
        "bind": bind,
        "acks_late": True,
        "autoretry_for": (TaskInProgress,),
        "time_limit": 60,
    }

    @celery_app.task(**options)  # type: ignore[untyped-decorator]
    @idempotent_task(key="refund_id", operation="task check.refund", lease=30)
    def refund(*args: Any, **kwargs: Any) -> None:  # refund_id among kwargs, bound or not
        return None

    assert ids(check_celery_timeouts()) == ["django_idempotency.W021", "django_idempotency.W020"]


def test_an_invalid_lease_setting_leaves_the_timeout_check_to_its_own_error(
    celery_app: Celery, settings: Any
) -> None:
    """E006 reports the LEASE; the check of the tasks' timeouts must not crash on it."""
    settings.IDEMPOTENCY = {"LEASE": "two minutes"}
    celery_app.conf.broker_transport_options = {"visibility_timeout": 60}
    register_payout(celery_app, lease=None, time_limit=None)

    assert ids(check_celery_timeouts()) == []


def test_a_broker_without_visibility_timeout_only_compares_lease_and_time_limit(
    celery_app: Celery,
) -> None:
    celery_app.conf.update(broker_url="amqp://guest@127.0.0.1//")
    celery_app.conf.broker_transport_options = {"visibility_timeout": 1}
    register_payout(celery_app, lease=10, time_limit=60)

    [warning] = [m for m in check_celery_timeouts() if m.obj == "check.payout"]
    assert warning.id == "django_idempotency.W021"
    assert "'check.payout' may run for 60s" in str(warning.msg)


def test_a_time_limit_longer_than_the_lease_is_logged_when_the_task_runs(
    payout_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    @shared_task(bind=True, name="tests.test_task_external_calls.slow_payout", time_limit=600)
    @idempotent_task(key="payout_id", operation="task tests.slow-payout", lease=30)
    def slow_payout(self: Any, payout_id: str) -> int:
        return 1

    with caplog.at_level(logging.WARNING, logger="django_idempotency"):
        slow_payout.apply(args=(payout_id,)).get()
        slow_payout.apply(args=(payout_id + "-2",)).get()

    warnings = [r for r in caplog.records if "longer than its idempotency lease" in r.message]
    assert len(warnings) == 1  # once per task, not per run
    assert "slow_payout may run for 600s" in warnings[0].message


def test_retry_is_not_swallowed_into_a_release(payout_id: str) -> None:
    """A ``Retry`` raised before begin_external() releases the claim as any exception."""

    @shared_task(bind=True, name="tests.test_task_external_calls.retry_first")
    @idempotent_task(key="payout_id", operation="task tests.retry-first")
    def retry_first(self: Any, payout_id: str) -> int:
        seen.setdefault("runs", 0)
        seen["runs"] += 1
        if seen["runs"] == 1:
            raise self.retry(countdown=0)
        return int(seen["runs"])

    assert retry_first.apply(args=(payout_id,)).get() == 2
    assert record(payout_id, "task tests.retry-first").state == State.COMPLETED
