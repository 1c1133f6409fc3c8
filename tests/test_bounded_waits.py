"""Every wait of a request on another session's lock on its record is bounded.

A worker cut off from the database mid-transaction (a network partition,
not a crash: no RST reaches the server) keeps its row locks until the
server notices, which with default TCP settings takes minutes to hours
(docs/fleet.md gives the keepalive settings that shorten it). A retry on
another host must not hang behind it for that long: on PostgreSQL the
takeover of an abandoned claim waits at most ``IN_FLIGHT_WAIT`` and then
answers 409 with Retry-After, the answer of a key in flight; an
``optimistic`` view's lookup is bounded the same way
(tests/test_optimistic.py).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency._store import maintenance
from django_idempotency._store.conditional import take_over_where
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import recover_stale_records
from django_idempotency.tasks import TaskInProgress, idempotent_task
from tests.factories import RecordFactory
from tests.sessions import key_held_by_an_open_transaction, row_locked_by_an_open_transaction
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
State = IdempotencyRecord.State
URL = "/api-view/charges"
#: How long the test waits for a request that should have given up at
#: IN_FLIGHT_WAIT (0.5 s): only a hang, the bug, gets anywhere near it.
HANG = 60.0
#: How long the cut-off recovery worker stays silent: far past the server's
#: bound (IN_FLIGHT_WAIT, at least 1 s) for the order of events to tell.
CUT_OFF = 8.0


def _abandoned_claim(api: APIClient) -> IdempotencyRecord:
    """A CLAIMED record of the key "k" whose owner's lease ran out."""
    post(api, URL, {"amount": 1}, "k")
    Charge.objects.all().delete()
    IdempotencyRecord.objects.update(
        state=State.CLAIMED,
        lease_owner="cut-off-worker:1:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    return IdempotencyRecord.objects.get()


def _post_in_a_thread(api: APIClient) -> Any:
    """The retry, in a thread of its own: a hang must fail the test, not stall it."""
    answers: list[Any] = []

    def retry() -> None:
        try:
            answers.append(post(api, URL, {"amount": 1}, "k"))
        finally:
            connections.close_all()  # this thread's own connection

    thread = threading.Thread(target=retry)
    thread.start()
    thread.join(HANG)
    assert not thread.is_alive(), f"the retry still waits on the locked row after {HANG} s"
    return answers[0]


@pytest.mark.parametrize("in_flight", ["conflict", "wait"])
def test_a_retry_waits_at_most_in_flight_wait_on_a_cut_off_owners_row_lock(
    api: APIClient, settings: Any, in_flight: str
) -> None:
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "IN_FLIGHT": in_flight,
        "IN_FLIGHT_WAIT": 0.5,
    }
    record = _abandoned_claim(api)

    with row_locked_by_an_open_transaction(record.pk):
        refused = _post_in_a_thread(api)

    assert refused.status_code == 409
    assert refused.json()["code"] == "idempotency_request_in_progress"
    assert refused["Retry-After"]
    assert Charge.objects.count() == 0
    record.refresh_from_db()
    assert (record.state, record.fencing_token) == (State.CLAIMED, 1)

    # The holder gone (the server ended its session), the next retry takes over.
    retry = post(api, URL, {"amount": 1}, "k")
    assert retry.status_code == 201
    assert Charge.objects.count() == 1
    record.refresh_from_db()
    assert (record.state, record.fencing_token) == (State.COMPLETED, 2)


def test_the_takeovers_lock_timeout_ends_with_its_statement(api: APIClient, settings: Any) -> None:
    """The bound is the UPDATE's own: the connection's next statements wait as they did."""
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "IN_FLIGHT_WAIT": 0.5}
    _abandoned_claim(api)
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        before = cursor.fetchone()[0]

    assert post(api, URL, {"amount": 1}, "k").status_code == 201

    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == before


def test_a_redelivered_task_waits_at_most_in_flight_wait_then_is_in_progress(
    settings: Any,
) -> None:
    """The task flow shares the takeover: a busy row is TaskInProgress, never a hang."""
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "IN_FLIGHT_WAIT": 0.5}
    runs: list[str] = []

    @idempotent_task(key=lambda event_id: event_id)
    def settle(event_id: str) -> str:
        runs.append(event_id)
        return event_id

    assert settle("evt-1") == "evt-1"
    IdempotencyRecord.objects.update(
        state=State.CLAIMED,
        lease_owner="cut-off-worker:1:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    record = IdempotencyRecord.objects.get()
    outcome: list[BaseException | str] = []

    def redeliver() -> None:
        try:
            outcome.append(settle("evt-1"))
        except BaseException as exc:  # the test reads it below
            outcome.append(exc)
        finally:
            connections.close_all()

    with row_locked_by_an_open_transaction(record.pk):
        thread = threading.Thread(target=redeliver)
        thread.start()
        thread.join(HANG)
        assert not thread.is_alive(), f"the redelivery still waits after {HANG} s"

    assert isinstance(outcome[0], TaskInProgress)
    assert runs == ["evt-1"]
    assert settle("evt-1") == "evt-1"  # the lock gone: taken over, run once more
    assert runs == ["evt-1", "evt-1"]


def test_a_recovery_worker_cut_off_mid_takeover_holds_the_row_no_longer_than_in_flight_wait(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's own write is not kept waiting by a recovery session nobody will finish.

    Recovery locks the stale record (SELECT ... FOR UPDATE) and then takes
    it over (UPDATE). Here its worker stops talking between the two, as one
    cut off from the database would: the server ends that session after
    IN_FLIGHT_WAIT (at least a second) and the late owner's write, waiting
    on the row meanwhile, goes through long before the worker wakes up.
    """
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "IN_FLIGHT_WAIT": 0.5}
    record = RecordFactory.create(
        state=State.CLAIMED,
        lease_owner="late-owner:1:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    locked, woke = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def cut_off_after_the_select(*args: Any, **kwargs: Any) -> Any:
        locked.set()
        time.sleep(CUT_OFF)  # the worker's packets go nowhere meanwhile
        woke.set()
        return take_over_where(*args, **kwargs)

    monkeypatch.setattr(maintenance, "take_over_where", cut_off_after_the_select)

    def recover() -> None:
        try:
            recover_stale_records()
        except BaseException as exc:  # the session the server ended, read below
            failures.append(exc)
        finally:
            connections.close_all()

    worker = threading.Thread(target=recover)
    worker.start()
    assert locked.wait(HANG)
    # The owner's write waits on the row, then goes through once the
    # server has ended the recovery's session.
    IdempotencyRecord.objects.filter(pk=record.pk).update(lease_owner="late-owner:1:1 wrote")
    written_before_the_worker_woke = not woke.is_set()
    worker.join(HANG)

    assert written_before_the_worker_woke
    assert failures and isinstance(failures[0], DatabaseError)
    record.refresh_from_db()
    assert (record.lease_owner, record.fencing_token) == ("late-owner:1:1 wrote", 1)


@pytest.mark.parametrize("in_flight", ["conflict", "wait"])
def test_a_claim_waits_at_most_in_flight_wait_behind_an_uncommitted_record_of_its_key(
    api: APIClient, settings: Any, in_flight: str
) -> None:
    """Another session inserted (or deleted) the scope's row and went silent before COMMIT.

    A duplicate's ``optimistic`` transaction, or recovery
    releasing a claim while its reconciler's writes wait: the default
    mode's INSERT ... ON CONFLICT waits for that transaction to end. The
    fleet's partition test met it (tests/fleet/test_partition.py).
    """
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "IN_FLIGHT": in_flight,
        "IN_FLIGHT_WAIT": 0.5,
    }
    with key_held_by_an_open_transaction("POST api-view/charges"):
        refused = _post_in_a_thread(api)

    assert refused.status_code == 409
    assert refused.json()["code"] == "idempotency_request_in_progress"
    assert refused["Retry-After"]
    assert Charge.objects.count() == 0
    # The holder gone (rolled back), the retry runs.
    assert post(api, URL, {"amount": 1}, "k").status_code == 201
    assert Charge.objects.count() == 1
