"""Reading the ``Idempotency-Key`` header."""

from __future__ import annotations

import re
from typing import cast

import http_sf

from django_idempotency.exceptions import KeyInvalid

__all__ = [
    "check_key",
    "parse_key",
]

_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


def _is_visible_ascii(text: str) -> bool:
    return _VISIBLE_ASCII.fullmatch(text) is not None


def parse_key(raw: str, max_length: int) -> str:
    """Return the key carried by a header value, or raise ``KeyInvalid``.

    The IETF draft defines the header as a Structured Field String
    (``"..."``, RFC 8941/9651); most clients send the bare key. Both are
    accepted: a quoted value is unquoted by ``http_sf``, a bare one is taken
    as it is. Either way the key must be 1 to ``max_length`` visible ASCII
    characters other than the comma, which keeps it printable in logs and
    the admin and tells it from two header lines joined.
    """
    value = raw.strip(" \t")
    if "," in value:
        # Servers join a header sent twice with commas: the lines '"k1' and
        # 'k2"' arrive as '"k1, k2"', one valid quoted string. Quoted or not
        # (a quoted string spells a comma as it is), a comma cannot tell one
        # key from two.
        raise KeyInvalid(
            "The Idempotency-Key holds a comma, which a key may not contain: a server joins "
            "an Idempotency-Key header sent twice into one value with commas, so a comma "
            "cannot tell one key from two. Send the header once, with one key."
        )
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
    if not value:
        raise KeyInvalid("The Idempotency-Key header is empty.")
    return check_key(value, max_length, "The Idempotency-Key")


def check_key(value: str, max_length: int, name: str) -> str:
    """Return ``value`` if it is a key (1 to ``max_length`` visible ASCII characters).

    The rules every key obeys, wherever it comes from (``key_sources``);
    ``name`` names its source in the refusal ("The X-GitHub-Delivery header").
    """
    if not value:
        raise KeyInvalid(f"{name} is empty.")
    if len(value) > max_length:
        raise KeyInvalid(f"{name} is longer than {max_length} characters.")
    if not _is_visible_ascii(value):
        raise KeyInvalid(
            f"{name} may contain only visible ASCII characters "
            "(no spaces, control characters or non-ASCII letters)."
        )
    return value
