"""What is stored of a response, how it is replayed, and what a status means."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from django.http import HttpResponse, HttpResponseBase, StreamingHttpResponse

__all__ = [
    "BASE_HEADERS",
    "BODY_OMITTED_HEADER",
    "REPLAYED_HEADER",
    "RETENTION_HEADER",
    "RETRYABLE_STATUSES",
    "StoredResponse",
    "Verdict",
    "capture",
    "replay",
    "verdict_of",
]

logger = logging.getLogger("django_idempotency")

BASE_HEADERS = ("Content-Type", "Location")
"""Response headers always stored (when the view set them), beside ``STORED_HEADERS``."""

REPLAYED_HEADER = "Idempotent-Replayed"
"""Set to ``true`` on every replayed response."""

RETENTION_HEADER = "Idempotency-Key-Expires-In"
"""Seconds for which a retry with the same key still gets this outcome (``ADVERTISE_RETENTION``)."""

BODY_OMITTED_HEADER = "Idempotent-Body-Omitted"
"""Set to ``true`` on a replay whose body was not stored (too large, or streamed)."""

RETRYABLE_STATUSES = frozenset({408, 409, 423, 425, 429})
"""Statuses that say "try again": the claim is released, nothing is stored."""


class Verdict(enum.Enum):
    """What a view's status means for its record (``verdict_of``).

    Not the record's ``State`` (five values, the stored fact), nor a
    reconciler's outcome (``recovery.Completed`` and the rest, the answer
    about an external call): the two stored verdicts are named for the
    states they store.
    """

    COMPLETED = "COMPLETED"  # stored and replayed
    FAILED = "FAILED"  # a definitive 4xx: stored and replayed
    RELEASE = "RELEASE"  # retryable: claim released, local writes rolled back
    #: Not known: local writes rolled back, the record left UNCERTAIN for a
    #: reconciler (as after begin_external()); only an outcome policy says so.
    UNCERTAIN = "UNCERTAIN"


def verdict_of(status: int) -> Verdict:
    """Whether an answer with this status is stored, as COMPLETED or FAILED, or released.

    The standard outcome policy's table (``outcomes.standard``): 5xx and
    ``RETRYABLE_STATUSES`` release the claim; any other 4xx is a definitive
    failure, stored and replayed; the rest is stored as COMPLETED.
    """
    if status >= 500 or status in RETRYABLE_STATUSES:
        return Verdict.RELEASE
    if status >= 400:
        return Verdict.FAILED
    return Verdict.COMPLETED


@dataclass(frozen=True)
class StoredResponse:
    """What is stored of a response, and what a ``REDACT`` hook is given and returns.

    ``headers`` are ``[name, value]`` pairs (those of ``BASE_HEADERS`` and
    ``STORED_HEADERS`` the response carried); return a copy with
    ``dataclasses.replace(stored, body=...)``.
    """

    status: int
    headers: list[list[str]]
    #: ``None`` when the body was too large (or streamed) to store.
    body: bytes | None


def capture(
    response: HttpResponseBase, extra_headers: Iterable[str], max_body: int
) -> StoredResponse:
    stored = response.headers
    headers = []
    for name in (*BASE_HEADERS, *extra_headers):
        value = stored.get(name)  # one lookup, where ``in`` and [] were two
        if value is not None:
            headers.append([name, value])
    if isinstance(response, StreamingHttpResponse) or not isinstance(response, HttpResponse):
        logger.warning(
            "A streaming response cannot be stored for replay; replays will carry "
            "status %s and headers only.",
            response.status_code,
        )
        return StoredResponse(response.status_code, headers, None)
    body = response.content
    if len(body) > max_body:
        logger.warning(
            "Response body of %d bytes exceeds IDEMPOTENCY['MAX_STORED_BODY'] = %d; "
            "replays will carry status %s and headers only.",
            len(body),
            max_body,
            response.status_code,
        )
        return StoredResponse(response.status_code, headers, None)
    return StoredResponse(response.status_code, headers, body)


def replay(status: int, headers: list[list[str]], body: bytes | None) -> HttpResponse:
    # The stored bytes as they are (bytes, or a memoryview, which the
    # response copies once); the stored Content-Type given to the
    # constructor, so that no default is built to be replaced.
    content_type = None
    at = -1
    for index, (name, value) in enumerate(headers):
        if name.lower() == "content-type":
            content_type, at = value, index
            break
    response = HttpResponse(b"" if body is None else body, status=status, content_type=content_type)
    if content_type is None:
        del response["Content-Type"]  # the default HttpResponse added: none was stored
    for index, (name, value) in enumerate(headers):
        if index != at:
            response[name] = value
    response[REPLAYED_HEADER] = "true"
    if body is None:
        response[BODY_OMITTED_HEADER] = "true"
    return response
