"""What the operation status view answers about a record, and its serializers.

The serializers are both the renderer of the answers and their OpenAPI
schema (``openapi_status.py``), so the two cannot drift apart.

A stored body is given in the form a client can use at once, and says which
(``body_encoding``):

- ``"json"``: the stored ``Content-Type`` is JSON (``application/json`` or
  ``*/*+json``) and the body parses as such: the parsed value. Equal to the
  original as JSON, not byte for byte (a replay of the request itself gives
  the bytes);
- ``"text"``: a textual media type (``text/*``, XML, form data, or JSON that
  does not parse), decoded with its ``charset`` (UTF-8 if none), and an
  empty body of any type;
- ``"base64"``: anything else (an image, a PDF, text in an unknown
  charset), the bytes in standard base64;
- ``"omitted"``: the body was not stored (larger than ``MAX_STORED_BODY``,
  or streamed); ``body`` is null.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from django.utils.http import parse_header_parameters
from django.utils.translation import gettext_lazy as _
from rest_framework import serializers

from django_idempotency.models import IdempotencyRecord

__all__ = [
    "BODY_ENCODINGS",
    "BodyEncodingField",
    "OperationChoicesSerializer",
    "OperationStatusSerializer",
    "StateField",
    "StoredAnswerSerializer",
    "encode_body",
    "status_of",
]

BODY_ENCODINGS = ("json", "text", "base64", "omitted")
"""The values of ``body_encoding`` in a stored response's description."""

#: Textual media types that neither start with ``text/`` nor end with ``+xml``.
_TEXTUAL = frozenset(
    {"application/xml", "application/x-www-form-urlencoded", "application/javascript"}
)


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are no JSON a client could take: the body goes as text.
    raise ValueError(f"{name} is not JSON")


def encode_body(headers: list[list[str]], body: bytes | None) -> tuple[str, Any]:
    """``(body_encoding, body)`` for a stored body and the stored headers."""
    if body is None:
        return "omitted", None
    if not body:
        return "text", ""
    content_type = next((value for name, value in headers if name.lower() == "content-type"), "")
    media_type, parameters = parse_header_parameters(content_type)
    is_json = media_type == "application/json" or media_type.endswith("+json")
    if is_json:
        try:
            return "json", json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
        except (UnicodeDecodeError, ValueError, RecursionError):
            pass  # as text, if it decodes
    if (
        is_json
        or media_type.startswith("text/")
        or media_type.endswith("+xml")
        or (media_type in _TEXTUAL)
    ):
        try:
            return "text", body.decode(parameters.get("charset") or "utf-8")
        except (LookupError, UnicodeDecodeError):
            pass
    return "base64", base64.b64encode(body).decode("ascii")


def status_of(
    record: IdempotencyRecord,
    *,
    expired: bool,
    stored: tuple[list[list[str]], bytes | None] | None,
) -> dict[str, Any]:
    """The answer about ``record``: ``stored`` is its unsealed (headers, body) if resolved."""
    response = None
    if stored is not None and not expired:
        headers, body = stored
        encoding, shown = encode_body(headers, body)
        response = {
            "status": record.response_status,
            "headers": {name: value for name, value in headers},
            "body_encoding": encoding,
            "body": shown,
        }
    return {
        "key": record.key,
        "operation": record.operation,
        "state": record.state,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "expired": expired,
        "response": response,
    }


class StateField(serializers.ChoiceField):
    """A record's state.

    A class of its own so that the OpenAPI schema gives its values inline
    (``openapi_status``): as drf-spectacular's named ``StateEnum`` it would
    collide with the ``state`` fields of the project's own API, and rename
    their components.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(choices=IdempotencyRecord.State.choices, **kwargs)


class BodyEncodingField(serializers.ChoiceField):
    """How a stored body is given (``BODY_ENCODINGS``); inline in the schema, as ``StateField``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(choices=BODY_ENCODINGS, **kwargs)


class StoredAnswerSerializer(serializers.Serializer[dict[str, Any]]):
    """The stored response of a COMPLETED or FAILED operation, as a retry would be answered."""

    status = serializers.IntegerField(help_text=_("The stored HTTP status."))
    headers = serializers.DictField(
        child=serializers.CharField(),
        help_text=_(
            "The stored headers: Content-Type and Location when the view set them, and "
            "those of IDEMPOTENCY['STORED_HEADERS']."
        ),
    )
    body_encoding = BodyEncodingField(
        help_text=_(
            "How body is given: json, the parsed JSON value; text, the decoded text; "
            "base64, the bytes in base64; omitted, the body was not stored (too large, or "
            "streamed) and body is null."
        ),
    )
    body = serializers.JSONField(
        allow_null=True, help_text=_("The stored body, as body_encoding says.")
    )


class OperationStatusSerializer(serializers.Serializer[dict[str, Any]]):
    """What is known of one operation of the caller's."""

    key = serializers.CharField(help_text=_("The Idempotency-Key."))
    operation = serializers.CharField(help_text=_("The operation's name on this server."))
    state = StateField(
        help_text=_(
            "CLAIMED or IN_PROGRESS: it runs, wait. UNCERTAIN: the server is finding out "
            "whether an external call happened, wait. COMPLETED or FAILED: the outcome is in "
            "response."
        ),
    )
    created_at = serializers.DateTimeField(help_text=_("When the first request claimed the key."))
    expires_at = serializers.DateTimeField(
        help_text=_(
            "When a COMPLETED or FAILED outcome stops being replayed (for an expired key "
            "whose record is kept as a tombstone: when that goes)."
        )
    )
    expired = serializers.BooleanField(
        help_text=_(
            "The outcome's retention is over: response is null. A retry with this key is "
            "refused (idempotency_key_expired) while a tombstone is kept, else runs anew."
        )
    )
    response = StoredAnswerSerializer(
        allow_null=True,
        help_text=_("The stored response once COMPLETED or FAILED and not expired; else null."),
    )


class OperationChoicesSerializer(serializers.Serializer[dict[str, Any]]):
    """The key names several operations of the caller's: ask again with one of them."""

    detail = serializers.CharField()
    code = serializers.CharField()
    operations = serializers.ListField(
        child=serializers.CharField(),
        help_text=_("The operations holding this key; pass one as the operation parameter."),
    )
