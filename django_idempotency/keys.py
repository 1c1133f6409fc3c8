"""Reading the ``Idempotency-Key`` header."""

from __future__ import annotations

import re
from typing import cast

import http_sf

from django_idempotency.exceptions import KeyInvalid

_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def _is_visible_ascii(text: str) -> bool:
    return _VISIBLE_ASCII.fullmatch(text) is not None


def parse_key(raw: str, max_length: int) -> str:
    """Return the key carried by a header value, or raise ``KeyInvalid``.

    The IETF draft defines the header as a Structured Field String
    (``"..."``, RFC 8941/9651); most clients send the bare key. Both are
    accepted: a quoted value is unquoted by ``http_sf``, a bare one is taken
    as it is. Either way the key must be 1 to ``max_length`` visible ASCII
    characters, which keeps it printable in logs and the admin.
    """
    value = raw.strip(" \t")
    if value.startswith('"'):
        try:
            parsed, params = cast(
                "tuple[object, dict[str, object]]",
                http_sf.parse(value.encode("latin-1"), tltype="item"),
            )
        except (http_sf.StructuredFieldError, UnicodeEncodeError, ValueError) as exc:
            raise KeyInvalid(f"The quoted Idempotency-Key is malformed: {exc}.") from exc
        if not isinstance(parsed, str) or params:
            raise KeyInvalid("A quoted Idempotency-Key must be a plain string.")
        value = parsed
    elif "," in value:
        # Servers join a header sent twice with commas: two keys, not one.
        raise KeyInvalid(
            "The Idempotency-Key header holds a comma: send the header once, with one "
            'key (quote it, "...", if the key itself contains a comma).'
        )
    if not value:
        raise KeyInvalid("The Idempotency-Key header is empty.")
    if len(value) > max_length:
        raise KeyInvalid(f"The Idempotency-Key is longer than {max_length} characters.")
    if not _is_visible_ascii(value):
        raise KeyInvalid(
            "The Idempotency-Key may contain only visible ASCII characters "
            "(no spaces, control characters or non-ASCII letters)."
        )
    return value
