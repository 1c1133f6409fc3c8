"""Transactions: the claim commits first; the view's writes and the outcome commit together."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.db.models import F
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.exceptions import DurableTransactionInView
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.guarantees]
State = IdempotencyRecord.State


@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "ATOMIC_REQUESTS"])
def test_claim_is_committed_before_the_view_runs_in_a_transaction(
    api: APIClient, request: pytest.FixtureRequest, atomic: bool
) -> None:
    if atomic:
        request.getfixturevalue("atomic_requests")

    body = post(api, "/probe", {"amount": 1}, "k").json()

    assert body == {"in_atomic_block": True, "committed_claims": 1}


def test_unprotected_handlers_keep_atomic_requests(api: APIClient, atomic_requests: None) -> None:
    body = api.put("/probe", {"amount": 1}, format="json").json()
    assert body == {"in_atomic_block": True, "committed_claims": 0}


@pytest.mark.not_under(
    "atomic-requests",
    reason="checks autocommit without ATOMIC_REQUESTS, which the configuration turns on",
)
def test_unprotected_handlers_stay_in_autocommit_without_atomic_requests(api: APIClient) -> None:
    assert api.put("/probe", {"amount": 1}, format="json").json()["in_atomic_block"] is False


@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "ATOMIC_REQUESTS"])
def test_a_released_claim_rolls_back_the_views_writes(
    api: APIClient, request: pytest.FixtureRequest, atomic: bool
) -> None:
    if atomic:
        request.getfixturevalue("atomic_requests")

    assert post(api, "/probe", {"amount": 1, "status": 503}, "k").status_code == 503

    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


@pytest.fixture
def taken_over_after_claim() -> Iterator[None]:
    """Another owner takes the record over right after this request claims it."""

    def take_over(sender: Any, scope: Any, **kwargs: Any) -> None:
        IdempotencyRecord.objects.filter(key=scope.key).update(
            fencing_token=F("fencing_token") + 1, state=State.UNCERTAIN
        )

    signals.request_claimed.connect(take_over)
    yield
    signals.request_claimed.disconnect(take_over)


@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "ATOMIC_REQUESTS"])
def test_a_stale_owner_changes_nothing(
    api: APIClient,
    taken_over_after_claim: None,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
    atomic: bool,
) -> None:
    if atomic:
        request.getfixturevalue("atomic_requests")

    response = post(api, "/cbv/charges", {"amount": 1}, "k")

    assert response.status_code == 409
    # The completion found the fencing token moved on, so the view's own
    # writes rolled back with it: both or neither.
    assert Charge.objects.count() == 0
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.fencing_token, record.response_status) == (
        State.UNCERTAIN,
        2,
        None,
    )
    assert "Stale owner" in caplog.text


def test_inside_a_callers_transaction_the_claim_joins_it(api: APIClient) -> None:
    """As in a TestCase: everything commits, or rolls back, with the caller."""
    with transaction.atomic():
        first = post(api, "/api-view/charges", {"amount": 1}, "k")
        retry = post(api, "/api-view/charges", {"amount": 1}, "k")
        assert retry.content == first.content
        assert retry["Idempotent-Replayed"] == "true"
        transaction.set_rollback(True)
    assert IdempotencyRecord.objects.count() == Charge.objects.count() == 0


def test_inside_a_callers_transaction_a_failure_releases_only_its_own_work(
    api: APIClient,
) -> None:
    with transaction.atomic():
        Charge.objects.create(tenant="caller", amount=0)
        assert post(api, "/api-view/charges", {"amount": 1, "status": 500}, "k").status_code == 500
    assert list(Charge.objects.values_list("tenant", flat=True)) == ["caller"]
    assert IdempotencyRecord.objects.count() == 0


def _in_thread(target: Any, delay: float) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        try:
            target()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.not_under(
    "encryption",
    reason="replaces IDEMPOTENCY wholesale, dropping the keys that sealed the stored body",
)
@pytest.mark.not_under(
    "atomic-requests",
    reason="one SQLite writer: the waiting @api_view's request transaction (W002)",
    databases=("sqlite",),
)
def test_wait_mode_replays_once_the_first_request_finishes(api: APIClient, settings: Any) -> None:
    first = post(api, "/api-view/charges", {"amount": 1}, "k")
    IdempotencyRecord.objects.update(state=State.CLAIMED)
    settings.IDEMPOTENCY = {"IN_FLIGHT": "wait", "IN_FLIGHT_WAIT": 5}

    finisher = _in_thread(
        lambda: IdempotencyRecord.objects.update(state=State.COMPLETED), delay=0.3
    )
    started = time.monotonic()
    retry = post(api, "/api-view/charges", {"amount": 1}, "k")
    finisher.join()

    assert time.monotonic() - started >= 0.3
    assert retry.status_code == 201
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"


def test_wait_mode_is_bounded(api: APIClient, settings: Any) -> None:
    post(api, "/api-view/charges", {"amount": 1}, "k")
    IdempotencyRecord.objects.update(state=State.CLAIMED)
    settings.IDEMPOTENCY = {"IN_FLIGHT": "wait", "IN_FLIGHT_WAIT": 0.3}

    started = time.monotonic()
    response = post(api, "/api-view/charges", {"amount": 1}, "k")

    assert 0.3 <= time.monotonic() - started < 3
    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"


@pytest.mark.not_under(
    "atomic-requests",
    reason="the waiting @api_view's request transaction (W002) holds the lock its failed "
    "INSERT took: SQLite's one writer, InnoDB's shared lock on the duplicate",
    databases=("sqlite", "mariadb"),
)
def test_wait_mode_runs_the_view_when_the_first_request_is_released(
    api: APIClient, settings: Any
) -> None:
    post(api, "/api-view/charges", {"amount": 1}, "k")
    IdempotencyRecord.objects.update(state=State.CLAIMED)
    Charge.objects.all().delete()
    settings.IDEMPOTENCY = {"IN_FLIGHT": "wait", "IN_FLIGHT_WAIT": 5}

    releaser = _in_thread(lambda: IdempotencyRecord.objects.all().delete(), delay=0.3)
    retry = post(api, "/api-view/charges", {"amount": 1}, "k")
    releaser.join()

    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1


def test_api_view_under_atomic_requests_claims_inside_the_request_transaction(
    api: APIClient, atomic_requests: None
) -> None:
    """Django gives @api_view no hook to exempt it; the claim joins the transaction."""
    first = post(api, "/api-view/probe", {"amount": 1}, "k")
    retry = post(api, "/api-view/probe", {"amount": 1}, "k")

    assert first.json() == {"in_atomic_block": True, "committed_claims": 0}
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_api_view_exempted_as_documented_commits_its_claim_first(
    api: APIClient, atomic_requests: None
) -> None:
    body = post(api, "/api-view/probe-exempt", {"amount": 1}, "k").json()
    assert body == {"in_atomic_block": True, "committed_claims": 1}


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/api-view/charges", {"amount": 1, "forbidden": True}),
        ("/cbv/charges", {"amount": 1, "forbidden": True}),
        ("/viewset/charges/999/refund/", {}),
    ],
)
def test_under_atomic_requests_a_raised_drf_error_is_still_a_stored_failure(
    api: APIClient, atomic_requests: None, url: str, body: dict[str, object]
) -> None:
    """DRF's handler marks the request transaction for rollback; the outcome survives it."""
    first = post(api, url, body, "k")
    retry = post(api, url, body, "k")

    assert first.status_code in (403, 404)
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().state == State.FAILED


def test_another_runtime_error_of_a_protected_view_is_raised_as_it_was(api: APIClient) -> None:
    """Only a refused durable block is renamed: the view's own error keeps its cause."""
    with pytest.raises(RuntimeError, match="the view's own failure") as raised:
        api.patch("/cbv/durable", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="k")

    assert type(raised.value) is RuntimeError
    assert isinstance(raised.value.__cause__, ValueError)
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("method", ["post", "put"], ids=["default", "optimistic"])
def test_a_durable_block_in_a_protected_view_is_refused_naming_the_view_and_the_fix(
    api: APIClient, method: str
) -> None:
    """Django's bare RuntimeError named neither; and the claim is released each time."""
    for _ in range(2):  # the retry is refused the same way: nothing was kept
        with pytest.raises(DurableTransactionInView) as refused:
            send = getattr(api, method)
            send("/cbv/durable", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="k")

        message = str(refused.value)
        assert f"tests.testapp.views.DurableBlockView.{method}" in message
        assert "durable=True" in message and "database 'default'" in message
        assert "docs/transactions.md" in message
        assert isinstance(refused.value.__cause__, RuntimeError)
        assert not IdempotencyRecord.objects.exists()
        assert not Charge.objects.exists()
