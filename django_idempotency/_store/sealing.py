"""What is written of a stored response: redacted, then (optionally) encrypted.

Stored responses can hold payment data. ``IDEMPOTENCY["REDACT"]`` is a hook
that receives the response to store and returns what to keep;
``IDEMPOTENCY["ENCRYPTION_KEYS"]`` (Fernet keys, newest first) encrypts the
headers and body at rest with ``cryptography``'s MultiFernet: the first key
encrypts, every key decrypts, so keys rotate by putting a new one first and
re-encrypting with ``manage.py idempotency_rotate_keys`` (which also encrypts
responses stored before encryption was turned on). The record's
``response_sealed`` column says whether its response is encrypted, written
by the same statement as the response: never guessed from the bytes, which
a plaintext body could spell alike.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import idempotency_settings
from django_idempotency.responses import StoredResponse

if TYPE_CHECKING:
    from cryptography.fernet import MultiFernet


#: Starts every sealed value: a label of the format, never how a sealed
#: value is recognised (the record's ``response_sealed`` says that).
SEALED_PREFIX = b"fernet:"


class UnreadableRecord(Exception):
    """An encrypted response that none of the configured keys decrypts."""


@dataclass(frozen=True)
class Sealed:
    """What the store writes of a response, and whether it is encrypted."""

    response: StoredResponse
    sealed: bool


def _fernet(keys: tuple[str, ...]) -> MultiFernet:
    try:
        from cryptography.fernet import Fernet, MultiFernet
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise ImproperlyConfigured(
            'IDEMPOTENCY["ENCRYPTION_KEYS"] needs cryptography: '
            'pip install "django-idempotency[encryption]"'
        ) from exc
    return MultiFernet([Fernet(key) for key in keys])


def seal(response: StoredResponse) -> Sealed:
    """Redact, then encrypt if keys are configured: what the store writes."""
    conf = idempotency_settings
    if conf.REDACT is not None:
        response = conf.REDACT(response)
    keys = conf.ENCRYPTION_KEYS
    if not keys or (response.body is None and not response.headers):
        return Sealed(response, sealed=False)
    return Sealed(encrypt(response.status, response.headers, response.body), sealed=True)


def encrypt(status: int, headers: list[list[str]], body: bytes | None) -> StoredResponse:
    """Headers and body, both in one token under the newest key; no headers left bare.

    A body that was not stored (too large, streamed) is sealed as ``null``:
    its headers (a ``Location``, ``STORED_HEADERS``) are as telling as a body.
    """
    stored_body = None if body is None else base64.b64encode(bytes(body)).decode("ascii")
    plain = json.dumps({"headers": headers, "body": stored_body}).encode("utf-8")
    token = _fernet(idempotency_settings.ENCRYPTION_KEYS).encrypt(plain)
    return StoredResponse(status, [], SEALED_PREFIX + token)


def unseal(
    headers: list[list[str]], body: Any, *, sealed: bool
) -> tuple[list[list[str]], bytes | None]:
    """The headers and body to replay, decrypted if they were sealed."""
    if not sealed:
        return headers, None if body is None else bytes(body)
    from cryptography.fernet import InvalidToken

    keys = idempotency_settings.ENCRYPTION_KEYS
    if not keys:
        raise UnreadableRecord("the response is encrypted and no ENCRYPTION_KEYS are set")
    try:
        plain = json.loads(_fernet(keys).decrypt(_token(body)))
    except InvalidToken as exc:
        raise UnreadableRecord("none of ENCRYPTION_KEYS decrypts the response") from exc
    stored_body = plain["body"]
    return plain["headers"], None if stored_body is None else base64.b64decode(stored_body)


def _token(body: Any) -> bytes:
    raw = b"" if body is None else bytes(body)
    return raw.removeprefix(SEALED_PREFIX)


def reseal(body: Any) -> bytes:
    """Re-encrypt a sealed body with the newest key (key rotation).

    Raises ``UnreadableRecord`` if none of ``ENCRYPTION_KEYS`` decrypts it.
    """
    from cryptography.fernet import InvalidToken

    try:
        token = _fernet(idempotency_settings.ENCRYPTION_KEYS).rotate(_token(body))
    except InvalidToken as exc:
        raise UnreadableRecord("none of ENCRYPTION_KEYS decrypts the response") from exc
    return SEALED_PREFIX + token
