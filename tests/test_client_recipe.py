"""The client recipe of docs/clients.md (docs/examples/idempotent_client.py) against the test views.

The recipe's httpx client talks to the test project's WSGI application in
this process (``httpx.WSGITransport``), on the suite's database: each rule
that needs no broken connection is shown here on SQLite, PostgreSQL and
MariaDB. The records' states a retry meets (a request still running, an
outcome left uncertain) are set in the database, as a crash would leave
them. Dropped connections, killed workers and a store that refuses
connections are in tests/live/test_client_recipe_live.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
import stamina
from django.core.handlers.wsgi import WSGIHandler
from django.db import connection
from django.utils import timezone

from django_idempotency.models import IdempotencyRecord
from django_idempotency.outcomes import Verdict, by_status
from docs.examples.idempotent_client import Outcome, send_idempotent
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)

CHARGES = "/api-view/charges"
State = IdempotencyRecord.State


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    transport = httpx.WSGITransport(app=WSGIHandler())
    with httpx.Client(transport=transport, base_url="http://testserver") as client:
        yield client


def charge(client: httpx.Client, body: dict[str, Any], key: str, deadline: float = 10) -> Outcome:
    return send_idempotent(client, "POST", CHARGES, json=body, key=key, deadline=deadline)


@contextlib.contextmanager
def left_unsettled(key: str, **fields: Any) -> Iterator[None]:
    """The key's COMPLETED record set to ``fields`` for a while, then put back.

    Put back after 4 seconds, unless the block ended first: a recipe that
    ignored its deadline would get the replay then, and fail the test
    rather than retry forever.
    """
    record = IdempotencyRecord.objects.filter(key=key)
    saved = record.values("state", "lease_owner", "lease_expires_at").get()
    record.update(**fields)
    done = threading.Event()

    def put_back() -> None:
        if not done.wait(4):
            record.update(**saved)
        connection.close()

    restorer = threading.Thread(target=put_back, name="put-back")
    restorer.start()
    try:
        yield
    finally:
        done.set()
        restorer.join()


def test_a_repeated_operation_is_answered_from_the_record_and_says_so(
    client: httpx.Client, new_key: Callable[[], str]
) -> None:
    key = new_key()
    first = charge(client, {"amount": 100}, key)
    again = charge(client, {"amount": 100}, key)

    assert (first.response.status_code, first.replayed, first.attempts) == (201, False, 1)
    assert (again.response.status_code, again.replayed, again.attempts) == (201, True, 1)
    assert again.response.content == first.response.content
    assert Charge.objects.count() == 1


def test_each_operation_gets_a_key_of_its_own_when_the_caller_gives_none(
    client: httpx.Client,
) -> None:
    outcomes = [
        send_idempotent(client, "POST", CHARGES, json={"amount": 100}),
        send_idempotent(client, "POST", CHARGES, json={"amount": 100}),
    ]

    assert [outcome.response.headers["Idempotency-Key"] for outcome in outcomes] == [
        outcome.key for outcome in outcomes
    ]
    assert len({outcome.key for outcome in outcomes}) == 2
    assert all(uuid.UUID(outcome.key) for outcome in outcomes)
    assert Charge.objects.count() == 2


def test_a_server_error_is_retried_under_the_same_key_until_the_operation_runs(
    client: httpx.Client, new_key: Callable[[], str]
) -> None:
    # The view fails with a database error on the first request of a key
    # only, as a transient deadlock would: the claim is released, the retry runs.
    key = new_key()
    outcome = charge(client, {"amount": 100, "db_error": "deadlock", "db_error_once": True}, key)

    assert (outcome.response.status_code, outcome.replayed, outcome.attempts) == (201, False, 2)
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get(key=key).state == State.COMPLETED


def test_a_replay_is_the_outcome_whatever_its_status(
    client: httpx.Client, new_key: Callable[[], str], settings: Any
) -> None:
    # A policy that stores a 503 as the operation's outcome: the first answer
    # is retried (it could be a passing outage), its replay is final.
    settings.IDEMPOTENCY = {"OUTCOME": by_status({503: Verdict.FAILED})}
    key = new_key()

    outcome = charge(client, {"amount": 100, "status": 503}, key, deadline=5)

    assert (outcome.response.status_code, outcome.replayed, outcome.attempts) == (503, True, 2)
    assert Charge.objects.count() == 1


@pytest.mark.parametrize(
    ("body", "key", "status", "says"),
    [
        ({"amount": 100, "invalid": True}, "refused-input", 400, "not accepted"),
        ({"amount": 100}, "a key with spaces", 400, "idempotency_key_invalid"),
        ({"amount": 100, "raise_status": 409}, "own-conflict", 409, "Answered 409"),
        ({"amount": 100, "forbidden": True}, "forbidden", 403, "not allowed"),
    ],
    ids=["refused input", "invalid key", "the view's own 409", "a definitive 403"],
)
def test_an_answer_that_settles_the_operation_is_not_retried(
    client: httpx.Client, body: dict[str, Any], key: str, status: int, says: str
) -> None:
    key = f"{key}-{uuid.uuid4().hex[:8]}" if " " not in key else key
    outcome = charge(client, body, key)

    assert (outcome.response.status_code, outcome.attempts) == (status, 1)
    assert says in outcome.response.text
    assert Charge.objects.count() == 0


def test_a_key_reused_with_other_input_is_not_retried(
    client: httpx.Client, new_key: Callable[[], str]
) -> None:
    key = new_key()
    charge(client, {"amount": 100}, key)

    outcome = charge(client, {"amount": 999}, key)

    assert (outcome.response.status_code, outcome.attempts) == (422, 1)
    assert outcome.response.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1


def test_a_request_in_progress_is_retried_after_retry_after_until_the_deadline(
    client: httpx.Client, new_key: Callable[[], str]
) -> None:
    key = new_key()
    charge(client, {"amount": 100}, key)
    # As if its first request still ran: its owner holds the lease.
    in_progress = {
        "state": State.CLAIMED,
        "lease_expires_at": timezone.now() + timedelta(minutes=5),
    }

    started = time.monotonic()
    with left_unsettled(key, **in_progress):
        outcome = charge(client, {"amount": 100}, key, deadline=2.5)
    elapsed = time.monotonic() - started

    assert outcome.response.status_code == 409
    assert outcome.response.json()["code"] == "idempotency_request_in_progress"
    assert outcome.response.headers["Retry-After"] == "1"
    assert outcome.attempts >= 2
    # Each wait is at least Retry-After. The deadline bounds when the last
    # attempt starts, not when its answer arrives: that round trip may end
    # past it (seen at 2.52 s with the test passes running side by side). A
    # recipe ignoring the deadline would still be retrying at 4 s, and get
    # the replay left_unsettled() then puts back.
    assert outcome.attempts - 1 <= elapsed < 2.5 + 0.5
    assert Charge.objects.count() == 1


def test_an_uncertain_outcome_is_returned_when_its_retry_after_ends_past_the_deadline(
    client: httpx.Client, new_key: Callable[[], str]
) -> None:
    key = new_key()
    charge(client, {"amount": 100}, key)
    uncertain = {"state": State.UNCERTAIN, "lease_owner": "", "lease_expires_at": timezone.now()}

    started = time.monotonic()
    with left_unsettled(key, **uncertain):
        outcome = charge(client, {"amount": 100}, key, deadline=4)

    # Retry-After: 5 (recovery looks again then) ends past the deadline: the
    # 503 is returned at once, for the caller to come back with the same key.
    assert time.monotonic() - started < 1
    assert (outcome.response.status_code, outcome.attempts) == (503, 1)
    assert outcome.response.json()["code"] == "idempotency_outcome_uncertain"
    assert outcome.response.headers["Retry-After"] == "5"


def test_stamina_testing_mode_retries_at_once_as_many_times_as_it_is_told(
    client: httpx.Client, new_key: Callable[[], str]
) -> None:
    """docs/clients.md: no wait in stamina's testing mode, and by default one attempt."""
    key = new_key()
    charge(client, {"amount": 100}, key)
    in_progress = {
        "state": State.CLAIMED,
        "lease_expires_at": timezone.now() + timedelta(minutes=5),
    }

    started = time.monotonic()
    with left_unsettled(key, **in_progress):
        with stamina.set_testing(True, attempts=3):
            told = charge(client, {"amount": 100}, key)
        with stamina.set_testing(True):
            default = charge(client, {"amount": 100}, key)

    assert time.monotonic() - started < 1  # Retry-After: 1 was not waited for
    assert (told.response.status_code, told.attempts) == (409, 3)
    assert (default.response.status_code, default.attempts) == (409, 1)
