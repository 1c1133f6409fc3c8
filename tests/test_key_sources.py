"""``@idempotent(key=...)``: keys read from another header, a body field or a callable.

Wherever it comes from, a key is validated like the Idempotency-Key header,
refused the same way, and claimed, completed and replayed the same way; it
is not echoed as an Idempotency-Key. Views: ``tests/testapp/keyed_views.py``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from rest_framework.test import APIClient

from django_idempotency import idempotent
from django_idempotency._protection.keys import KeySource
from django_idempotency.drf import IdempotentMixin
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge

pytestmark = [pytest.mark.django_db(transaction=True)]

State = IdempotencyRecord.State


def event(object_id: Any, **extra: Any) -> dict[str, Any]:
    return {"id": "evt_1", "data": {"object": {"id": object_id}}, **extra}


# -- from another header ---------------------------------------------------------------


def test_a_key_from_another_header_runs_once_and_replays(api: APIClient) -> None:
    first = api.post("/keyed/delivery-header", {"amount": 5}, format="json", HTTP_X_DELIVERY="d-1")
    again = api.post("/keyed/delivery-header", {"amount": 5}, format="json", HTTP_X_DELIVERY="d-1")

    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().key == "d-1"


def test_a_key_from_elsewhere_is_not_echoed_as_an_idempotency_key(api: APIClient) -> None:
    response = api.post(
        "/keyed/delivery-header",
        {"amount": 5},
        format="json",
        HTTP_X_DELIVERY="d-1",
        HTTP_IDEMPOTENCY_KEY="client-key",
    )

    assert response.status_code == 201
    assert "Idempotency-Key" not in response
    # The Idempotency-Key header is not this view's key: the delivery id is.
    assert IdempotencyRecord.objects.get().key == "d-1"


def test_a_missing_header_key_is_refused_naming_the_header(api: APIClient) -> None:
    response = api.post("/keyed/delivery-header", {"amount": 5}, format="json")

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert "X-Delivery" in response.json()["detail"]
    assert Charge.objects.count() == 0


@pytest.mark.parametrize("value", ["", "a" * 256, "d 1", "dé", "d-1, d-2"])
def test_an_invalid_header_key_is_refused(api: APIClient, value: str) -> None:
    response = api.post(
        "/keyed/delivery-header", {"amount": 5}, format="json", HTTP_X_DELIVERY=value
    )

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_invalid"
    assert IdempotencyRecord.objects.count() == 0


def test_a_quoted_value_of_another_header_is_the_key_as_sent(api: APIClient) -> None:
    """Only the Idempotency-Key header is a Structured Field String."""
    api.post("/keyed/delivery-header", {"amount": 5}, format="json", HTTP_X_DELIVERY='"d-1"')

    assert IdempotencyRecord.objects.get().key == '"d-1"'


# -- from the body ---------------------------------------------------------------------


def test_a_dotted_body_field_is_the_key(api: APIClient) -> None:
    first = api.post("/keyed/body-field", event("pi_1", amount=5), format="json")
    again = api.post("/keyed/body-field", event("pi_1", amount=5), format="json")
    other = api.post("/keyed/body-field", event("pi_2", amount=5), format="json")

    assert first.status_code == again.status_code == other.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in other
    assert sorted(IdempotencyRecord.objects.values_list("key", flat=True)) == ["pi_1", "pi_2"]
    assert Charge.objects.count() == 2


def test_an_integer_body_field_is_its_decimal_spelling(api: APIClient) -> None:
    api.post("/keyed/body-field", event(1234, amount=5), format="json")
    again = api.post("/keyed/body-field", event(1234, amount=5), format="json")

    assert IdempotencyRecord.objects.get().key == "1234"
    assert again["Idempotent-Replayed"] == "true"


@pytest.mark.parametrize("value", [1.5, True, {"id": 1}, ["a"], "", "a" * 256, "é"])
def test_a_body_field_that_is_no_key_is_refused(api: APIClient, value: Any) -> None:
    response = api.post("/keyed/body-field", event(value, amount=5), format="json")

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_invalid"
    assert "data.object.id" in response.json()["detail"]
    assert Charge.objects.count() == 0


@pytest.mark.parametrize("body", [{"amount": 5}, event(None, amount=5), {"data": "x"}])
def test_a_missing_body_field_is_refused_as_missing(api: APIClient, body: Any) -> None:
    response = api.post("/keyed/body-field", body, format="json")

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert Charge.objects.count() == 0


def test_a_body_field_of_a_plain_django_json_view(client: Client) -> None:
    for _ in range(2):
        response = client.post(
            "/keyed/plain-body", {"id": "evt_9", "amount": 5}, content_type="application/json"
        )
    assert response.status_code == 201
    assert response["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_body_field_of_a_plain_django_form_view(client: Client) -> None:
    for _ in range(2):
        response = client.post("/keyed/plain-body", {"id": "evt_9", "amount": "5"})
    assert response.status_code == 201
    assert response["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().key == "evt_9"


def test_a_form_field_sent_twice_is_refused(client: Client) -> None:
    response = client.post("/keyed/plain-body", {"id": ["evt_1", "evt_2"], "amount": "5"})

    assert response.status_code == 400
    assert Charge.objects.count() == 0


def test_a_body_that_is_not_json_has_no_key(client: Client) -> None:
    response = client.post("/keyed/plain-body", "{oops", content_type="application/json")

    assert response.status_code == 400
    assert b"idempotency_key_missing" in response.content


def test_the_mixin_reads_its_key_from_the_body(api: APIClient) -> None:
    first = api.post("/keyed/mixin", {"amount": 5, "note": "n-1"}, format="json")
    again = api.post("/keyed/mixin", {"amount": 5, "note": "n-1"}, format="json")

    assert first.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().key == "n-1"


# -- from the body's digest -------------------------------------------------------------


def test_the_bodys_digest_is_the_key_and_the_view_still_reads_the_body(api: APIClient) -> None:
    body = b'{"amount": 5, "note": "n-1"}'
    first = api.post("/keyed/body-digest", body, content_type="application/json")
    again = api.post("/keyed/body-digest", body, content_type="application/json")

    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert Charge.objects.get().amount == 5  # request.data parsed after the key was read
    assert IdempotencyRecord.objects.get().key == hashlib.sha256(body).hexdigest()


def test_the_bodys_digest_is_of_the_bytes_as_sent(api: APIClient) -> None:
    """Another spelling of the same JSON is another body: a signature tells them apart too."""
    api.post("/keyed/body-digest", b'{"amount": 5}', content_type="application/json")
    other = api.post("/keyed/body-digest", b'{"amount":5}', content_type="application/json")

    assert "Idempotent-Replayed" not in other
    assert IdempotencyRecord.objects.count() == 2


def test_an_empty_body_has_no_digest_key(api: APIClient) -> None:
    response = api.post("/keyed/body-digest", b"", content_type="application/json")

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert "request body (its digest is the key)" in response.json()["detail"]


def test_a_body_too_large_is_refused_before_its_digest_is_taken(
    api: APIClient, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"MAX_FINGERPRINTED_BODY": 100}
    response = api.post("/keyed/body-digest", {"pad": "x" * 200}, format="json")

    assert response.status_code == 413
    assert Charge.objects.count() == 0


# -- refusals name where the key came from ----------------------------------------------


@pytest.mark.parametrize(
    ("url", "headers", "source"),
    [
        ("/keyed/delivery-header", {"HTTP_X_DELIVERY": "d-1"}, "the X-Delivery header"),
        ("/keyed/body-field", {}, "the body field 'data.object.id'"),
        ("/keyed/body-digest", {}, "the body's digest"),
    ],
    ids=["header", "body-field", "body-digest"],
)
def test_a_key_reused_with_other_input_is_refused_naming_its_source(
    api: APIClient, url: str, headers: dict[str, Any], source: str
) -> None:
    """A sender that sent no Idempotency-Key is not told about one."""
    body = b'{"id": "evt_1", "data": {"object": {"id": "pi_1"}}, "amount": 5}'
    api.post(url, body, content_type="application/json", **headers)
    # The same key, other input: another amount, or (digest) another query string.
    other = body.replace(b"5}", b"6}") if "digest" not in url else body
    response = api.post(url + "?attempt=2", other, content_type="application/json", **headers)

    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert source in response.json()["detail"]
    assert "Idempotency-Key" not in response.json()["detail"]


def test_a_key_reused_from_the_idempotency_key_header_is_refused_as_before(
    api: APIClient,
) -> None:
    api.post("/api-view/charges", {"amount": 5}, format="json", HTTP_IDEMPOTENCY_KEY="k-1")
    response = api.post(
        "/api-view/charges", {"amount": 6}, format="json", HTTP_IDEMPOTENCY_KEY="k-1"
    )

    assert response.status_code == 422
    assert response.json()["detail"].startswith("This Idempotency-Key was already used")


# -- from a callable -------------------------------------------------------------------


def test_a_callable_key(client: Client) -> None:
    for _ in range(2):
        response = client.post(
            "/keyed/plain-callable",
            {"amount": 5},
            content_type="application/json",
            HTTP_X_REFERENCE="ref-7",
        )
    assert response["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().key == "ref-7"
    assert Charge.objects.count() == 1


def test_a_callable_returning_none_means_no_key(client: Client) -> None:
    response = client.post("/keyed/plain-callable", {"amount": 5}, content_type="application/json")

    assert response.status_code == 400
    assert b"idempotency_key_missing" in response.content


# -- verification before the claim, and the tenant of the sender --------------------------


def test_a_forged_delivery_is_refused_before_the_claim(client: Client) -> None:
    """The forged request carries the genuine delivery id: its 401 must not be replayed."""
    forged = client.post(
        "/keyed/verified",
        {"amount": 5},
        content_type="application/json",
        HTTP_X_DELIVERY="d-1",
        HTTP_X_SIGNATURE="bad",
    )
    genuine = client.post(
        "/keyed/verified",
        {"amount": 5},
        content_type="application/json",
        HTTP_X_DELIVERY="d-1",
        HTTP_X_SIGNATURE="good",
        HTTP_X_SENDER="acme",
    )

    assert forged.status_code == 401
    assert genuine.status_code == 201
    assert "Idempotent-Replayed" not in genuine
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.tenant, record.key, record.state) == ("sender:acme", "d-1", State.COMPLETED)


def test_verify_runs_for_unprotected_methods_too(client: Client) -> None:
    assert client.get("/keyed/verified", HTTP_X_SIGNATURE="bad").status_code == 401


# -- specs checked at decoration time ----------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    ["X-Delivery", "head:X", "header:", "body:", "body:a..b", "digest:", "digest:headers", 3],
)
def test_an_unknown_key_spec_fails_at_decoration(spec: Any) -> None:
    with pytest.raises(ImproperlyConfigured):
        idempotent(key=spec)(lambda request: None)


def test_an_unknown_key_spec_fails_when_the_mixin_class_is_made() -> None:
    with pytest.raises(ImproperlyConfigured):

        class Broken(IdempotentMixin):
            idempotency_key = "cookie:id"


@pytest.mark.parametrize("name", ["outcome", "tenant", "verify"])
def test_callables_are_checked_at_decoration(name: str) -> None:
    with pytest.raises(ImproperlyConfigured):
        idempotent(**{name: "not callable"})(lambda request: None)  # type: ignore[call-overload]


def test_a_header_source_naming_the_idempotency_header_is_the_client_header() -> None:
    assert KeySource.of("header:idempotency-key").is_client_header
    assert KeySource.of(None).is_client_header
    assert not KeySource.of("header:X-GitHub-Delivery").is_client_header
    assert not KeySource.of("body:id").is_client_header
    assert not KeySource.of("digest:body").is_client_header


def test_a_body_too_large_is_refused_before_it_is_parsed_for_its_key(
    api: APIClient, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"MAX_FINGERPRINTED_BODY": 100}
    # Its key field is no key either: which refusal comes first tells the order.
    response = api.post("/keyed/body-field", event(1.5, pad="x" * 200), format="json")

    assert response.status_code == 413
    assert response.json()["code"] == "idempotency_body_too_large"
    assert Charge.objects.count() == 0


def test_a_views_tenant_that_returns_no_string_is_named_in_the_error() -> None:
    from django.http import HttpRequest, HttpResponse
    from django.test import RequestFactory

    def account_of(request: Any) -> Any:
        return 42  # an account's pk, not its name

    @idempotent(key="header:X-Delivery", tenant=account_of, operation="tenant-error")
    def hook(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    request = RequestFactory().post("/hook", HTTP_X_DELIVERY="d-1")
    with pytest.raises(ImproperlyConfigured, match=r"account_of .*tenant=.* returned 42"):
        hook(request)


# Keys read from the body (``key="body:..."``) under hostile input.
#
# A request whose body cannot be parsed carries no readable key: it is a
# client error (4xx), never a server error (500).


def test_a_malformed_multipart_body_on_a_plain_body_key_view_is_a_client_error() -> None:
    """The boundary is declared but the body never closes it: Django's parser raises."""
    client = Client(raise_request_exception=False)
    response = client.generic(
        "POST",
        "/keyed/plain-body",
        b'--xyz\r\nContent-Disposition: form-data; name="id"\r\n\r\nevt_1',
        content_type="multipart/form-data; boundary=",
    )

    assert 400 <= response.status_code < 500, response.status_code
    assert not IdempotencyRecord.objects.exists()


def test_a_form_body_in_a_foreign_charset_on_a_plain_body_key_view_is_a_client_error() -> None:
    client = Client(raise_request_exception=False)
    response = client.generic(
        "POST",
        "/keyed/plain-body",
        b"id=evt_1&amount=5",
        content_type="application/x-www-form-urlencoded; charset=latin-1",
    )

    assert response.status_code < 500, response.status_code


def test_a_multipart_upload_larger_than_the_in_memory_limit_keeps_its_body_key() -> None:
    """A file beyond DATA_UPLOAD_MAX_MEMORY_SIZE: the form is streamed, the key still read."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("big.bin", b"x" * (3 * 1024 * 1024))
    client = Client(raise_request_exception=False)
    first = client.post("/keyed/plain-body", {"id": "evt_9", "amount": "5", "file": upload})
    upload.seek(0)
    again = client.post("/keyed/plain-body", {"id": "evt_9", "amount": "5", "file": upload})

    assert first.status_code == 201, first.content
    assert again.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert IdempotencyRecord.objects.get().key == "evt_9"


def test_a_urlencoded_body_beyond_the_in_memory_limit_is_a_client_error() -> None:
    client = Client(raise_request_exception=False)
    body = b"id=evt_1&pad=" + b"x" * (3 * 1024 * 1024)
    response = client.generic(
        "POST", "/keyed/plain-body", body, content_type="application/x-www-form-urlencoded"
    )

    assert 400 <= response.status_code < 500, response.status_code


@pytest.mark.parametrize("url", ["/keyed/body-field", "/keyed/mixin"])
@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"{not json", "application/json"),
        (b"note=evt_1", "text/plain"),
        (b'{"note": 1.5, "data": {"object": {"id": [1]}}}', "application/json"),
    ],
    ids=["malformed", "unsupported", "not-a-key"],
)
def test_a_drf_body_key_view_answers_unreadable_input_with_a_4xx(
    url: str, body: bytes, content_type: str
) -> None:
    client = Client(raise_request_exception=False)
    response = client.generic("POST", url, body, content_type=content_type)

    assert 400 <= response.status_code < 500, (response.status_code, response.content)
    assert not IdempotencyRecord.objects.exists()


# Deeper than json parses on every supported Python (3.13 parses 5,000 levels).
_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("url", ["/keyed/body-field", "/keyed/mixin", "/keyed/plain-body"])
@pytest.mark.parametrize(
    "body",
    [
        _DEEP,
        '{"id": "evt_1", "note": "n-1", "data": {"object": {"id": "pi_1"}}, "deep": ' + _DEEP + "}",
    ],
    ids=["deep-body", "deep-sibling-field"],
)
def test_a_body_nested_too_deeply_to_read_its_key_is_refused_as_unreadable(
    url: str, body: str
) -> None:
    """The same 400 as a header-keyed view answers for the same body: not a 500."""
    client = Client(raise_request_exception=False)
    response = client.post(url, body, content_type="application/json")

    assert response.status_code == 400, (response.status_code, response.content[:200])
    assert response.json()["code"] == "parse_error"
    assert "nested too deeply" in response.json()["detail"]
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0
