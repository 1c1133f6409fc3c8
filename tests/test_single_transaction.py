"""single_transaction=True: claim, view and completion in one PostgreSQL transaction."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres, pytest.mark.guarantees]
URL = "/api-view/single"
State = IdempotencyRecord.State


@pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view runs in the request's transaction (W002): "
    "single_transaction has no effect there",
)
def test_first_execution_commits_once_and_replays(api: APIClient) -> None:
    with CaptureQueriesContext(connection) as captured:
        first = post(api, URL, {"amount": 1}, "k")
    # Read now: the next request clears the connection's query log.
    sql = [query["sql"] for query in captured.captured_queries]
    retry = post(api, URL, {"amount": 1}, "k")
    mismatch = post(api, URL, {"amount": 2}, "k")
    assert first.status_code == 201
    assert sum(s == "COMMIT" for s in sql) == 1  # one transaction, not two
    # The wait is bounded within the claim's own statement, for this transaction only.
    assert sql[1].startswith('INSERT INTO "django_idempotency_record"')
    assert "set_config('lock_timeout', '10000', true)" in sql[1]
    with connection.cursor() as cursor:
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "0"
    assert retry.content == first.content and retry["Idempotent-Replayed"] == "true"
    assert mismatch.status_code == 422
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


@pytest.mark.parametrize("status", [500, 503, 429])
def test_a_retryable_outcome_rolls_the_claim_back_with_the_view(
    api: APIClient, status: int
) -> None:
    assert post(api, URL, {"amount": 1, "status": status}, "k").status_code == status
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()
    assert post(api, URL, {"amount": 1}, "k").status_code == 201


def test_an_exception_rolls_the_claim_back(api: APIClient) -> None:
    api.raise_request_exception = False
    assert post(api, URL, {"amount": 1, "raise": True}, "k").status_code == 500
    assert not IdempotencyRecord.objects.exists() and not Charge.objects.exists()


@pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view runs in the request's transaction (W002): "
    "single_transaction has no effect there",
)
def test_begin_external_is_refused_in_a_single_transaction(api: APIClient) -> None:
    api.raise_request_exception = False
    assert post(api, URL, {"amount": 1, "begin_external": True}, "k").status_code == 500
    assert not IdempotencyRecord.objects.exists()


def _concurrently(count: int, body: dict[str, Any], key: str) -> list[Any]:
    barrier = threading.Barrier(count)
    results: list[Any] = []

    def send() -> None:
        try:
            barrier.wait()
            results.append(post(APIClient(), URL, body, key))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_duplicates_wait_on_the_unique_index_and_replay(settings: Any) -> None:
    settings.IDEMPOTENCY = {"IN_FLIGHT_WAIT": 10}
    results = _concurrently(6, {"amount": 1, "sleep": 0.4}, "k")

    assert Charge.objects.count() == 1
    assert sorted(r.status_code for r in results) == [201] * 6
    assert sum(r.get("Idempotent-Replayed") == "true" for r in results) == 5
    assert len({r.content for r in results}) == 1


@pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view runs in the request's transaction (W002): "
    "single_transaction has no effect there",
)
def test_a_duplicate_that_waits_too_long_gets_409(settings: Any) -> None:
    settings.IDEMPOTENCY = {"IN_FLIGHT_WAIT": 0.2}
    started = time.monotonic()
    results = _concurrently(2, {"amount": 1, "sleep": 1.0}, "k")

    statuses = sorted(r.status_code for r in results)
    assert statuses == [201, 409]
    refused = next(r for r in results if r.status_code == 409)
    assert refused.json()["code"] == "idempotency_request_in_progress"
    assert time.monotonic() - started < 5
    assert Charge.objects.count() == 1
