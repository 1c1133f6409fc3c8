"""Plain Django form views behind CsrfViewMiddleware, over a real server (gunicorn).

Django's test client skips CSRF enforcement unless asked, which hid a 500:
the middleware parses a multipart body (``request.POST``) before the view
runs, and the fingerprint then read ``request.body``. Here the requests
carry a CSRF cookie and token, as a browser's form posts do.
"""

from __future__ import annotations

import http.client
import json
import uuid
from typing import Any

import pytest
import requests
from django.middleware.csrf import _get_new_csrf_string

from tests.live.server import Lazy, LiveServer
from tests.utils import masked_csrf_token

pytestmark = [pytest.mark.postgres, pytest.mark.live]

URL = "/plain/form-charges"


def post_form(server: LiveServer, key: str, secret: str, amount: str) -> requests.Response:
    """A multipart form post with a file, a CSRF cookie and a freshly masked token."""
    return requests.post(
        server.url + URL,
        data={"amount": amount, "note": key, "csrfmiddlewaretoken": masked_csrf_token(secret)},
        files={"receipt": ("receipt.txt", b"paid in full")},
        cookies={"csrftoken": secret},
        headers={"Idempotency-Key": key},
        timeout=30,
    )


def test_a_multipart_form_runs_once_replays_and_refuses_changed_input(
    live: Lazy[LiveServer],
) -> None:
    server = live.get()
    offset = server.log_offset()
    key = f"csrf-form-{uuid.uuid4().hex[:8]}"
    secret = _get_new_csrf_string()

    first = post_form(server, key, secret, "3")
    retry = post_form(server, key, secret, "3")
    changed = post_form(server, key, secret, "4")

    assert first.status_code == 201, (first.text[:300], server.diagnostics())
    assert first.json()["files"] == ["receipt.txt"]
    assert "Idempotent-Replayed" not in first.headers
    assert (retry.status_code, retry.headers.get("Idempotent-Replayed")) == (201, "true")
    assert retry.content == first.content
    assert changed.status_code == 422
    assert changed.json()["code"] == "idempotency_key_reused"
    assert server.database.count_charges(key) == 1
    assert server.problems_since(offset) == []


def test_a_form_without_its_csrf_token_is_still_refused_by_django(live: Lazy[LiveServer]) -> None:
    server = live.get()
    response = requests.post(
        server.url + URL,
        files={"amount": (None, "3")},
        headers={"Idempotency-Key": f"csrf-none-{uuid.uuid4().hex[:8]}"},
        timeout=30,
    )

    assert response.status_code == 403


def send_with_two_key_lines(server: LiveServer, first: str, second: str) -> tuple[int, Any]:
    """A JSON POST with the Idempotency-Key header sent twice (as a buggy client might)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        body = json.dumps({"amount": 1}).encode()
        connection.putrequest("POST", "/api-view/charges")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(body)))
        connection.putheader("Idempotency-Key", first)
        connection.putheader("Idempotency-Key", second)
        connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_two_key_header_lines_that_join_into_one_quoted_string_are_refused(
    live: Lazy[LiveServer],
) -> None:
    server = live.get()
    tag = uuid.uuid4().hex[:8]

    status, body = send_with_two_key_lines(server, f'"k1-{tag}', f'k2-{tag}"')

    assert (status, body["code"]) == (400, "idempotency_key_invalid"), body
    assert "comma" in body["detail"]
    keys = server.database.query('SELECT "key" FROM django_idempotency_record')
    assert not [row for row in keys if tag in row[0]]
