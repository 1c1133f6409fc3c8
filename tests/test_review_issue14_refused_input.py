"""Review of issue 14: the refused-input rule on every kind of protected DRF view.

A ValidationError (a serializer's, or one the view raises) is not stored:
the corrected body runs under the same key. Checked on the two-commit path,
for every way of protecting a view.
"""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)

# (url, an invalid body, a valid body)
CASES = [
    ("/api-view/charges", {"amount": 1, "invalid": True}, {"amount": 1}),
    ("/cbv/charges", {"amount": 1, "invalid": True}, {"amount": 1}),
    ("/generic/charges", {"amount": "many"}, {"amount": 1}),
    ("/viewset/charges/", {"amount": "many"}, {"amount": 1}),
    ("/mixin/charges", {"amount": "many"}, {"amount": 1}),
]


@pytest.mark.parametrize(("url", "invalid", "valid"), CASES)
def test_refused_input_is_released_and_the_corrected_body_runs(
    api: APIClient, url: str, invalid: dict[str, object], valid: dict[str, object]
) -> None:
    first = post(api, url, invalid, "k-1")
    corrected = post(api, url, valid, "k-1")

    assert first.status_code == 400, first.content
    assert corrected.status_code == 201, corrected.content
    assert "Idempotent-Replayed" not in corrected
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.COMPLETED


def test_a_malformed_json_body_is_released(api: APIClient) -> None:
    """DRF's ParseError, raised when the view reads request.data."""
    first = api.post(
        "/api-view/charges",
        b"{not json",
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="k-2",
    )
    corrected = post(api, "/api-view/charges", {"amount": 1}, "k-2")

    assert first.status_code == 400, first.content
    assert corrected.status_code == 201, corrected.content
