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
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, OperationalError, connection, connections, transaction
from django.db.models import Q
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import recovery
from django_idempotency._store import maintenance
from django_idempotency._store.conditional import take_over_where
from django_idempotency._store.errors import is_contention
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, recover_stale_records
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


# The bounded waits of takeovers and recovery outside autocommit, and their limits (PostgreSQL).
#
# _store/conditional.py bounds a takeover's wait on a locked row with a
# ``set_config('lock_timeout', ..., true)`` condition in the UPDATE's WHERE,
# in autocommit only; _store/maintenance.py has the server end a recovery
# transaction that idles past IN_FLIGHT_WAIT (``idle_in_transaction_session_timeout``
# set the same way in its SELECT ... FOR UPDATE). What these tests show:
#
# - (fixed) a task (``idempotent_task``) called inside a transaction of the
#   caller's own (a task body run eagerly from a view's ``atomic``, a test's
#   TestCase, a wrapper that opens one) waits on a cut-off holder's row lock
#   without any bound: the bound is skipped whenever ``in_atomic_block``.
# - (fixed) with Django's transaction management off (``AUTOCOMMIT: False``
#   in DATABASES, or ``transaction.set_autocommit(False)``) ``in_atomic_block``
#   is False while a transaction is open: the takeover's ``lock_timeout`` then
#   outlives its statement, and recovery's
#   ``idle_in_transaction_session_timeout`` stays in force for the rest of the
#   caller's transaction (the server ends the session when the caller next
#   idles past IN_FLIGHT_WAIT). The checks should be
#   ``connection.get_autocommit() and not connection.in_atomic_block``.
# - (fixed) recovery replaces an operator's stricter
#   ``idle_in_transaction_session_timeout`` with IN_FLIGHT_WAIT for its
#   transaction (the smaller of the two would keep both promises).
# - passes: the bound holds with server-side binding and prepared statements
#   (``server_side_binding`` and ``prepare_threshold=0`` in OPTIONS: a
#   generic plan still evaluates the volatile ``set_config`` on each row
#   before locking it).
# - passes: a healthy recovery whose reconciler is slower than IN_FLIGHT_WAIT
#   is not ended by the server: the reconciler runs after the takeover's
#   transaction committed, so the idle timeout is gone by then; and nothing
#   of either setting is left on the connection afterwards.

#: Bound on a wait that should end within IN_FLIGHT_WAIT (0.5 s): only a hang gets near it.
#: How long a wait must last to count as unbounded here: 40 times IN_FLIGHT_WAIT.
STUCK = 20.0


@pytest.fixture
def short_wait(settings: Any) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "IN_FLIGHT_WAIT": 0.5}


def _show(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SHOW {name}")
        return str(cursor.fetchone()[0])


def _abandoned(operation: str = "task:review", state: str = State.CLAIMED) -> IdempotencyRecord:
    record: IdempotencyRecord = RecordFactory.create(
        operation=operation,
        state=state,
        lease_owner="cut-off-worker:1:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    return record


def _in_a_thread(target: Any) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:  # read by the test
            outcome.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# -- A caller's transaction -----------------------------------------------------------------


def test_a_task_called_inside_a_transaction_waits_at_most_in_flight_wait(
    short_wait: None,
) -> None:
    """Was failing, now fixed:

    inside the caller's transaction the takeover waits on the row for ever.

    conditional.py:58-60 leaves the bound out ``in_atomic_block`` ("the
    setting would outlive the statement"): so a redelivered task run inside
    a transaction hangs behind a cut-off holder until the server drops that
    holder's session (TCP keepalive: minutes to hours). A savepoint around
    the UPDATE, with ``lock_timeout`` set for it and put back after (or a
    ``SET LOCAL`` restored with ``set_config(..., <previous>, true)``), would
    bound it there too.
    """
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

    def redeliver_in_a_transaction() -> str:
        with transaction.atomic():
            return settle("evt-1")

    with row_locked_by_an_open_transaction(record.pk):
        thread, outcome = _in_a_thread(redeliver_in_a_transaction)
        thread.join(STUCK)
        stuck = thread.is_alive()
    thread.join(HANG)  # the lock gone: it goes on

    assert not stuck, f"the task still waited on the locked row after {STUCK} s"
    assert isinstance(outcome[0], TaskInProgress)


# -- Transaction management off ---------------------------------------------------------------


@pytest.fixture
def autocommit_off() -> Iterator[None]:
    """As Django's ``AUTOCOMMIT: False``: a transaction opens with the first statement."""
    transaction.set_autocommit(False)
    try:
        yield
    finally:
        connection.rollback()
        transaction.set_autocommit(True)


def test_the_takeovers_lock_timeout_ends_with_its_statement_when_autocommit_is_off(
    short_wait: None, autocommit_off: None
) -> None:
    """Was failing, now fixed:

    ``in_atomic_block`` is False, yet the UPDATE runs in an open transaction."""
    default = _show("lock_timeout")
    record = _abandoned()

    token = _take_over(record)

    assert token == 2
    assert _show("lock_timeout") == default, (
        "the takeover's lock_timeout outlived its statement: every later lock wait of the "
        "caller's transaction now fails after IN_FLIGHT_WAIT"
    )


def _take_over(record: IdempotencyRecord) -> int | None:
    """A request's takeover (claims.py take_over) of ``record``, its condition cut short."""
    return take_over_where(
        record,
        Q(state=State.CLAIMED),
        owner="retry:1:1",
        lease=timedelta(seconds=30),
        using="default",
        wait_at_most=timedelta(seconds=0.5),
    )


def test_recovery_leaves_no_idle_timeout_in_a_transaction_it_did_not_open(
    short_wait: None, autocommit_off: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was failing, now fixed:

    with autocommit off, recovery's idle timeout stays for the caller's transaction.

    ``transaction.atomic`` does not commit when autocommit is off, so the
    takeover's transaction is the caller's, and so is the setting: the
    caller's next pause longer than IN_FLIGHT_WAIT (at least 1 s) before
    its commit ends the session on the server.
    """
    default = _show("idle_in_transaction_session_timeout")
    _abandoned("op:recovered", State.UNCERTAIN)
    monkeypatch.setitem(
        recovery._reconcilers, "op:recovered", lambda record: Completed(status=200, body={})
    )

    recover_stale_records()

    assert _show("idle_in_transaction_session_timeout") == default


# -- What holds -------------------------------------------------------------------------------


@pytest.fixture
def prepared_statements() -> Iterator[None]:
    """The records' alias with server-side binding, every statement prepared, generic plans."""
    options = connections.settings["default"].setdefault("OPTIONS", {})
    before = dict(options)
    connections.close_all()
    options.update(
        server_side_binding=True,
        prepare_threshold=0,
        # The generic plan from the first execution on (not after five custom ones).
        options="-c plan_cache_mode=force_generic_plan",
    )
    try:
        yield
    finally:
        options.clear()
        options.update(before)
        connections.close_all()


def test_the_bound_holds_with_server_side_binding_and_prepared_statements(
    short_wait: None, prepared_statements: None
) -> None:
    assert connection.settings_dict["OPTIONS"].get("server_side_binding") is True
    record = _abandoned()
    # A few takeovers first (each of a fresh record), so that the statement
    # is prepared and may run with a generic plan when it matters.
    for _ in range(6):
        other = _abandoned(f"op:{time.monotonic_ns()}")
        assert _take_over(other) == 2
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement ILIKE %s",
            ["UPDATE%set_config('lock_timeout'%"],
        )
        assert cursor.fetchone()[0] >= 1  # the takeover is a prepared statement indeed
    assert _show("plan_cache_mode") == "force_generic_plan"

    with row_locked_by_an_open_transaction(record.pk):
        thread, outcome = _in_a_thread(lambda: _take_over(record))
        thread.join(HANG)
        assert not thread.is_alive(), "the prepared takeover waited without bound"

    assert isinstance(outcome[0], OperationalError) and is_contention(outcome[0])
    record.refresh_from_db()
    assert record.fencing_token == 1


def test_a_reconciler_slower_than_in_flight_wait_is_not_ended_by_the_server(
    short_wait: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle timeout lasts only for the takeover's own transaction, not the reconciler's."""
    default = _show("idle_in_transaction_session_timeout")
    _abandoned("op:slow-reconciler", State.UNCERTAIN)

    def slow(record: IdempotencyRecord) -> Completed:
        time.sleep(2.5)  # idle in its transaction past the 1 s the takeover set
        return Completed(status=200, body={"settled": True})

    monkeypatch.setitem(recovery._reconcilers, "op:slow-reconciler", slow)

    report = recover_stale_records()

    assert report.completed == 1
    record = IdempotencyRecord.objects.get(operation="op:slow-reconciler")
    assert record.state == State.COMPLETED
    assert _show("idle_in_transaction_session_timeout") == default
    assert _show("lock_timeout") == "0"


def test_a_takeover_inside_a_transaction_leaves_the_callers_lock_timeout_alone(
    short_wait: None,
) -> None:
    record = _abandoned()
    with transaction.atomic():
        before = _show("lock_timeout")
        assert _take_over(record) == 2
        assert _show("lock_timeout") == before


def test_recovery_never_loosens_a_stricter_idle_timeout_the_operator_set(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was failing, now fixed:

    recovery's transaction-local value replaces the operator's, even a stricter one.

    An operator who set ``idle_in_transaction_session_timeout = 2s`` (ALTER
    ROLE, postgresql.conf, OPTIONS) gets IN_FLIGHT_WAIT (here 60 s) in
    recovery's transaction instead: maintenance.py sets the value without
    looking at the one in force. The smaller of the two (0 meaning none)
    would keep the promise of both. (The takeover's ``lock_timeout`` in
    conditional.py replaces a stricter session ``lock_timeout`` the same way.)
    """
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "IN_FLIGHT_WAIT": 60}
    with connection.cursor() as cursor:
        cursor.execute("SET idle_in_transaction_session_timeout = '2s'")
    _abandoned("op:strict-operator", State.UNCERTAIN)
    monkeypatch.setitem(
        recovery._reconcilers, "op:strict-operator", lambda record: Completed(status=200, body={})
    )
    in_force: list[str] = []
    original = take_over_where

    def noting_the_setting(*args: Any, **kwargs: Any) -> Any:
        in_force.append(_show("idle_in_transaction_session_timeout"))  # between SELECT and UPDATE
        return original(*args, **kwargs)

    monkeypatch.setattr(maintenance, "take_over_where", noting_the_setting)
    try:
        recover_stale_records()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET idle_in_transaction_session_timeout")

    assert in_force == ["2s"], f"in force while the row was locked: {in_force}"
