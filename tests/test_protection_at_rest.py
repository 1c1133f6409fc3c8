"""Stored responses at rest: the redaction hook, encryption, key rotation, limits."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse
from tests.conftest import post
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/api-view/charges"
OLD, NEW = Fernet.generate_key().decode(), Fernet.generate_key().decode()


def raw_row() -> tuple[Any, Any]:
    """What the database holds, read past the ORM."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT response_headers, response_body FROM django_idempotency_record")
        headers, body = cursor.fetchone()
    return headers, bytes(body)


def drop_tenant(response: StoredResponse) -> StoredResponse:
    body = json.loads(response.body or b"{}")
    body.pop("tenant", None)
    return StoredResponse(response.status, response.headers, json.dumps(body).encode())


def test_the_redaction_hook_decides_what_is_stored(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"REDACT": "tests.test_protection_at_rest.drop_tenant"}
    first = post(api, URL, {"amount": 1}, "k")
    retry = post(api, URL, {"amount": 1}, "k")

    assert "tenant" in first.json()  # the first answer is the view's own
    assert "tenant" not in retry.json() and retry.json()["amount"] == 1
    assert b"tenant" not in raw_row()[1]


def test_encrypted_at_rest_and_replayed_transparently(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    first = post(api, URL, {"amount": 4242}, "k")
    retry = post(api, URL, {"amount": 4242}, "k")

    assert retry.content == first.content and retry["Location"] == first["Location"]
    assert retry["Idempotent-Replayed"] == "true"
    headers, body = raw_row()
    assert b"4242" not in body and body.startswith(b"fernet:")
    assert "Location" not in str(headers)


def test_keys_rotate_without_losing_a_replay(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [OLD]}
    first = post(api, URL, {"amount": 1}, "k")

    # A new key first: old records still decrypt with the second.
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW, OLD]}
    assert post(api, URL, {"amount": 1}, "k").content == first.content

    out = StringIO()
    call_command("idempotency_rotate_keys", stdout=out)
    assert "re-encrypted 1 stored response(s)" in out.getvalue()

    # Rewritten under the new key: the old one can go.
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    assert post(api, URL, {"amount": 1}, "k").content == first.content


def test_a_record_no_key_decrypts_is_a_503_not_a_wrong_answer(
    api: APIClient, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [OLD]}
    post(api, URL, {"amount": 1}, "k")
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}

    response = post(api, URL, {"amount": 1}, "k")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert "decrypts" in caplog.text


def test_the_admin_shows_decrypted_bodies_only_with_the_permission(
    api: APIClient, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    post(api, URL, {"amount": 777}, "k")
    page = (
        f"/admin/django_idempotency/idempotencyrecord/{IdempotencyRecord.objects.get().pk}/change/"
    )

    def viewer(*codenames: str) -> Client:
        user = UserFactory(is_staff=True)
        user.user_permissions.add(
            *Permission.objects.filter(codename__in=["view_idempotencyrecord", *codenames])
        )
        client = Client()
        client.force_login(user)
        return client

    hidden = viewer().get(page).content.decode()
    shown = viewer("view_decrypted_idempotencyrecord").get(page).content.decode()

    assert "777" not in hidden and "lack the permission" in hidden
    assert "777" in shown and "/charges/" in shown


def test_a_body_over_the_limit_is_refused_with_413(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"MAX_FINGERPRINTED_BODY": 100}
    response = post(api, URL, {"amount": 1, "note": "x" * 200}, "k")

    assert response.status_code == 413
    assert response.json()["code"] == "idempotency_body_too_large"
    assert not IdempotencyRecord.objects.exists()
    assert post(api, URL, {"amount": 1}, "k2").status_code == 201
