"""Takeovers: the claim loop views and tasks share, and the compare-and-set behind it.

``store.claim_or_take_over`` (claim, discard an expired record, take over an
abandoned claim, a bounded number of times) and ``take_over_where``, which
the request's, recovery's and the operator's takeovers share. Written
against public import paths only, so that the same file can run against
the code before and after a reorganisation of the store, to prove that
behaviour did not change.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import _store as store
from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from django_idempotency.tasks import TaskInProgress, TaskKeyReused, idempotent_task
from tests.factories import RecordFactory
from tests.testapp.models import Charge
from tests.utils import post, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
TABLE = IdempotencyRecord._meta.db_table
URL = "/api-view/charges"
#: What the task body ran, in order. Cleared per test.
executed: list[tuple[str, int]] = []


@idempotent_task(key="event_id", operation="task tests.review")
def review_charge(event_id: str, amount: int) -> int:
    executed.append((event_id, amount))
    return Charge.objects.create(tenant="task", amount=amount, note=event_id).pk


@pytest.fixture(autouse=True)
def _clear_runs() -> None:
    executed.clear()


def _task_record(event_id: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(tenant="task", key=event_id)


# -- take_over_for_operator: ~Q(lease_owner > '', lease_expires_at > now) -----------------


@pytest.mark.parametrize("owner", ["", "host:1:2"])
@pytest.mark.parametrize("lease", [None, "past", "future"])
def test_an_operator_takes_a_record_unless_someone_holds_a_live_lease(
    owner: str, lease: str | None
) -> None:
    """NULL leases included: ``NOT (a AND b)`` must be true where b is NULL, on every vendor."""
    now = timezone.now()
    ends = {None: None, "past": now - timedelta(seconds=5), "future": now + timedelta(minutes=5)}
    record = RecordFactory.create(
        state=State.UNCERTAIN,
        lease_owner=owner,
        lease_expires_at=ends[lease],
        response_status=None,
        response_body=None,
        response_headers=[],
    )

    taken = store.take_over_for_operator(
        record,
        seen_state=State.UNCERTAIN,
        operator="ops",
        lease=timedelta(minutes=1),
        using="default",
    )

    held_by_someone = bool(owner) and lease == "future"
    assert (taken is not None) == (not held_by_someone)
    stored = IdempotencyRecord.objects.get(pk=record.pk)
    assert stored.lease_owner == (owner if held_by_someone else "operator:ops")


# -- the shared claim loop, from a view -----------------------------------------------


def test_a_waiting_retry_takes_over_a_claim_whose_lease_runs_out_while_it_waits(
    api: APIClient, settings: Any
) -> None:
    """IN_FLIGHT="wait": each poll goes through the loop again, takeover included."""
    post(api, URL, {"amount": 1}, "k")
    Charge.objects.all().delete()
    IdempotencyRecord.objects.update(
        state=State.CLAIMED,
        lease_owner="dead-worker:1:1",
        lease_expires_at=timezone.now() + timedelta(seconds=0.4),
    )
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "IN_FLIGHT": "wait",
        "IN_FLIGHT_WAIT": 5,
    }

    retry = post(api, URL, {"amount": 1}, "k")

    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.fencing_token) == (State.COMPLETED, 2)


def test_an_abandoned_claim_of_other_input_is_a_422_and_is_not_taken_over(
    api: APIClient,
) -> None:
    post(api, URL, {"amount": 1}, "k")
    IdempotencyRecord.objects.update(
        state=State.CLAIMED, lease_expires_at=timezone.now() - timedelta(seconds=1)
    )

    response = post(api, URL, {"amount": 2}, "k")

    assert response.status_code == 422
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.fencing_token) == (State.CLAIMED, 1)


@contextlib.contextmanager
def _takeovers_lose() -> Iterator[None]:
    """Every UPDATE of a record matches no row, as if another worker took it first each time.

    A real trigger, not a stand-in: the database skips the row (PostgreSQL's
    BEFORE trigger returning NULL, SQLite's RAISE(IGNORE)).
    """
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "CREATE FUNCTION review_skip() RETURNS trigger LANGUAGE plpgsql "
                "AS $$ BEGIN RETURN NULL; END $$"
            )
            cursor.execute(
                f"CREATE TRIGGER review_skip BEFORE UPDATE ON {TABLE} "
                "FOR EACH ROW EXECUTE FUNCTION review_skip()"
            )
        elif connection.vendor == "sqlite":
            cursor.execute(
                f"CREATE TRIGGER review_skip BEFORE UPDATE ON {TABLE} "
                "BEGIN SELECT RAISE(IGNORE); END"
            )
        else:
            pytest.skip("MySQL/MariaDB triggers cannot skip a row without an error")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute(f"DROP TRIGGER review_skip ON {TABLE}")
                cursor.execute("DROP FUNCTION review_skip()")
            else:
                cursor.execute("DROP TRIGGER review_skip")


def test_a_key_that_keeps_changing_hands_is_claimed_four_times_then_refused_with_409(
    api: APIClient,
) -> None:
    """MAX_RECLAIMS: the claim is tried 1 + 3 times, then 409 naming the record's state."""
    post(api, URL, {"amount": 1}, "k")
    IdempotencyRecord.objects.update(
        state=State.CLAIMED, lease_expires_at=timezone.now() - timedelta(seconds=1)
    )

    with (
        _takeovers_lose(),
        signals_sent({"in_flight": signals.request_in_flight}) as sent,
        CaptureQueriesContext(connection) as queries,
    ):
        response = post(api, URL, {"amount": 1}, "k")

    assert response.status_code == 409
    claims = [q for q in queries.captured_queries if q["sql"].lstrip().upper().startswith("INSERT")]
    assert len(claims) == 4
    # The signal names the state of the record that holds the key (docs/signals.md).
    assert [kwargs["state"] for _, kwargs in sent] == [State.CLAIMED]


def _at_once(count: int, call: Any) -> list[Any]:
    """Run ``call`` in ``count`` threads released together, each on its own connections."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = call()
        except Exception as exc:  # the outcome of this thread, to compare
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


# -- the shared claim loop, from a task ------------------------------------------------


def test_a_task_finding_an_abandoned_claim_of_other_arguments_refuses_it_as_reused() -> None:
    event_id = f"evt-{uuid.uuid4().hex[:12]}"
    review_charge(event_id, 5)
    IdempotencyRecord.objects.filter(tenant="task", key=event_id).update(
        state=State.CLAIMED,
        lease_owner="dead-worker:1:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )

    with pytest.raises(TaskKeyReused):
        review_charge(event_id, 6)

    record = _task_record(event_id)
    assert (record.state, record.fencing_token, record.lease_owner) == (
        State.CLAIMED,
        1,
        "dead-worker:1:1",
    )


@pytest.mark.skipif(connection.vendor == "sqlite", reason="one writer at a time: no race")
def test_concurrent_redeliveries_of_an_abandoned_task_run_its_body_once() -> None:
    event_id = f"evt-{uuid.uuid4().hex[:12]}"
    review_charge(event_id, 5)
    Charge.objects.filter(note=event_id).delete()
    IdempotencyRecord.objects.filter(tenant="task", key=event_id).update(
        state=State.CLAIMED,
        lease_owner="dead-worker:1:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        response_status=None,
        response_body=None,
        response_headers=[],
    )
    executed.clear()

    results = _at_once(8, lambda: review_charge(event_id, 5))

    assert len(executed) == 1
    assert Charge.objects.filter(note=event_id).count() == 1
    assert all(isinstance(r, (int, TaskInProgress)) for r in results)
    record = _task_record(event_id)
    assert (record.state, record.fencing_token) == (State.COMPLETED, 2)


def test_a_message_past_retention_runs_again_with_other_arguments() -> None:
    event_id = f"evt-{uuid.uuid4().hex[:12]}"
    review_charge(event_id, 5)
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

    review_charge(event_id, 7)

    assert executed == [(event_id, 5), (event_id, 7)]
    assert _task_record(event_id).state == State.COMPLETED
