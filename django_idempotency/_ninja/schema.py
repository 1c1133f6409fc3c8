"""A protected Ninja operation documents itself: the key header and the refusals.

Ninja merges an operation's ``openapi_extra`` into the operation's schema
(dicts merged, lists extended), so protection adds to it what the
drf-spectacular integration adds to a DRF operation, in the same words
(``_schema_parts``): the ``Idempotency-Key`` header parameter, the 400,
409, 413, 422 and 503 refusals the operation does not describe itself, and
the headers its responses may carry (``Idempotent-Replayed`` on statuses
that may be replays, ``Retry-After`` on 409 and 503). The operation's own
descriptions win. Written when the protection is installed (as the API's
module is imported), from the settings then.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from django_idempotency._protection.flow import Options
from django_idempotency._schema_parts import REFUSALS, headers_for, key_description
from django_idempotency.conf import idempotency_settings

_TEXT = {"type": "string"}
_ERROR = {
    "type": "object",
    "properties": {"detail": _TEXT, "code": _TEXT},
    "required": ["detail", "code"],
}
# Ninja's own 422 (input that fails validation) has a list as its detail,
# and the operation's own 400s have a shape of their own: only detail is sure.
_ERROR_OR_VALIDATION = {
    "type": "object",
    "properties": {"detail": {}, "code": _TEXT},
    "required": ["detail"],
}
_PROBLEM = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": _TEXT,
        "status": {"type": "integer"},
        "detail": _TEXT,
        "code": _TEXT,
    },
    "required": ["type", "title", "status", "detail", "code"],
}


def documented(
    own: dict[str, Any] | None,
    options: Options,
    declared: Iterable[object],
    *,
    anonymous_unprotected: bool = False,
) -> dict[str, Any]:
    """``own`` (the operation's ``openapi_extra``) with what protection adds to its schema.

    ``declared``: the statuses the operation's ``response=`` describes.
    ``anonymous_unprotected``: anonymous requests reach the operation and run
    unprotected, keyless or not: the key is not required, and its
    description says so.
    """
    extra = copy.deepcopy(own) if own else {}
    header = options.key.header
    if header is not None:
        parameters = list(extra.get("parameters") or [])
        if not any(_names_header(parameter, header) for parameter in parameters):
            parameters.append(_key_parameter(header, options, anonymous_unprotected))
        extra["parameters"] = parameters
    statuses = {status for status in declared if isinstance(status, int)}
    responses: dict[Any, Any] = dict(extra.get("responses") or {})
    problem = idempotency_settings.ERROR_FORMAT == "problem"
    for code, description in REFUSALS.items():
        status = int(code)
        if status in statuses or status in responses or code in responses:
            continue  # the operation describes this status itself
        schema = _PROBLEM if problem else _ERROR
        if code in ("400", "422") and not problem:
            schema = _ERROR_OR_VALIDATION
        media_type = "application/problem+json" if problem else "application/json"
        responses[status] = {
            "description": description,
            "content": {media_type: {"schema": copy.deepcopy(schema)}},
        }
        statuses.add(status)
    for status in sorted(statuses):
        added = headers_for(str(status))
        if added:
            response = dict(responses.get(status) or {})
            response["headers"] = {**added, **(response.get("headers") or {})}
            responses[status] = response
    extra["responses"] = responses
    return extra


def _names_header(parameter: object, header: str) -> bool:
    return (
        isinstance(parameter, dict)
        and parameter.get("in") == "header"
        and str(parameter.get("name", "")).lower() == header.lower()
    )


def _key_parameter(header: str, options: Options, anonymous_unprotected: bool) -> dict[str, Any]:
    conf = idempotency_settings
    required = options.required if options.required is not None else conf.REQUIRED
    return {
        "in": "header",
        "name": header,
        # "Required" promises a 400 to a keyless request: not where it runs unprotected.
        "required": required and not anonymous_unprotected,
        "schema": {"type": "string", "maxLength": conf.KEY_MAX_LENGTH},
        "description": key_description(anonymous_unprotected=anonymous_unprotected),
    }
