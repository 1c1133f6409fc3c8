"""The decorator and the mixin on every kind of view the SPEC names."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import TokenClient, post

pytestmark = pytest.mark.django_db(transaction=True)

CREATE_URLS = [
    "/api-view/charges",
    "/cbv/charges",
    "/generic/charges",
    "/viewset/charges/",
    "/mixin/charges",
    "/plain/charges",
]


@pytest.mark.parametrize("url", CREATE_URLS)
def test_each_view_kind_runs_once_and_replays(api: APIClient, url: str) -> None:
    first = post(api, url, {"amount": 5}, "k")
    retry = post(api, url, {"amount": 5}, "k")
    mismatch = post(api, url, {"amount": 6}, "k")
    missing = post(api, url, {"amount": 5}, None)

    assert Charge.objects.count() == 1
    assert (first.status_code, retry.status_code) == (201, 201)
    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert (mismatch.status_code, mismatch.json()["code"]) == (422, "idempotency_key_reused")
    assert (missing.status_code, missing.json()["code"]) == (400, "idempotency_key_missing")


def test_refusals_of_plain_django_views_have_the_drf_error_shape(api: APIClient) -> None:
    response = post(api, "/plain/charges", {"amount": 5}, "")

    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    assert set(response.json()) == {"detail", "code"}


@pytest.mark.parametrize("url", ["/cbv/charges/{pk}", "/viewset/charges/{pk}/"])
def test_update_and_destroy_are_protected(api: APIClient, url: str) -> None:
    charge = Charge.objects.create(tenant="anonymous", amount=1)
    target = url.format(pk=charge.pk)

    first = api.put(target, {"amount": 7}, format="json", HTTP_IDEMPOTENCY_KEY="u")
    charge.amount = 1
    charge.save()
    retry = api.put(target, {"amount": 7}, format="json", HTTP_IDEMPOTENCY_KEY="u")

    assert retry.content == first.content
    assert retry["Idempotent-Replayed"] == "true"
    charge.refresh_from_db()
    assert charge.amount == 1  # the replay did not run the update again

    deleted = api.delete(target, HTTP_IDEMPOTENCY_KEY="d")
    again = api.delete(target, HTTP_IDEMPOTENCY_KEY="d")
    assert deleted.status_code == again.status_code == 204
    assert again["Idempotent-Replayed"] == "true"


def test_custom_action_is_protected_and_url_arguments_are_input(api: APIClient) -> None:
    one = Charge.objects.create(tenant="anonymous", amount=1)
    two = Charge.objects.create(tenant="anonymous", amount=1)

    first = post(api, f"/viewset/charges/{one.pk}/refund/", {}, "refund-key")
    retry = post(api, f"/viewset/charges/{one.pk}/refund/", {}, "refund-key")
    other_charge = post(api, f"/viewset/charges/{two.pk}/refund/", {}, "refund-key")

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert other_charge.status_code == 422
    assert IdempotencyRecord.objects.get().operation == (
        "POST ^viewset/charges/(?P<pk>[^/.]+)/refund"
    )


def test_mixin_protects_only_unsafe_methods(api: APIClient) -> None:
    assert api.get("/mixin/charges", HTTP_IDEMPOTENCY_KEY="k").status_code == 200
    assert IdempotencyRecord.objects.count() == 0


def test_tenants_never_share_records(client_for: Callable[..., TokenClient]) -> None:
    alice, bob = client_for(), client_for()

    alice_first = post(alice, "/api-view/charges", {"amount": 5}, "same-key")
    bob_first = post(bob, "/api-view/charges", {"amount": 5}, "same-key")

    assert Charge.objects.count() == 2
    assert alice_first.json()["id"] != bob_first.json()["id"]
    assert "Idempotent-Replayed" not in bob_first
    assert sorted(IdempotencyRecord.objects.values_list("tenant", flat=True)) == sorted(
        [f"user:{alice.user.pk}", f"user:{bob.user.pk}"]
    )
    assert post(bob, "/api-view/charges", {"amount": 5}, "same-key").json() == bob_first.json()


def test_the_same_key_on_another_operation_is_another_record(api: APIClient) -> None:
    post(api, "/api-view/charges", {"amount": 5}, "same-key")
    second = post(api, "/cbv/charges", {"amount": 5}, "same-key")

    assert "Idempotent-Replayed" not in second
    assert Charge.objects.count() == 2
    assert sorted(IdempotencyRecord.objects.values_list("operation", flat=True)) == [
        "POST api-view/charges",
        "POST cbv/charges",
    ]


def test_tenant_resolver_setting_is_used(api: APIClient, settings: object) -> None:
    settings.IDEMPOTENCY = {  # type: ignore[attr-defined]
        "TENANT": lambda request: request.headers.get("X-Account", "none")
    }
    post(api, "/api-view/charges", {"amount": 5}, "k", HTTP_X_ACCOUNT="acct_1")
    post(api, "/api-view/charges", {"amount": 5}, "k", HTTP_X_ACCOUNT="acct_2")

    assert sorted(IdempotencyRecord.objects.values_list("tenant", flat=True)) == [
        "acct_1",
        "acct_2",
    ]


def test_operation_name_and_selected_fields(api: APIClient) -> None:
    body = {"amount": 5, "card": {"last4": "4242", "exp": "12/30"}, "note": "a"}
    post(api, "/api-view/fields", body, "k")
    # Fields outside the selection do not change the request.
    same = post(api, "/api-view/fields", {**body, "note": "b"}, "k")
    changed = post(api, "/api-view/fields", {**body, "card": {"last4": "0000"}}, "k")

    assert IdempotencyRecord.objects.get().operation == "charge-by-fields"
    assert same["Idempotent-Replayed"] == "true"
    assert changed.status_code == 422


def test_mixin_options_are_class_attributes_callables_included(api: APIClient) -> None:
    first = post(api, "/mixin/selected", {"amount": 5, "note": "a"}, "k")
    # The note is outside the callable's input: the same request.
    same = post(api, "/mixin/selected", {"amount": 5, "note": "b"}, "k")
    changed = post(api, "/mixin/selected", {"amount": 6, "note": "a"}, "k")

    assert first.status_code == 201
    assert same["Idempotent-Replayed"] == "true"
    assert changed.status_code == 422
    assert IdempotencyRecord.objects.get().operation == "mixin-selected"


def test_a_format_suffix_is_the_same_operation(api: APIClient) -> None:
    first = post(api, "/viewset/charges/", {"amount": 5}, "k")
    suffixed = post(api, "/viewset/charges.json", {"amount": 5}, "k")

    assert Charge.objects.count() == 1
    assert suffixed["Idempotent-Replayed"] == "true"
    assert suffixed.content == first.content


def test_path_converter_values_are_input(api: APIClient) -> None:
    url = "/api-view/by-ref/{}"
    one, two = "6f1c5f44-6c1b-4b8e-9a0e-3c3f0d6f7b10", "0b7c7a1e-8a56-4a4f-8f2d-2a9c64f1a9c3"

    assert post(api, url.format(one), {"amount": 5}, "k").status_code == 201
    assert post(api, url.format(one), {"amount": 5}, "k")["Idempotent-Replayed"] == "true"
    assert post(api, url.format(two), {"amount": 5}, "k").status_code == 422


# The refused-input rule on every kind of protected DRF view.
#
# A ValidationError (a serializer's, or one the view raises) is not stored:
# the corrected body runs under the same key. Checked for every way of
# protecting a view.

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
