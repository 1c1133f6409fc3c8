"""Review of issue 14: keys read from the body (``key="body:..."``) under hostile input.

A request whose body cannot be parsed carries no readable key: it is a
client error (4xx), never a server error (500).
"""

from __future__ import annotations

import pytest
from django.test import Client

from django_idempotency.models import IdempotencyRecord

pytestmark = pytest.mark.django_db(transaction=True)


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
