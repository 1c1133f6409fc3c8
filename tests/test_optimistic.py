"""optimistic=True: the view first, then its record, written once, finished, before the commit.

Concurrent duplicates may each run the view body; exactly one commits, and
every other one answers with the winner's replay (or 422), or 409 when it
gave up waiting: never the domain error it met, never an outage. The
losers' races are real: threads, each with its own database connection.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections
from django.db.models import F
from django.http import JsonResponse
from django.test import RequestFactory, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import idempotent, signals
from django_idempotency.models import IdempotencyRecord
from django_idempotency.outcomes import Verdict, by_status
from tests import configurations
from tests.sessions import key_held_by_an_open_transaction
from tests.test_store_unavailable import unreachable_store  # noqa: F401 (a fixture)
from tests.testapp.models import Charge, Order
from tests.utils import post, signals_sent

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.guarantees,
    # In the other cells these tests would repeat the baseline's.
    pytest.mark.not_under(
        *(
            name
            for name in configurations.CONFIGURATIONS
            if name not in configurations.OPTIMISTIC_MODE
        ),
        reason="runs where a configuration can change the optimistic mode",
    ),
]


URL = "/api-view/optimistic"
MIXIN_URL = "/mixin/optimistic"
State = IdempotencyRecord.State

not_in_a_request_transaction = pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view runs in the request's transaction (W002): "
    "the optimistic mode falls back to the default one there",
)


def _statements(captured: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in captured.captured_queries]


optimistic_lock_timeout_view = idempotent(optimistic=True)


@not_in_a_request_transaction
@pytest.mark.parametrize("url", [URL, MIXIN_URL])
def test_first_execution_writes_the_record_once_and_replays(api: APIClient, url: str) -> None:
    with CaptureQueriesContext(connection) as captured:
        first = post(api, url, {"amount": 1}, "k")
    sql = _statements(captured)
    retry = post(api, url, {"amount": 1}, "k")
    mismatch = post(api, url, {"amount": 2}, "k")
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first
    # Never an UPDATE of the record: it is inserted once, finished.
    record_writes = [s for s in sql if "django_idempotency_record" in s and "SELECT" not in s[:7]]
    assert len(record_writes) == 1 and record_writes[0].startswith("INSERT INTO")
    assert retry.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert mismatch.status_code == 422
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert record.state == State.COMPLETED and record.fencing_token == 1
    assert record.lease_expires_at is None and record.lease_owner == ""
    retention = record.expires_at - record.created_at
    assert abs(retention - timedelta(hours=24)) < timedelta(seconds=1)


class _Sent:
    """What a request sent, in order: every round trip, and where each statement ran."""

    def __init__(self, captured: CaptureQueriesContext, in_a_transaction: list[bool]) -> None:
        self.captured = captured
        #: Per statement the wrapper saw (BEGIN and COMMIT are not statements
        #: of a cursor): whether it ran inside an atomic block.
        self.in_a_transaction = in_a_transaction

    @property
    def round_trips(self) -> list[str]:
        """Statements, BEGIN, COMMIT, ROLLBACK and savepoints: each one a round trip."""
        return _statements(self.captured)


@contextmanager
def _sent() -> Iterator[_Sent]:
    in_a_transaction: list[bool] = []

    def note(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not sql.startswith("BEGIN"):  # SQLite's BEGIN IMMEDIATE comes through a cursor
            in_a_transaction.append(connection.in_atomic_block)
        return execute(sql, params, many, context)

    with CaptureQueriesContext(connection) as captured, connection.execute_wrapper(note):
        yield _Sent(captured, in_a_transaction)


def _insert_into(table: str) -> str:
    return f"INSERT INTO {connection.ops.quote_name(table)}"


def _is_the_lookup(sql: str) -> bool:
    return sql.startswith("SELECT") and "django_idempotency_record" in sql


@not_in_a_request_transaction
@pytest.mark.parametrize(
    ("body", "status"), [({"amount": 1}, 201), ({"amount": 2}, 422)], ids=["replay", "mismatch"]
)
@pytest.mark.parametrize("url", [URL, MIXIN_URL])
def test_an_answer_from_the_record_is_one_statement_outside_any_transaction(
    api: APIClient, url: str, body: dict[str, int], status: int
) -> None:
    """A replay (or 422) is the lookup alone, in autocommit: one round trip, no BEGIN, no COMMIT."""
    assert post(api, url, {"amount": 1}, "k").status_code == 201
    with _sent() as sent:
        answer = post(api, url, body, "k")
    assert answer.status_code == status
    assert len(sent.round_trips) == 1, sent.round_trips
    assert _is_the_lookup(sent.round_trips[0]), sent.round_trips
    assert sent.in_a_transaction == [False]


@not_in_a_request_transaction
def test_a_first_execution_is_five_round_trips_its_lookup_before_the_transaction(
    api: APIClient,
) -> None:
    """The lookup in autocommit, then BEGIN, the view's INSERT, the record's INSERT, COMMIT.

    As many round trips as the hand-written one-commit design, on every
    database: no savepoint around the record's INSERT (a lost INSERT rolls
    the whole transaction back anyway).
    """
    with _sent() as sent:
        assert post(api, URL, {"amount": 1}, "k").status_code == 201
    sql = sent.round_trips
    assert len(sql) == 5, sql
    assert _is_the_lookup(sql[0]), sql
    assert sql[1].startswith("BEGIN") and sql[4] == "COMMIT", sql  # SQLite: BEGIN IMMEDIATE
    assert sql[2].startswith(_insert_into("testapp_charge")), sql
    assert sql[3].startswith(_insert_into("django_idempotency_record")), sql
    assert sent.in_a_transaction == [False, True, True]


@not_in_a_request_transaction
@pytest.mark.postgres
def test_on_postgresql_the_records_insert_carries_the_wait_bound(api: APIClient) -> None:
    """The record's INSERT, the one statement of ours that waits on a duplicate, bounds its wait.

    ``lock_timeout`` = ``IN_FLIGHT_WAIT``, set inside the statement before its
    row meets the unique index; the transaction ends right after, so nothing
    of it is left on the connection.
    """
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's statements")
    with _sent() as sent:
        assert post(api, URL, {"amount": 1}, "k").status_code == 201
    record_insert = sent.round_trips[3]
    assert "set_config('lock_timeout', '10000', true)" in record_insert
    assert "set_config" not in sent.round_trips[0]  # the lookup sets nothing
    with connection.cursor() as cursor:  # the timeout was the transaction's only
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "0"


@optimistic_lock_timeout_view
def _show_lock_timeout(request: Any) -> Any:
    """The lock_timeout in force for the view's own statements."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        shown = cursor.fetchone()[0]
    return JsonResponse({"lock_timeout": shown}, status=201)


@not_in_a_request_transaction
@pytest.mark.postgres
@pytest.mark.parametrize("replacing_an_expired_record", [False, True], ids=["new", "expired"])
def test_the_views_own_statements_wait_as_the_connection_says(
    replacing_an_expired_record: bool,
) -> None:
    """No IN_FLIGHT_WAIT on the view's statements: its lock waits are the project's to bound.

    (The lookup used to set the transaction's ``lock_timeout`` before the
    view; it now runs in autocommit, and the bounds are the record's
    INSERT's and the expired record's DELETE's own.)
    """
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's lock_timeout")
    if replacing_an_expired_record:
        assert _call_plain(_show_lock_timeout, {}, "k").status_code == 201
        _expire_every_record()
    response = _call_plain(_show_lock_timeout, {}, "k")
    assert response.status_code == 201 and "Idempotent-Replayed" not in response
    assert json.loads(response.content) == {"lock_timeout": "0"}


@not_in_a_request_transaction
@pytest.mark.parametrize("status", [500, 503, 429])
def test_a_retryable_outcome_rolls_everything_back(api: APIClient, status: int) -> None:
    with signals_sent({"released": signals.claim_released}) as sent:
        assert post(api, URL, {"amount": 1, "status": status}, "k").status_code == status
    released = [kwargs["reason"] for _, kwargs in sent]
    assert released == [status]
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()
    assert post(api, URL, {"amount": 1}, "k").status_code == 201
    assert Charge.objects.count() == 1


@not_in_a_request_transaction
def test_an_exception_rolls_everything_back(api: APIClient) -> None:
    api.raise_request_exception = False
    assert post(api, URL, {"amount": 1, "raise": True}, "k").status_code == 500
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()
    assert post(api, URL, {"amount": 1}, "k").status_code == 201


@not_in_a_request_transaction
def test_a_definitive_refusal_is_stored_and_replayed(api: APIClient) -> None:
    first = post(api, URL, {"amount": 1, "status": 402}, "k")
    again = post(api, URL, {"amount": 1, "status": 402}, "k")
    assert first.status_code == again.status_code == 402
    assert again["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().state == State.FAILED


@not_in_a_request_transaction
def test_a_swallowed_database_error_discards_the_writes_and_stores_nothing(
    api: APIClient,
) -> None:
    """The view caught an IntegrityError without a savepoint and answered 201 anyway."""
    api.raise_request_exception = False
    response = post(api, URL, {"amount": 1, "swallow_integrity_error": True}, "k")
    assert response.status_code == 500  # RolledBackResponse: never a 201 whose writes are gone
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()
    assert post(api, URL, {"amount": 1}, "k").status_code == 201


@not_in_a_request_transaction
def test_begin_external_and_provider_ids_are_refused(api: APIClient) -> None:
    for switch in ("begin_external", "provider_operation"):
        with pytest.raises(ImproperlyConfigured, match="optimistic=True"):
            post(api, URL, {"amount": 1, switch: True}, f"k-{switch}")
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()


@not_in_a_request_transaction
def test_an_expired_record_is_replaced_under_its_own_condition(api: APIClient) -> None:
    assert post(api, URL, {"amount": 1}, "k").status_code == 201
    _expire_every_record()
    expired = IdempotencyRecord.objects.get()
    again = post(api, URL, {"amount": 1}, "k")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 2
    record = IdempotencyRecord.objects.get()
    assert record.state == State.COMPLETED and record.expires_at > expired.expires_at


@not_in_a_request_transaction
def test_an_expired_record_stays_when_the_new_run_rolls_back(api: APIClient) -> None:
    assert post(api, URL, {"amount": 1}, "k").status_code == 201
    _expire_every_record()
    expired = IdempotencyRecord.objects.get()
    assert post(api, URL, {"amount": 1, "status": 503}, "k").status_code == 503
    kept = IdempotencyRecord.objects.get()  # its DELETE rolled back with the view
    assert (kept.pk, kept.expires_at) == (expired.pk, expired.expires_at)


def _expire_every_record() -> None:
    IdempotencyRecord.objects.update(expires_at=F("created_at") - timedelta(days=1))


@not_in_a_request_transaction
def test_a_key_held_by_a_two_commit_claim_is_answered_by_the_general_path(
    api: APIClient,
) -> None:
    # A request of the default mode holds the key (a deploy switching modes,
    # say): the optimistic one neither runs nor waits past the usual 409.
    assert post(api, "/api-view/charges", {"amount": 1, "status": 503}, "k").status_code == 503
    IdempotencyRecord.objects.create(
        tenant="anonymous",
        operation="POST api-view/optimistic",
        key="k",
        fingerprint="x",
        state=State.CLAIMED,
        lease_owner="elsewhere",
        lease_expires_at=timezone.now() + timedelta(hours=1),
        created_at=timezone.now(),
        updated_at=timezone.now(),
        expires_at=timezone.now() + timedelta(days=1),
    )
    response = post(api, URL, {"amount": 1}, "k")
    assert response.status_code in (409, 422)
    assert not Charge.objects.exists()


@not_in_a_request_transaction
@pytest.mark.parametrize("in_flight", ["conflict", "wait"])
def test_a_key_held_by_a_live_two_commit_claim_is_refused_from_the_lookup_alone(
    api: APIClient, in_flight: str
) -> None:
    """409 in one round trip: the general path's claim would only find the same record.

    Except with IN_FLIGHT "wait", which the general path's polling serves.
    """
    now = timezone.now()
    IdempotencyRecord.objects.create(
        tenant="anonymous",
        operation="POST api-view/optimistic",
        key="k",
        fingerprint=_fingerprint_of_amount_one(api),
        state=State.CLAIMED,
        lease_owner="elsewhere",
        lease_expires_at=now + timedelta(hours=1),
        created_at=now,
        updated_at=now,
        expires_at=now + timedelta(days=1),
    )
    wait = timedelta(milliseconds=100)
    with (
        override_settings(IDEMPOTENCY={"IN_FLIGHT": in_flight, "IN_FLIGHT_WAIT": wait}),
        _sent() as sent,
    ):
        response = post(api, URL, {"amount": 1}, "k")
    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"
    if in_flight == "conflict":
        assert len(sent.round_trips) == 1 and _is_the_lookup(sent.round_trips[0]), sent.round_trips
    assert not Charge.objects.exists()


def _fingerprint_of_amount_one(api: APIClient) -> str:
    """The stored fingerprint of ``{"amount": 1}`` posted to URL (a record made, then dropped)."""
    assert post(api, URL, {"amount": 1}, "probe").status_code == 201
    record = IdempotencyRecord.objects.get(key="probe")
    record.delete()
    Charge.objects.all().delete()
    return str(record.fingerprint)


@not_in_a_request_transaction
def test_an_uncertain_verdict_is_released_like_a_retryable_one(api: APIClient) -> None:
    """Nothing outside the database ran, and its writes rolled back: nothing is uncertain.

    (A record claimed to say so could take the key from a duplicate still running.)
    """
    policy = by_status({502: Verdict.UNCERTAIN})
    view = idempotent(optimistic=True, outcome=policy)(_answer_with_status)
    with signals_sent({"released": signals.claim_released}) as sent:
        response = _call_plain(view, {"status": 502}, "k")
    assert response.status_code == 502
    assert [kwargs["reason"] for _, kwargs in sent] == [502]
    assert not IdempotencyRecord.objects.exists()
    assert not Charge.objects.exists()  # the view's writes rolled back
    assert _call_plain(view, {"status": 201}, "k").status_code == 201


def _answer_with_status(request: Any) -> Any:
    data = json.loads(request.body)
    Charge.objects.create(tenant="plain", amount=1)
    return JsonResponse({"status": data["status"]}, status=data["status"])


def _call_plain(view: Callable[..., Any], data: dict[str, Any], key: str) -> Any:
    request = RequestFactory().post(
        "/plain/optimistic",
        data=json.dumps(data),
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    return view(request)


# -- losers: concurrent duplicates, each on its own connection ------------------------


def _concurrently(requests: list[dict[str, Any]], key: str, url: str = URL) -> list[Any]:
    """POST each body at once from its own thread (and database connection)."""
    responses: list[Any] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def send(index: int) -> None:
        try:
            client = APIClient()
            client.raise_request_exception = False
            barrier.wait()
            responses[index] = post(client, url, requests[index], key)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return responses


def _one_winner_the_rest_replay(responses: list[Any]) -> None:
    statuses = sorted(response.status_code for response in responses)
    assert statuses == [201] * len(responses), [(r.status_code, r.content) for r in responses]
    firsts = [r for r in responses if "Idempotent-Replayed" not in r]
    assert len(firsts) == 1
    assert all(r.content == firsts[0].content for r in responses)
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


@not_in_a_request_transaction
def test_losers_at_the_records_insert_replay_the_winner() -> None:
    """No business key: every duplicate runs the view; the unique index picks one."""
    responses = _concurrently([{"amount": 1, "hold": 0.3}] * 4, "race")
    _one_winner_the_rest_replay(responses)


@not_in_a_request_transaction
def test_losers_on_a_business_unique_key_replay_the_winner() -> None:
    """The duplicates fail in the view body, on the order's number: never a 500."""
    responses = _concurrently([{"amount": 1, "order": "A-1", "hold": 0.3}] * 4, "race")
    _one_winner_the_rest_replay(responses)
    assert Order.objects.count() == 1


@not_in_a_request_transaction
def test_losers_that_swallowed_the_conflict_replay_the_winner() -> None:
    """The view made its own 409 "order exists" of the collision: the winner answers instead."""
    body = {"amount": 1, "order": "A-1", "hold": 0.3, "swallow_order_conflict": True}
    responses = _concurrently([body] * 4, "race")
    _one_winner_the_rest_replay(responses)


@not_in_a_request_transaction
def test_a_loser_with_other_input_gets_422() -> None:
    responses = _concurrently(
        [{"amount": 1, "order": "A-1", "hold": 0.5}, {"amount": 2, "order": "A-1", "hold": 0.5}],
        "race",
    )
    assert sorted(r.status_code for r in responses) == [201, 422]
    assert Charge.objects.count() == 1


@not_in_a_request_transaction
def test_a_loser_waiting_on_the_winners_business_row_replays_it_past_in_flight_wait() -> None:
    """The view's own lock waits are not cut at IN_FLIGHT_WAIT: the loser waits, then replays.

    (Until the lookup moved out of the view's transaction, its
    transaction-local lock_timeout cut this wait at IN_FLIGHT_WAIT: 409.)
    """
    with override_settings(IDEMPOTENCY={"IN_FLIGHT_WAIT": timedelta(milliseconds=200)}):
        responses = _concurrently([{"amount": 1, "order": "A-1", "hold": 1.0}] * 2, "race")
    _one_winner_the_rest_replay(responses)
    assert Order.objects.count() == 1


@not_in_a_request_transaction
@pytest.mark.postgres
def test_the_records_insert_waits_at_most_in_flight_wait_on_an_uncommitted_record(
    api: APIClient,
) -> None:
    """A duplicate inserted its record and went silent before COMMIT (a worker cut off).

    The lookup, in autocommit, does not see it; the view runs; the record's
    INSERT waits on the unique index for at most IN_FLIGHT_WAIT, then 409
    with Retry-After, its writes rolled back; the retry runs once the
    holder is gone.
    """
    if connection.vendor != "postgresql":
        pytest.skip("a statement-local lock_timeout is PostgreSQL's")
    api.raise_request_exception = False
    with override_settings(IDEMPOTENCY={"IN_FLIGHT_WAIT": timedelta(milliseconds=300)}):
        with key_held_by_an_open_transaction("POST api-view/optimistic"):
            refused = _in_a_thread(lambda: post(api, URL, {"amount": 1}, "k"))
        assert refused.status_code == 409, refused.content
        assert refused.json()["code"] == "idempotency_request_in_progress"
        assert refused["Retry-After"]
        assert not Charge.objects.exists() and not IdempotencyRecord.objects.exists()
        assert post(api, URL, {"amount": 1}, "k").status_code == 201
    assert Charge.objects.count() == 1


@not_in_a_request_transaction
@pytest.mark.postgres
def test_replacing_an_expired_record_waits_at_most_in_flight_wait_on_its_uncommitted_delete(
    api: APIClient,
) -> None:
    """Another session deleted the expired record (a duplicate replacing it) and went silent."""
    if connection.vendor != "postgresql":
        pytest.skip("a statement-local lock_timeout is PostgreSQL's")
    api.raise_request_exception = False
    assert post(api, URL, {"amount": 1}, "k").status_code == 201
    _expire_every_record()
    expired = IdempotencyRecord.objects.get()
    with override_settings(IDEMPOTENCY={"IN_FLIGHT_WAIT": timedelta(milliseconds=300)}):
        with _deleted_by_an_open_transaction(expired.pk):
            refused = _in_a_thread(lambda: post(api, URL, {"amount": 1}, "k"))
        assert refused.status_code == 409, refused.content
        assert refused.json()["code"] == "idempotency_request_in_progress"
        assert Charge.objects.count() == 1  # the first run's only
        assert IdempotencyRecord.objects.get().pk == expired.pk
        again = post(api, URL, {"amount": 1}, "k")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert Charge.objects.count() == 2


@contextmanager
def _deleted_by_an_open_transaction(record_id: int) -> Iterator[None]:
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("DELETE FROM django_idempotency_record WHERE id = %s", [record_id])
        yield
    finally:
        other.rollback()
        other.close()


def _in_a_thread(call: Callable[[], Any]) -> Any:
    """``call()`` on a thread of its own (its own connection), waited for: a hang fails."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the request waited without bound"
    return outcome[0]


@not_in_a_request_transaction
def test_an_unrelated_business_conflict_is_the_views_own_error(api: APIClient) -> None:
    """Another key's order with the same number: no record answers, so the view's error stands."""
    api.raise_request_exception = False
    assert post(api, URL, {"amount": 1, "order": "A-1"}, "first").status_code == 201
    response = post(api, URL, {"amount": 1, "order": "A-1"}, "second")
    assert response.status_code == 500  # the IntegrityError, as without protection
    assert IdempotencyRecord.objects.count() == 1


@pytest.mark.postgres
@pytest.mark.usefixtures("unreachable_store")
def test_the_store_unreachable_at_the_lookup_is_503(api: APIClient) -> None:
    response = post(api, URL, {"amount": 1}, "k")
    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert not Charge.objects.exists()


@pytest.mark.urls("tests.testapp.optimistic_check_urls")
def test_e036_names_optimistic_views_that_call_out() -> None:
    from django_idempotency.checks import check_optimistic_views

    messages = check_optimistic_views()
    assert {message.id for message in messages} == {"django_idempotency.E036"}
    named = sorted(message.msg.split(" at ")[0] for message in messages)
    assert named == [
        "The view tests.testapp.optimistic_check_urls.RecordsTheProvidersId (post)",
        "The view tests.testapp.optimistic_check_urls.charges_the_provider (post)",
    ]
    assert "set_provider_operation" in " ".join(message.msg for message in messages)


def test_e036_is_quiet_for_the_test_projects_views() -> None:
    from django_idempotency.checks import check_optimistic_views

    assert check_optimistic_views() == []
