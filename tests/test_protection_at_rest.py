"""Stored responses at rest: the redaction hook, encryption, key rotation, limits."""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse
from tests.factories import UserFactory
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/api-view/charges"
OLD, NEW = Fernet.generate_key().decode(), Fernet.generate_key().decode()


def raw_row() -> tuple[Any, Any]:
    """What the database holds, read past the ORM."""
    return raw_rows()[0]


def raw_rows() -> list[tuple[Any, Any]]:
    """Every record's headers and body as the database holds them, oldest first."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT response_headers, response_body FROM django_idempotency_record ORDER BY id"
        )
        rows = cursor.fetchall()
    return [(str(headers), None if body is None else bytes(body)) for headers, body in rows]


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
    assert "rotated 1, encrypted 0, unreadable 0" in out.getvalue()

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
        user = UserFactory.create(is_staff=True)
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


def test_headers_are_encrypted_when_the_body_is_too_large_to_store(
    api: APIClient, settings: Any
) -> None:
    settings.IDEMPOTENCY = {
        "ENCRYPTION_KEYS": [NEW],
        "MAX_STORED_BODY": 1,
        "STORED_HEADERS": ["ETag"],
    }
    first = post(api, URL, {"amount": 4242}, "k")
    retry = post(api, URL, {"amount": 4242}, "k")

    headers, body = raw_row()
    assert "/charges/" not in headers and "ETag" not in headers
    assert body is not None and b"/charges/" not in body
    assert retry["Idempotent-Replayed"] == "true" and retry["Idempotent-Body-Omitted"] == "true"
    assert (retry["Location"], retry["ETag"]) == (first["Location"], first["ETag"])
    assert retry.content == b""


def test_rotation_encrypts_responses_stored_before_encryption_was_turned_on(
    api: APIClient, settings: Any
) -> None:
    small = post(api, URL, {"amount": 4242}, "small")
    settings.IDEMPOTENCY = {"MAX_STORED_BODY": 1}
    large = post(api, URL, {"amount": 4343}, "large")
    assert "/charges/" in raw_rows()[0][0] and b"4242" in raw_rows()[0][1]
    assert "/charges/" in raw_rows()[1][0] and raw_rows()[1][1] is None

    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    out = StringIO()
    call_command("idempotency_rotate_keys", stdout=out)

    assert "rotated 0, encrypted 2, unreadable 0" in out.getvalue()
    for headers, body in raw_rows():
        assert "/charges/" not in headers and b"/charges/" not in body
        assert b"4242" not in body and b"4343" not in body
    assert post(api, URL, {"amount": 4242}, "small").content == small.content
    replayed = post(api, URL, {"amount": 4343}, "large")
    assert replayed["Location"] == large["Location"] and replayed.content == b""


def test_a_plaintext_body_that_looks_like_ciphertext_is_still_plaintext(
    api: APIClient, settings: Any
) -> None:
    post(api, URL, {"amount": 1}, "k")
    IdempotencyRecord.objects.update(response_body=b"fernet:a plain body, not a token")

    retry = post(api, URL, {"amount": 1}, "k")

    assert retry.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert retry.content == b"fernet:a plain body, not a token"


def test_the_admin_shows_a_plaintext_body_that_looks_like_ciphertext(
    api: APIClient, settings: Any
) -> None:
    post(api, URL, {"amount": 1}, "k")
    record = IdempotencyRecord.objects.get()
    IdempotencyRecord.objects.update(response_body=b"fernet:a plain body, not a token")
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    user = UserFactory.create(is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename="view_idempotencyrecord"))
    client = Client()
    client.force_login(user)

    page = client.get(
        f"/admin/django_idempotency/idempotencyrecord/{record.pk}/change/"
    ).content.decode()

    assert "a plain body, not a token" in page and "lack the permission" not in page


def test_rotation_encrypts_a_plaintext_body_that_looks_like_ciphertext(
    api: APIClient, settings: Any
) -> None:
    post(api, URL, {"amount": 1}, "k")
    IdempotencyRecord.objects.update(response_body=b"fernet:a plain body, not a token")
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}

    out = StringIO()
    call_command("idempotency_rotate_keys", stdout=out)

    assert "rotated 0, encrypted 1, unreadable 0" in out.getvalue()
    assert b"a plain body" not in raw_row()[1]
    assert post(api, URL, {"amount": 1}, "k").content == b"fernet:a plain body, not a token"


def test_rotation_goes_on_past_a_record_no_key_decrypts_and_fails_with_a_summary(
    api: APIClient, settings: Any
) -> None:
    lost = Fernet.generate_key().decode()
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [lost]}
    post(api, URL, {"amount": 1}, "unreadable-key")
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [OLD]}
    readable = post(api, URL, {"amount": 2}, "readable-key")
    unreadable = IdempotencyRecord.objects.get(key="unreadable-key")

    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW, OLD]}
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match="1 stored response"):
        call_command("idempotency_rotate_keys", stdout=out, stderr=err)

    assert "rotated 1, encrypted 0, unreadable 1" in out.getvalue()
    assert f"record {unreadable.pk} " in err.getvalue()
    assert f"{unreadable.tenant} / {unreadable.operation} / unreadable-key" in err.getvalue()
    # The record after the unreadable one was rotated all the same.
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    assert post(api, URL, {"amount": 2}, "readable-key").content == readable.content


def test_rotation_prints_an_unreadable_records_scope_with_control_characters_escaped(
    api: APIClient, settings: Any
) -> None:
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}
    post(api, URL, {"amount": 1}, "unreadable-key")
    # A tenant may come from the client (a header, a subdomain): stored as given.
    IdempotencyRecord.objects.update(tenant="acme\x1b]0;owned\x07\r", operation="POST \x1b[2J")

    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    err = StringIO()
    with pytest.raises(CommandError):
        call_command("idempotency_rotate_keys", stdout=StringIO(), stderr=err)

    printed = err.getvalue()
    assert [char for char in printed if not char.isprintable() and char != "\n"] == []
    assert "(acme\\x1b]0;owned\\x07\\r / POST \\x1b[2J / unreadable-key)" in printed


def test_an_unflagged_body_is_plaintext_even_when_a_configured_key_decrypts_it(
    api: APIClient, settings: Any
) -> None:
    # Only the record's response_sealed says a response is encrypted: a body
    # that is a token of a configured key, with no headers and the flag
    # False, is what the view answered, and is replayed and shown as such.
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [NEW]}
    post(api, URL, {"amount": 1}, "k")
    token = raw_row()[1]
    assert IdempotencyRecord.objects.filter(response_sealed=True).update(
        response_sealed=False, response_headers=[]
    )

    retry = post(api, URL, {"amount": 1}, "k")

    assert retry.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert retry.content == token
