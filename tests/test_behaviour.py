"""Every row of the SPEC's HTTP behaviour table, through a DRF @api_view."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests import configurations
from tests.testapp.models import Charge
from tests.testapp.views import ViewFailure
from tests.utils import post, raw_body

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.guarantees]

URL = "/api-view/charges"
State = IdempotencyRecord.State


@pytest.fixture(autouse=True, params=["default", "optimistic"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every row of the table, in the default mode and in the optimistic one."""
    if request.param == "optimistic":
        if configurations.active() not in configurations.OPTIMISTIC_MODE:
            pytest.skip("the optimistic mode's table runs where a configuration can change it")
        monkeypatch.setattr(sys.modules[__name__], "URL", "/api-view/optimistic")
    return str(request.param)


@pytest.mark.not_under(
    "encryption", reason="reads the stored body raw; ENCRYPTION_KEYS seals it at rest"
)
def test_first_execution_runs_the_view_and_echoes_the_key(api: APIClient) -> None:
    response = post(api, URL, {"amount": 100}, "order-1")

    assert response.status_code == 201
    assert response["Idempotency-Key"] == "order-1"
    assert "Idempotent-Replayed" not in response
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.key, record.state, record.response_status) == ("order-1", State.COMPLETED, 201)
    assert raw_body(record) == response.content


def test_replay_is_the_original_answer(api: APIClient) -> None:
    first = post(api, URL, {"amount": 100}, "order-1")
    retry = post(api, URL, {"amount": 100}, "order-1")

    assert Charge.objects.count() == 1
    assert retry.status_code == first.status_code == 201
    assert retry.content == first.content
    assert retry["Content-Type"] == first["Content-Type"]
    assert retry["Location"] == first["Location"]
    assert retry["Idempotent-Replayed"] == "true"
    assert retry["Idempotency-Key"] == "order-1"


def test_replay_carries_only_the_headers_configured_to_be_stored(
    api: APIClient, settings: object
) -> None:
    post(api, URL, {"amount": 1}, "plain")
    assert "ETag" not in post(api, URL, {"amount": 1}, "plain")

    settings.IDEMPOTENCY = {"STORED_HEADERS": ["ETag"]}  # type: ignore[attr-defined]
    first = post(api, URL, {"amount": 2}, "with-etag")
    assert post(api, URL, {"amount": 2}, "with-etag")["ETag"] == first["ETag"]


@pytest.mark.parametrize(
    "changed",
    [
        {"amount": 101},
        {"amount": 100, "note": "extra field"},
        {"amount": "100"},
        {"amount": 100, "meta": {"card": {"last4": "4243"}}},
    ],
)
def test_same_key_with_different_input_is_refused_with_422(
    api: APIClient, changed: dict[str, object]
) -> None:
    post(api, URL, {"amount": 100, "meta": {"card": {"last4": "4242"}}}, "order-1")
    record_before = IdempotencyRecord.objects.values().get()

    response = post(api, URL, changed, "order-1")

    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.values().get() == record_before


def test_query_parameters_are_part_of_the_input(api: APIClient) -> None:
    post(api, URL + "?currency=EUR", {"amount": 100}, "order-1")
    assert post(api, URL + "?currency=USD", {"amount": 100}, "order-1").status_code == 422
    assert post(api, URL + "?currency=EUR", {"amount": 100}, "order-1").status_code == 201


@pytest.mark.parametrize("state", [State.CLAIMED, State.IN_PROGRESS])
def test_same_key_while_the_first_is_running_gets_409(api: APIClient, state: str) -> None:
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(state=state)

    response = post(api, URL, {"amount": 100}, "order-1")

    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"
    assert int(response["Retry-After"]) >= 1
    assert Charge.objects.count() == 1


@pytest.mark.parametrize(
    ("lease_left", "retry_after"),
    [
        # Postponed by recovery (a provider outage): come back when it looks again.
        (timedelta(minutes=5), range(295, 301)),
        # Due now (its lease ended when it became UNCERTAIN): a few seconds, not 1.
        (timedelta(minutes=-3), range(5, 6)),
        # A reconciler's Retry(after=2 days): no longer than an hour.
        (timedelta(days=2), range(3600, 3601)),
    ],
)
def test_same_key_while_the_outcome_is_uncertain_gets_503_until_recovery_looks_again(
    api: APIClient, lease_left: timedelta, retry_after: range
) -> None:
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(
        state=State.UNCERTAIN, lease_owner="", lease_expires_at=timezone.now() + lease_left
    )

    response = post(api, URL, {"amount": 100}, "order-1")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_outcome_uncertain"
    assert int(response["Retry-After"]) in retry_after
    assert Charge.objects.count() == 1


def test_an_uncertain_outcome_is_answered_at_once_in_the_wait_mode(
    api: APIClient, settings: object
) -> None:
    """IN_FLIGHT="wait" waits for a request to finish; nothing runs an UNCERTAIN record."""
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(
        state=State.UNCERTAIN, lease_owner="", lease_expires_at=timezone.now()
    )
    settings.IDEMPOTENCY = {"IN_FLIGHT": "wait", "IN_FLIGHT_WAIT": 5}  # type: ignore[attr-defined]

    started = time.monotonic()
    response = post(api, URL, {"amount": 100}, "order-1")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_outcome_uncertain"
    assert time.monotonic() - started < 2


def test_different_input_while_running_is_a_mismatch_not_a_conflict(api: APIClient) -> None:
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(state=State.CLAIMED)
    assert post(api, URL, {"amount": 999}, "order-1").status_code == 422


def test_missing_key_is_refused_where_required(api: APIClient) -> None:
    response = post(api, URL, {"amount": 100}, None)

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert Charge.objects.count() == 0


def test_missing_key_runs_unprotected_where_optional(api: APIClient) -> None:
    post(api, "/api-view/optional", {"amount": 1}, None)
    post(api, "/api-view/optional", {"amount": 1}, None)

    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 0


def test_required_setting_false_makes_keys_optional(api: APIClient, settings: object) -> None:
    settings.IDEMPOTENCY = {"REQUIRED": False}  # type: ignore[attr-defined]
    assert post(api, URL, {"amount": 1}, None).status_code == 201


@pytest.mark.parametrize(
    "header",
    [
        "",
        "   ",
        "x" * 256,
        "clé",
        "two words",
        "tab\there",
        "bell\x07",
        '"unterminated',
        '"a b"',
        "?k"[:0],
    ],
)
def test_invalid_key_is_refused_with_400(api: APIClient, header: str) -> None:
    response = post(api, URL, {"amount": 100}, header)

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_invalid"
    assert Charge.objects.count() == IdempotencyRecord.objects.count() == 0


def test_key_of_the_maximum_length_is_accepted(api: APIClient) -> None:
    assert post(api, URL, {"amount": 1}, "k" * 255).status_code == 201


def test_key_max_length_setting_is_applied(api: APIClient, settings: object) -> None:
    settings.IDEMPOTENCY = {"KEY_MAX_LENGTH": 36}  # type: ignore[attr-defined]
    assert post(api, URL, {"amount": 1}, "k" * 37).status_code == 400
    assert post(api, URL, {"amount": 1}, "k" * 36).status_code == 201


def test_quoted_key_is_unquoted_and_names_the_same_record(api: APIClient) -> None:
    first = post(api, URL, {"amount": 1}, '"order-1"')
    retry = post(api, URL, {"amount": 1}, "order-1")

    assert IdempotencyRecord.objects.get().key == "order-1"
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content


def test_view_raising_releases_the_claim_and_the_retry_runs(api: APIClient) -> None:
    with pytest.raises(ViewFailure):
        post(api, URL, {"amount": 100, "raise": True}, "order-1")
    assert IdempotencyRecord.objects.count() == 0
    assert Charge.objects.count() == 0  # the view's write rolled back with it

    api.raise_request_exception = False
    assert post(api, URL, {"amount": 100, "raise": True}, "order-1").status_code == 500
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408, 409, 423, 425, 429])
def test_retryable_status_releases_the_claim_and_rolls_back(api: APIClient, status: int) -> None:
    response = post(api, URL, {"amount": 100, "status": status}, "order-1")

    assert response.status_code == status
    assert "Idempotent-Replayed" not in response
    assert IdempotencyRecord.objects.count() == 0
    assert Charge.objects.count() == 0

    retry = post(api, URL, {"amount": 100, "status": status}, "order-1")
    assert retry.status_code == status
    assert "Idempotent-Replayed" not in retry


@pytest.mark.parametrize("status", [408, 409, 423, 425, 429, 503])
def test_a_retryable_status_raised_as_a_drf_exception_releases_the_claim(
    api: APIClient, status: int
) -> None:
    """As the same status returned does: 423 Locked too ("try again later")."""
    first = post(api, URL, {"amount": 100, "raise_status": status}, "order-1")
    retry = post(api, URL, {"amount": 100, "raise_status": status}, "order-1")

    assert first.status_code == retry.status_code == status
    assert "Idempotent-Replayed" not in retry
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 422])
def test_other_4xx_is_stored_as_failed_and_replayed(api: APIClient, status: int) -> None:
    first = post(api, URL, {"amount": 100, "status": status}, "order-1")
    retry = post(api, URL, {"amount": 100, "status": status}, "order-1")

    assert first.status_code == retry.status_code == status
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().state == State.FAILED
    # A definitive answer commits with the view's writes, like a success.
    assert Charge.objects.count() == 1


def test_validation_error_raised_by_a_drf_view_is_not_stored(api: APIClient) -> None:
    """Refused input is not an outcome: the corrected body runs under the same key."""
    first = post(api, URL, {"amount": 100, "invalid": True}, "order-1")
    retry = post(api, URL, {"amount": 100, "invalid": True}, "order-1")
    corrected = post(api, URL, {"amount": 100}, "order-1")

    assert first.status_code == retry.status_code == 400
    assert first.json() == {"amount": ["This amount is not accepted."]}
    assert "Idempotent-Replayed" not in retry
    assert first["Idempotency-Key"] == "order-1"
    assert corrected.status_code == 201
    assert "Idempotent-Replayed" not in corrected
    assert IdempotencyRecord.objects.get().state == State.COMPLETED
    assert Charge.objects.count() == 1


def test_a_drf_error_other_than_refused_input_is_a_stored_failure(api: APIClient) -> None:
    first = post(api, URL, {"amount": 100, "forbidden": True}, "order-1")
    retry = post(api, URL, {"amount": 100, "forbidden": True}, "order-1")

    assert first.status_code == 403
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().state == State.FAILED


@pytest.mark.parametrize(
    ("method", "url"),
    [("get", URL), ("options", URL), ("get", "/mixin/charges"), ("head", "/mixin/charges")],
)
def test_safe_methods_are_never_protected(api: APIClient, method: str, url: str) -> None:
    response = getattr(api, method)(url, HTTP_IDEMPOTENCY_KEY="order-1")

    assert response.status_code == 200
    assert "Idempotency-Key" not in response
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.not_under(
    "encryption", reason="reads the stored body raw; ENCRYPTION_KEYS seals it at rest"
)
def test_key_reused_after_expiry_is_a_new_operation(api: APIClient) -> None:
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

    response = post(api, URL, {"amount": 250}, "order-1")

    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert Charge.objects.count() == 2
    record = IdempotencyRecord.objects.get()
    assert json.loads(raw_body(record))["amount"] == 250


def test_completed_record_is_replayed_until_it_expires(api: APIClient) -> None:
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(expires_at=timezone.now() + timedelta(seconds=30))
    assert post(api, URL, {"amount": 100}, "order-1")["Idempotent-Replayed"] == "true"


def test_unresolved_record_past_expiry_is_never_replaced(api: APIClient) -> None:
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(
        state=State.UNCERTAIN, expires_at=timezone.now() - timedelta(days=1)
    )
    assert post(api, URL, {"amount": 100}, "order-1").status_code == 503
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN


def test_retention_counts_from_the_outcome(api: APIClient, settings: object) -> None:
    settings.IDEMPOTENCY = {"TTL": 600}  # type: ignore[attr-defined]
    before = timezone.now()
    post(api, URL, {"amount": 1}, "order-1")
    record = IdempotencyRecord.objects.get()
    assert before + timedelta(seconds=600) <= record.expires_at
    assert record.expires_at <= timezone.now() + timedelta(seconds=600)
    assert record.lease_expires_at is None and record.lease_owner == ""


def test_per_view_ttl_overrides_the_setting(api: APIClient) -> None:
    post(api, "/api-view/fields", {"amount": 1}, "order-1")
    record = IdempotencyRecord.objects.get()
    assert record.expires_at <= timezone.now() + timedelta(seconds=60)


def test_oversized_body_completes_without_storing_the_body(
    api: APIClient, settings: object, caplog: pytest.LogCaptureFixture
) -> None:
    settings.IDEMPOTENCY = {"MAX_STORED_BODY": 10}  # type: ignore[attr-defined]
    first = post(api, URL, {"amount": 100}, "order-1")
    retry = post(api, URL, {"amount": 100}, "order-1")

    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().response_body is None
    assert (retry.status_code, retry["Location"]) == (201, first["Location"])
    assert retry.content == b""
    assert retry["Idempotent-Body-Omitted"] == "true"
    assert "MAX_STORED_BODY" in caplog.text


@pytest.mark.parametrize("url", [URL, "/plain/charges"])
def test_a_number_out_of_range_is_a_400_not_a_500(api: APIClient, url: str) -> None:
    response = api.post(
        url, '{"amount": 1e999}', content_type="application/json", HTTP_IDEMPOTENCY_KEY="k"
    )

    assert response.status_code == 400
    assert response.json()["code"] == "parse_error"
    assert IdempotencyRecord.objects.count() == Charge.objects.count() == 0


def test_an_abandoned_claim_is_taken_over_once_its_lease_ran_out(api: APIClient) -> None:
    """Its owner died before finishing: its writes rolled back, so the retry runs."""
    post(api, URL, {"amount": 100}, "order-1")
    Charge.objects.all().delete()
    IdempotencyRecord.objects.update(
        state=State.CLAIMED, lease_expires_at=timezone.now() - timedelta(seconds=1)
    )

    response = post(api, URL, {"amount": 100}, "order-1")

    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.fencing_token) == (State.COMPLETED, 2)


def test_a_claim_whose_lease_still_runs_is_not_taken_over(api: APIClient) -> None:
    post(api, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(
        state=State.CLAIMED, lease_expires_at=timezone.now() + timedelta(seconds=30)
    )
    assert post(api, URL, {"amount": 100}, "order-1").status_code == 409


def test_deeply_nested_json_is_a_400_not_a_500(api: APIClient) -> None:
    body = "[" * 5000 + "]" * 5000
    response = api.post(URL, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k")

    assert response.status_code == 400
    assert IdempotencyRecord.objects.count() == 0


def test_an_overlong_tenant_is_stored_by_its_digest(api: APIClient, settings: object) -> None:
    settings.IDEMPOTENCY = {"TENANT": lambda request: "t" * 500}  # type: ignore[attr-defined]

    assert post(api, URL, {"amount": 1}, "k").status_code == 201
    assert post(api, URL, {"amount": 1}, "k")["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().tenant.startswith("sha256:")


def test_keys_differing_only_in_case_are_different_keys(api: APIClient) -> None:
    """MySQL/MariaDB collations ignore case unless the columns are binary."""
    upper = post(api, URL, {"amount": 1}, "Order-ABC")
    lower = post(api, URL, {"amount": 1}, "order-abc")

    assert "Idempotent-Replayed" not in lower
    assert upper.json()["id"] != lower.json()["id"]
    assert IdempotencyRecord.objects.count() == 2


@pytest.mark.parametrize("url", [URL, "/plain/charges"])
def test_problem_details_format(api: APIClient, settings: object, url: str) -> None:
    settings.IDEMPOTENCY = {"ERROR_FORMAT": "problem"}  # type: ignore[attr-defined]
    post(api, url, {"amount": 1}, "k")
    IdempotencyRecord.objects.update(state=State.CLAIMED)

    response = post(api, url, {"amount": 1}, "k")

    assert response.status_code == 409
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "1"
    problem = json.loads(response.content)
    assert problem["type"].endswith("#idempotency_request_in_progress")
    assert (problem["status"], problem["code"]) == (409, "idempotency_request_in_progress")
    assert problem["title"] and problem["detail"]
    assert post(api, url, {"amount": 1}, None)["Content-Type"] == "application/problem+json"
