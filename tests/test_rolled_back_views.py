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


def _losing_after_the_first(claim: Callable[..., Any]) -> Callable[..., Any]:
    calls = iter(range(1_000))

    def claim_once(*args: Any, **kwargs: Any) -> Any:
        return claim(*args, **kwargs) if next(calls) == 0 else None

    return claim_once
