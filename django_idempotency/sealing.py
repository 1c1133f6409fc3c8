"""What is written of a stored response: redacted, then (optionally) encrypted.

Stored responses can hold payment data. ``IDEMPOTENCY["REDACT"]`` is a hook
that receives the response to store and returns what to keep;
``IDEMPOTENCY["ENCRYPTION_KEYS"]`` (Fernet keys, newest first) encrypts the
headers and body at rest with ``cryptography``'s MultiFernet: the first key
encrypts, every key decrypts, so keys rotate by putting a new one first and
re-encrypting with ``manage.py idempotency_rotate_keys``.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import idempotency_settings
from django_idempotency.responses import StoredResponse

if TYPE_CHECKING:
    from cryptography.fernet import MultiFernet

#: Marks an encrypted body; it holds the token of {"headers", "body"}.
SEALED_PREFIX = b"fernet:"


class UnreadableRecord(Exception):
    """An encrypted response that none of the configured keys decrypts."""


def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    try:
        from cryptography.fernet import Fernet, MultiFernet
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImproperlyConfigured(
            'IDEMPOTENCY["ENCRYPTION_KEYS"] needs cryptography: '
            'pip install "django-idempotency[encryption]"'
        ) from exc
    return MultiFernet([Fernet(key) for key in keys])


def seal(response: StoredResponse) -> StoredResponse:
    """Redact, then encrypt if keys are configured: what the store writes."""
    conf = idempotency_settings
    if conf.REDACT is not None:
        response = conf.REDACT(response)
    keys = conf.ENCRYPTION_KEYS
    if not keys or response.body is None:
        return response
    plain = json.dumps(
        {"headers": response.headers, "body": base64.b64encode(response.body).decode("ascii")}
    ).encode("utf-8")
    return StoredResponse(response.status, [], SEALED_PREFIX + _fernet(keys).encrypt(plain))


def is_sealed(body: Any) -> bool:
    return body is not None and bytes(body).startswith(SEALED_PREFIX)


def unseal(headers: list[list[str]], body: Any) -> tuple[list[list[str]], bytes | None]:
    """The headers and body to replay, decrypted if they were sealed."""
    if body is None:
        return headers, None
    raw = bytes(body)
    if not raw.startswith(SEALED_PREFIX):
        return headers, raw
    from cryptography.fernet import InvalidToken

    keys = idempotency_settings.ENCRYPTION_KEYS
    if not keys:
        raise UnreadableRecord("the response is encrypted and no ENCRYPTION_KEYS are set")
    try:
        plain = json.loads(_fernet(keys).decrypt(raw[len(SEALED_PREFIX) :]))
    except InvalidToken as exc:
        raise UnreadableRecord("none of ENCRYPTION_KEYS decrypts the response") from exc
    return plain["headers"], base64.b64decode(plain["body"])


def reseal(body: Any) -> bytes | None:
    """Re-encrypt a sealed body with the newest key (key rotation)."""
    raw = bytes(body)
    token = _fernet(idempotency_settings.ENCRYPTION_KEYS).rotate(raw[len(SEALED_PREFIX) :])
    return SEALED_PREFIX + token
