"""Configuration-specific guarantees over a real gunicorn server (tests/configurations/)."""

from __future__ import annotations

import uuid

import pytest
import requests

from tests.live.server import Lazy, LiveServer

pytestmark = [pytest.mark.postgres, pytest.mark.live, pytest.mark.guarantees]


@pytest.mark.only_under("csrf-real-server")
@pytest.mark.parametrize("multipart", [True, False], ids=["multipart", "urlencoded"])
def test_a_form_post_with_a_csrf_token_runs_once_over_a_real_server(
    live: Lazy[LiveServer], multipart: bool
) -> None:
    """CsrfViewMiddleware reads the form first; the fingerprint must still work."""
    server = live.get()
    note = f"csrf-{uuid.uuid4().hex[:8]}"
    url = server.url + "/forms/charges"
    with requests.Session() as session:
        token = session.get(server.url + "/forms/csrf-token", timeout=10).json()["token"]
        fields = {"amount": "5", "note": note, "csrfmiddlewaretoken": token}
        headers = {"Idempotency-Key": note}

        def send() -> requests.Response:
            if multipart:
                parts = {name: (None, value) for name, value in fields.items()}
                return session.post(url, files=parts, headers=headers, timeout=10)
            return session.post(url, data=fields, headers=headers, timeout=10)

        first, retry = send(), send()

    explain = f"{first.status_code} {first.text[:300]}\n{server.diagnostics()}"
    assert first.status_code == 201, explain
    assert retry.status_code == 201 and retry.headers["Idempotent-Replayed"] == "true", explain
    assert retry.content == first.content
    assert server.database.count_charges(note) == 1
