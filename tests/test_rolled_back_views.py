"""A response whose transaction was rolled back is never stored as a success.

A view that catches an IntegrityError without a savepoint leaves its
transaction marked for rollback: its writes are discarded. Storing its 2xx
would replay, for a day, a success that never happened; instead it answers
500 and the claim is released, so the retry runs. A definitive 4xx from a
rolled-back transaction (DRF's handler marks it under ATOMIC_REQUESTS) is
still stored, and the signals report only what was stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.exceptions import RolledBackResponse
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import post, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
SWALLOWED = {"amount": 1, "swallow_integrity_error": True}
STORED_OR_RELEASED = {"stored": signals.response_stored, "released": signals.claim_released}


def test_a_success_whose_writes_were_rolled_back_is_a_500_and_not_stored(api: APIClient) -> None:
    api.raise_request_exception = False
    with signals_sent(STORED_OR_RELEASED) as sent:
        first = post(api, "/api-view/charges", SWALLOWED, "k")

    assert first.status_code == 500
    assert not Charge.objects.exists()
    assert not IdempotencyRecord.objects.exists()  # released: the retry runs
    assert [name for name, _ in sent] == ["released"]
    retry = post(api, "/api-view/charges", {"amount": 1}, "k")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1


def test_the_500_says_what_the_view_did_wrong(api: APIClient) -> None:
    with pytest.raises(RolledBackResponse, match=r"transaction\.atomic\(\)"):
        post(api, "/api-view/charges", SWALLOWED, "k")


@pytest.mark.postgres
def test_single_transaction_a_rolled_back_success_is_a_500_and_the_retry_runs(
    api: APIClient,
) -> None:
    api.raise_request_exception = False
    first = post(api, "/api-view/single", SWALLOWED, "k")
    retry = post(api, "/api-view/single", {"amount": 1}, "k")

    assert first.status_code == 500
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1


@pytest.mark.postgres
def test_single_transaction_under_atomic_requests_a_drf_4xx_is_stored_and_signalled_once(
    api: APIClient, atomic_requests: None
) -> None:
    body = {"amount": 1, "forbidden": True}
    with signals_sent(STORED_OR_RELEASED) as sent:
        first = post(api, "/cbv/single", body, "k")
    retry = post(api, "/cbv/single", body, "k")

    assert first.status_code == 403
    assert IdempotencyRecord.objects.get().state == State.FAILED
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert [(name, kwargs["state"]) for name, kwargs in sent] == [("stored", "FAILED")]


@pytest.mark.postgres
def test_single_transaction_a_rolled_back_4xx_whose_key_was_taken_meanwhile_is_not_signalled(
    api: APIClient, atomic_requests: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signals report only what was stored: here the fresh claim loses."""
    from django_idempotency import _store as store

    monkeypatch.setattr(store, "claim", _losing_after_the_first(store.claim))
    with signals_sent(STORED_OR_RELEASED) as sent:
        first = post(api, "/cbv/single", {"amount": 1, "forbidden": True}, "k")

    assert first.status_code == 403
    assert [name for name, _ in sent] == ["released"]


def _losing_after_the_first(claim: Callable[..., Any]) -> Callable[..., Any]:
    calls = iter(range(1_000))

    def claim_once(*args: Any, **kwargs: Any) -> Any:
        return claim(*args, **kwargs) if next(calls) == 0 else None

    return claim_once
