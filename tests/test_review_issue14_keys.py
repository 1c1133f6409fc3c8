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
