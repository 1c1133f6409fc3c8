"""What protection adds to an operation's OpenAPI description, in words and headers.

Shared by the two schema integrations, drf-spectacular's (``_openapi``) and
Django Ninja's (``_ninja.schema``), so that a DRF and a Ninja operation
describe the same header, the same refusals and the same response headers
in the same words. Plain data: neither library is imported here.
"""

from __future__ import annotations

import copy
from typing import Any

from django_idempotency.conf import idempotency_settings
from django_idempotency.responses import REPLAYED_HEADER, RETENTION_HEADER, RETRYABLE_STATUSES

#: The refusals a protected operation may answer with, by status.
REFUSALS = {
    "400": "Idempotency-Key missing (idempotency_key_missing) or malformed "
    "(idempotency_key_invalid), or a body with no canonical form (parse_error).",
    "409": "A request with this Idempotency-Key is still in progress "
    "(idempotency_request_in_progress); retry after Retry-After.",
    "422": "This Idempotency-Key was used with a different request (idempotency_key_reused), "
    "or its request's outcome is past retention (idempotency_key_expired).",
    "413": "The request body is larger than an idempotent request may be "
    "(idempotency_body_too_large).",
    "503": "The idempotency record store is unreachable (idempotency_store_unavailable): "
    "the request was not run; or the request was run and its outcome is not known yet "
    "(idempotency_outcome_uncertain): retry with the same key to learn it. Retry after "
    "Retry-After.",
}

REPLAYED = {
    "description": "true when this is the stored response of an earlier request with the "
    "same Idempotency-Key and input, replayed; absent on a first execution.",
    "schema": {"type": "string", "enum": ["true"]},
}
RETENTION = {
    "description": "For how many more seconds (counted from this response) a retry with the "
    "same Idempotency-Key and input is answered with this outcome.",
    "schema": {"type": "integer", "minimum": 0},
}
RETRY_AFTER = {
    "description": "Seconds to wait before retrying with the same Idempotency-Key.",
    "schema": {"type": "integer", "minimum": 0},
}
#: Statuses answered with Retry-After: a request in flight, a store unavailable.
RETRY_AFTER_STATUSES = ("409", "503")


#: Added to the key's description where the server leaves anonymous callers
#: unprotected (the middleware, without ``TENANT``) and they reach the operation.
ANONYMOUS_UNPROTECTED = (
    " Requests without authentication are not protected: they run without reading this "
    "header, and a retry runs again. Authenticated callers are protected."
)


def key_description(*, anonymous_unprotected: bool = False) -> str:
    """The description of the key header parameter.

    ``anonymous_unprotected``: the operation runs anonymous callers'
    requests unprotected, and says so.
    """
    description = (
        "A unique key for this operation (a UUID is a good choice). Retries with the same "
        "key and input get the original response, marked Idempotent-Replayed: true; the "
        f"operation runs once. At most {idempotency_settings.KEY_MAX_LENGTH} visible ASCII "
        "characters."
    )
    return description + ANONYMOUS_UNPROTECTED if anonymous_unprotected else description


def may_be_replayed(code: str) -> bool:
    """Whether a response of this status may be stored, and so replayed."""
    if code.isdigit():
        number = int(code)
        return number < 500 and number not in RETRYABLE_STATUSES
    return code[:1] in ("2", "3", "4")  # "2XX" and the like; not "default"


def headers_for(code: str) -> dict[str, Any]:
    """The response headers protection may add to a response of status ``code``."""
    added: dict[str, Any] = {}
    if may_be_replayed(code):
        added[REPLAYED_HEADER] = REPLAYED
        if idempotency_settings.ADVERTISE_RETENTION:
            added[RETENTION_HEADER] = RETENTION
    if code in RETRY_AFTER_STATUSES:
        added["Retry-After"] = RETRY_AFTER
    # Copies: a YAML dump would write an object met twice as an alias.
    return copy.deepcopy(added)
