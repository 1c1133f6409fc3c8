"""``idempotent_task``: a redelivered or duplicated message runs its body once.

In-process, on the real test database (``transaction=True``: every write
really commits, as in a worker). The body's side effect is a ``Charge`` row;
its note is the message's event id. The real-worker proof (duplicated
messages, a worker SIGKILLed mid-task) is ``tests/live/test_celery_consumer.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from typing import Any

import pytest
from celery import shared_task
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.models import F
from django.utils import timezone

from django_idempotency._protection.task import TASK_TENANT
from django_idempotency.models import IdempotencyRecord
from django_idempotency.tasks import (
    TaskInProgress,
    TaskKeyMissing,
    TaskKeyReused,
    TaskOutcomeUncertain,
    idempotent_task,
)
from tests.telemetry import attributes_of_the_span_around
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State

OPERATION = "task tests.charge"
#: What each body did, in order: (event id, amount). Cleared per test.
executed: list[tuple[str, int]] = []


class Boom(Exception):
    pass


@idempotent_task(key="event_id", operation=OPERATION)
def charge(event_id: str, amount: int, fail: bool = False) -> dict[str, Any]:
    executed.append((event_id, amount))
    row = Charge.objects.create(tenant="task", amount=amount, note=event_id)
    if fail:
        raise Boom("after the write")
    return {"charge": row.pk, "amount": amount, "event": event_id}


@idempotent_task(key=lambda event, **_: event["id"])
def charge_event(event: dict[str, Any]) -> int:
    executed.append((event["id"], event["amount"]))
    return Charge.objects.create(tenant="task", amount=event["amount"], note=event["id"]).pk


@idempotent_task(key="event_id")
def refund(event_id: str, amount: int) -> int:
    executed.append((event_id, -amount))
    return Charge.objects.create(tenant="task", amount=-amount, note=event_id).pk


@idempotent_task(key="event_id", operation="task tests.unserialisable")
def unserialisable(event_id: str) -> object:
    Charge.objects.create(tenant="task", amount=1, note=event_id)
    return object()


@idempotent_task(key="event_id", operation="task tests.loses-its-lease")
def loses_its_lease(event_id: str) -> int:
    """Writes, then finds that another worker took its record over meanwhile."""
    Charge.objects.create(tenant="task", amount=1, note=event_id)
    IdempotencyRecord.objects.filter(tenant=TASK_TENANT, key=event_id).update(
        fencing_token=F("fencing_token") + 1
    )
    return 1


@shared_task(bind=True, name="tests.test_idempotent_task.bound_charge")
@idempotent_task(key="event_id", operation="task tests.bound")
def bound_charge(self: Any, event_id: str, amount: int) -> dict[str, Any]:
    executed.append((event_id, amount))
    row = Charge.objects.create(tenant="task", amount=amount, note=event_id)
    return {"charge": row.pk, "task_name": self.name}


@pytest.fixture(autouse=True)
def _clear_runs() -> None:
    executed.clear()


@pytest.fixture
def event_id() -> str:
    return f"evt-{uuid.uuid4().hex[:12]}"


def record(key: str, operation: str = OPERATION) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(tenant=TASK_TENANT, operation=operation, key=key)


def charges(note: str) -> int:
    return Charge.objects.filter(note=note).count()


# -- duplicates ------------------------------------------------------------------------


def test_a_duplicate_runs_the_body_once_and_returns_the_stored_result(event_id: str) -> None:
    first = charge(event_id, 5)
    duplicates = [charge(event_id, 5) for _ in range(4)]

    assert executed == [(event_id, 5)]
    assert charges(event_id) == 1
    assert first == {"charge": Charge.objects.get(note=event_id).pk, "amount": 5, "event": event_id}
    assert duplicates == [first] * 4
    stored = record(event_id)
    assert stored.state == State.COMPLETED
    assert stored.lease_owner == "" and stored.lease_expires_at is None
    assert ["Content-Type", "application/json"] in stored.response_headers


def test_positional_and_keyword_arguments_are_the_same_message(event_id: str) -> None:
    first = charge(event_id, 5)
    assert charge(event_id=event_id, amount=5) == first
    assert charge(amount=5, event_id=event_id) == first
    assert charges(event_id) == 1


def test_the_key_may_come_from_a_callable(event_id: str) -> None:
    event = {"id": event_id, "amount": 3}
    first = charge_event(event)
    assert charge_event(dict(event)) == first
    assert charges(event_id) == 1
    assert IdempotencyRecord.objects.get(key=event_id).operation == (
        f"task {__name__}.charge_event"
    )


def test_the_same_event_id_in_another_task_is_another_operation(event_id: str) -> None:
    charge(event_id, 5)
    refund(event_id, 5)
    refund(event_id, 5)

    assert executed == [(event_id, 5), (event_id, -5)]
    assert sorted(
        IdempotencyRecord.objects.filter(key=event_id).values_list("operation", flat=True)
    ) == [
        OPERATION,
        f"task {__name__}.refund",
    ]


def test_a_bound_celery_task_ignores_self_and_dedupes_across_deliveries(event_id: str) -> None:
    """``bind=True`` (as the docs recommend): the Task instance is not input."""
    results = [bound_charge.apply(args=(event_id, 4)).get() for _ in range(3)]

    assert executed == [(event_id, 4)]
    assert results == [results[0]] * 3
    assert results[0]["task_name"] == "tests.test_idempotent_task.bound_charge"
    assert record(event_id, "task tests.bound").state == State.COMPLETED


def test_ttl_sets_the_retention_of_the_record(event_id: str) -> None:
    @idempotent_task(key="event_id", operation="task tests.ttl", ttl=timedelta(minutes=7))
    def short_lived(event_id: str) -> None:
        return None

    before = timezone.now()
    assert short_lived(event_id) is None
    assert short_lived(event_id) is None  # a stored null is replayed, not re-run
    stored = record(event_id, "task tests.ttl")
    assert (
        before + timedelta(minutes=7) <= stored.expires_at <= timezone.now() + timedelta(minutes=7)
    )


# -- the body's writes and the completion commit together -------------------------------


def test_a_body_that_raises_commits_nothing_and_releases_the_claim(event_id: str) -> None:
    with pytest.raises(Boom):
        charge(event_id, 5, fail=True)

    assert charges(event_id) == 0
    assert not IdempotencyRecord.objects.filter(key=event_id).exists()

    # The redelivery (same event, now succeeding) really runs.
    result = charge(event_id, 5)
    assert charges(event_id) == 1
    assert record(event_id).state == State.COMPLETED
    assert charge(event_id, 5) == result
    assert len(executed) == 2


def test_a_result_that_cannot_be_stored_rolls_the_body_back(event_id: str) -> None:
    """The completion is part of the body's transaction: if it cannot be written,
    the body's writes go too, and the claim is released."""
    with pytest.raises(TypeError):
        unserialisable(event_id)

    assert charges(event_id) == 0
    assert not IdempotencyRecord.objects.filter(key=event_id).exists()


def test_a_completion_refused_by_fencing_rolls_the_body_back(event_id: str) -> None:
    """The record was taken over while the body ran: the completion matches no
    row, and the body's writes roll back with it."""
    with pytest.raises(TaskInProgress):
        loses_its_lease(event_id)

    assert charges(event_id) == 0
    # The takeover happened inside the rolled-back transaction too: the claim
    # is still the original one, unresolved.
    assert record(event_id, "task tests.loses-its-lease").state == State.CLAIMED


def test_the_completion_is_invisible_to_others_until_the_body_commits(event_id: str) -> None:
    """While the body runs, another connection sees a CLAIMED record and no charge."""
    seen: dict[str, Any] = {}

    def look() -> None:
        try:
            seen["record"] = IdempotencyRecord.objects.get(key=event_id).state
            seen["charges"] = charges(event_id)
        finally:
            connections.close_all()

    @idempotent_task(key="event_id", operation="task tests.observed")
    def observed(event_id: str) -> int:
        row = Charge.objects.create(tenant="task", amount=1, note=event_id)
        watcher = threading.Thread(target=look)
        watcher.start()
        watcher.join(10)
        return row.pk

    observed(event_id)
    assert seen == {"record": State.CLAIMED, "charges": 0}
    assert record(event_id, "task tests.observed").state == State.COMPLETED
    assert charges(event_id) == 1


# -- a key reused, a message in flight, an abandoned claim ---------------------------------


def test_a_key_reused_with_other_arguments_is_refused(event_id: str) -> None:
    charge(event_id, 5)

    with pytest.raises(TaskKeyReused):
        charge(event_id, 6)

    assert executed == [(event_id, 5)]
    assert list(Charge.objects.filter(note=event_id).values_list("amount", flat=True)) == [5]
    assert record(event_id).state == State.COMPLETED


def test_a_key_reused_while_in_flight_is_refused_as_reused(event_id: str) -> None:
    make_in_flight(event_id, lease=timedelta(seconds=60))

    with pytest.raises(TaskKeyReused):
        charge(event_id, 6)


def make_in_flight(event_id: str, *, lease: timedelta, state: str = State.CLAIMED) -> None:
    """Run the message once, then turn its record back into a claim held by
    another worker (lease ending ``lease`` from now) whose work never committed."""
    charge(event_id, 5)
    Charge.objects.filter(note=event_id).delete()
    IdempotencyRecord.objects.filter(tenant=TASK_TENANT, key=event_id).update(
        state=state,
        lease_owner="other-worker:1:1",
        lease_expires_at=timezone.now() + lease,
        response_status=None,
        response_body=None,
        response_headers=[],
    )
    executed.clear()


def test_an_in_flight_duplicate_raises_task_in_progress(event_id: str) -> None:
    make_in_flight(event_id, lease=timedelta(seconds=60))
    token = record(event_id).fencing_token

    with pytest.raises(TaskInProgress):
        charge(event_id, 5)

    assert executed == []
    assert charges(event_id) == 0
    held = record(event_id)
    assert (held.state, held.fencing_token, held.lease_owner) == (
        State.CLAIMED,
        token,
        "other-worker:1:1",
    )


@pytest.mark.parametrize("state", [State.IN_PROGRESS, State.UNCERTAIN])
def test_an_unresolved_record_past_its_lease_is_not_taken_over_by_a_task(
    event_id: str, state: str
) -> None:
    """Only a CLAIMED record is safe to run again; the others are recovery's."""
    make_in_flight(event_id, lease=-timedelta(seconds=1), state=state)

    # An external call began and no owner will finish it: the reconciler's.
    with pytest.raises(TaskOutcomeUncertain):
        charge(event_id, 5)

    assert executed == []
    assert record(event_id).state == state


def test_an_abandoned_claim_is_taken_over_and_run_once(event_id: str) -> None:
    make_in_flight(event_id, lease=-timedelta(seconds=1))
    token = record(event_id).fencing_token

    result = charge(event_id, 5)

    assert executed == [(event_id, 5)]
    assert charges(event_id) == 1
    taken = record(event_id)
    assert taken.state == State.COMPLETED
    assert taken.fencing_token == token + 1
    assert charge(event_id, 5) == result
    assert len(executed) == 1


@pytest.mark.postgres
def test_a_duplicate_delivered_while_the_first_runs_is_in_progress(event_id: str) -> None:
    """Two workers (threads, each with its own connection), one message: the
    second delivery arrives while the first body runs and is refused, then
    gets the stored result once the first has finished."""
    started, finish = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    @idempotent_task(key="event_id", operation="task tests.slow")
    def slow(event_id: str) -> int:
        row = Charge.objects.create(tenant="task", amount=1, note=event_id)
        started.set()
        assert finish.wait(10)
        return row.pk

    def first() -> None:
        try:
            outcome["first"] = slow(event_id)
        except BaseException as exc:  # reported below, never lost in a thread
            outcome["first"] = exc
        finally:
            connections.close_all()

    worker = threading.Thread(target=first)
    worker.start()
    try:
        assert started.wait(10)
        with pytest.raises(TaskInProgress):
            slow(event_id)
    finally:
        finish.set()
        worker.join(10)

    assert isinstance(outcome["first"], int), outcome
    assert slow(event_id) == outcome["first"]
    assert charges(event_id) == 1


def test_an_explicit_default_argument_is_the_same_message(event_id: str) -> None:
    first = charge(event_id, 5)
    assert charge(event_id, 5, fail=False) == first
    assert executed == [(event_id, 5)]


def test_a_message_past_retention_runs_again(event_id: str) -> None:
    charge(event_id, 5)
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

    charge(event_id, 5)

    assert executed == [(event_id, 5), (event_id, 5)]
    assert charges(event_id) == 2


@idempotent_task(key="event_id", operation="task tests.optional-id")
def charge_optional(event_id: str | None = None, amount: int = 1) -> int:
    executed.append((str(event_id), amount))
    return Charge.objects.create(tenant="task", amount=amount, note=str(event_id)).pk


@idempotent_task(key=lambda event: event.get("id"), operation="task tests.event-without-id")
def charge_event_without_id(event: dict[str, Any]) -> int:
    executed.append((str(event.get("id")), event["amount"]))
    return Charge.objects.create(tenant="task", amount=event["amount"], note="no-id").pk


@pytest.mark.parametrize(
    "send",
    [
        lambda: charge_optional(None, 5),
        lambda: charge_optional("", 5),
        lambda: charge_optional(amount=5),  # its default: None
        lambda: charge_event_without_id({"amount": 5}),  # the callable's None
    ],
    ids=["none", "empty", "default-none", "callable-none"],
)
def test_a_message_without_a_key_is_refused_and_runs_nothing(send: Any) -> None:
    """Two messages without an id are no duplicates of each other: neither runs, neither
    is kept under a made-up key ("None", ""), whose first result the other would get."""
    with pytest.raises(TaskKeyMissing, match="no key"):
        send()
    with pytest.raises(TaskKeyMissing):
        send()

    assert executed == []
    assert not IdempotencyRecord.objects.exists()


def test_the_literal_id_none_is_not_confused_with_a_missing_one() -> None:
    charge_optional("None", 5)
    with pytest.raises(TaskKeyMissing):
        charge_optional(None, 5)

    assert executed == [("None", 5)]


def test_a_key_taken_from_a_default_argument_is_that_default(event_id: str) -> None:
    @idempotent_task(key="event_id", operation="task tests.default-id")
    def settle(amount: int, event_id: str = "nightly-settlement") -> int:
        executed.append((event_id, amount))
        return amount

    settle(5)
    settle(5, event_id="nightly-settlement")

    assert executed == [("nightly-settlement", 5)]
    assert IdempotencyRecord.objects.get().key == "nightly-settlement"


def test_a_key_passed_through_var_keyword_arguments_is_found(event_id: str) -> None:
    @idempotent_task(key="event_id", operation="task tests.kwargs-id")
    def relay(**fields: Any) -> int:
        executed.append((fields["event_id"], fields["amount"]))
        return int(fields["amount"])

    relay(event_id=event_id, amount=3)
    relay(amount=3, event_id=event_id)

    assert executed == [(event_id, 3)]
    assert IdempotencyRecord.objects.get().key == event_id


def test_a_key_naming_no_argument_is_refused_at_decoration() -> None:
    # A typo would otherwise fail every message, at run time, with a bare KeyError.
    with pytest.raises(ImproperlyConfigured, match=r"'eventid'.*no argument of that name"):

        @idempotent_task(key="eventid")
        def task(event_id: str) -> None:
            pass


@idempotent_task(key="event_id", operation="task tests.long-ids")
def note_event(event_id: str) -> int:
    executed.append((event_id, 0))
    return Charge.objects.create(tenant="task", amount=0, note=event_id[:200]).pk


def test_a_long_message_id_is_kept_by_its_digest() -> None:
    long_id = "evt-" + "x" * 400
    first = note_event(long_id)

    assert note_event(long_id) == first
    assert len(executed) == 1
    assert IdempotencyRecord.objects.get().key.startswith("sha256:")


# -- the operation name ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["", "t" * 256, "task charge\x00", "task \x1b[2Jcharge", "task charge\rstatus: healthy"],
    ids=["empty", "too-long", "nul", "esc", "cr"],
)
def test_an_operation_name_no_record_can_hold_is_refused_at_decoration(name: str) -> None:
    # As a view's fixed operation= is: at import, not at the first message,
    # where PostgreSQL would refuse the NUL and the commands print the rest.
    with pytest.raises(ImproperlyConfigured, match="operation name"):

        @idempotent_task(key="event_id", operation=name)
        def task(event_id: str) -> None:
            pass


def test_an_operation_name_is_judged_before_django_is_set_up() -> None:
    # Celery apps and settings files import task modules before the apps are ready.
    code = "\n".join(
        [
            "from django.core.exceptions import ImproperlyConfigured",
            "from django_idempotency.tasks import idempotent_task",
            "idempotent_task(key='event_id', operation='task ok')(lambda event_id: 1)",
            "try: idempotent_task(key='event_id', operation='task \\x00')(lambda event_id: 1)",
            "except ImproperlyConfigured as exc: print(exc)",
        ]
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )

    assert result.returncode == 0, result.stderr
    assert "holds the control or unprintable character U+0000" in result.stdout


# What a run ended with: one outcome, on the span current around the task
# (a Celery worker's task span, under its instrumentation).


def test_each_run_ends_with_one_outcome_on_the_tasks_span(event_id: str) -> None:
    first = attributes_of_the_span_around(lambda: charge(event_id, 5))
    duplicate = attributes_of_the_span_around(lambda: charge(event_id, 5))
    reused = attributes_of_the_span_around(lambda: charge(event_id, 6))
    failed = attributes_of_the_span_around(lambda: charge(f"{event_id}-fails", 5, fail=True))

    assert first == {"idempotency.operation": OPERATION, "idempotency.task.outcome": "executed"}
    assert duplicate["idempotency.task.outcome"] == "replayed"
    assert reused["idempotency.task.outcome"] == "refused"
    assert reused["idempotency.refusal"] == "key_reused"
    assert failed["idempotency.task.outcome"] == "released"
    assert event_id not in repr([first, duplicate, reused, failed])


def test_a_duplicate_whose_stored_result_cannot_be_read_is_no_replay(
    event_id: str, settings: Any
) -> None:
    """The stored result is encrypted with a key no longer configured: the run raises,
    and its outcome says it failed, not that the duplicate got the result."""
    from cryptography.fernet import Fernet

    from django_idempotency._store.sealing import UnreadableRecord

    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}
    charge(event_id, 5)
    settings.IDEMPOTENCY = {}

    with pytest.raises(UnreadableRecord):
        charge(event_id, 5)
    duplicate = attributes_of_the_span_around(lambda: charge(event_id, 5))

    assert duplicate["idempotency.task.outcome"] == "error"
    assert executed == [(event_id, 5)]


def test_a_run_refused_before_its_claim_still_ends_with_one_outcome(event_id: str) -> None:
    """Arguments that cannot be fingerprinted (NaN) fail the run before any claim."""
    failed = attributes_of_the_span_around(lambda: charge(event_id, float("nan")))  # type: ignore[arg-type]

    assert failed == {"idempotency.operation": OPERATION, "idempotency.task.outcome": "error"}
    assert executed == []
