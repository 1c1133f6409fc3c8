"""What a request that does not get to run the view is answered.

A replay or 422 for a settled record (422 too for one past retention kept
as a tombstone), 409 while another request holds the key, 503 (or, with
``FAIL_OPEN``, an unprotected run) when the store cannot be reached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from django.db import InterfaceError, OperationalError

from django_idempotency import signals, store
from django_idempotency.conf import idempotency_settings
from django_idempotency.digests import Fingerprint
from django_idempotency.exceptions import (
    UNREADABLE_RECORD,
    KeyExpired,
    KeyReused,
    RequestInProgress,
    StoreUnavailable,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import replay
from django_idempotency.retention_header import advertise_replay
from django_idempotency.scope import Scope
from django_idempotency.store.sealing import UnreadableRecord, unseal
from django_idempotency.tracing import step_span
from django_idempotency.view_transactions import run_unprotected

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

__all__ = [
    "IN_FLIGHT_RETRY_AFTER",
    "UNAVAILABLE_RETRY_AFTER",
    "UNREACHABLE_ERRORS",
    "answer_settled",
    "in_flight",
    "store_unavailable",
]

logger = logging.getLogger("django_idempotency")

#: Errors of the claim or the lookup that mean "the record store cannot be
#: reached" (unless they are mere contention, see ``database_errors``), as
#: opposed to a bug or a missing migration, which should surface as they are.
UNREACHABLE_ERRORS = (OperationalError, InterfaceError)

#: ``Retry-After`` seconds: a request in flight is usually done within one;
#: an unreachable store may take longer to come back.
IN_FLIGHT_RETRY_AFTER = 1
UNAVAILABLE_RETRY_AFTER = 5


def in_flight(
    request: HttpRequest, scope: Scope, *, state: str, cause: BaseException | None = None
) -> NoReturn:
    """Refuse with 409: another request holds the key (``state`` says how)."""
    signals.notify(signals.request_in_flight, request, scope, state=state)
    raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER) from cause


def answer_settled(
    request: HttpRequest, scope: Scope, fingerprint: Fingerprint, record: IdempotencyRecord
) -> HttpResponseBase:
    """The answer a settled record gives: 422 for other input, else its replay.

    Past retention, with ``TOMBSTONE_TTL``, a retry of the same input is
    refused as ``idempotency_key_expired`` instead: the response is gone,
    or is due to be, and the operation is never run a second time.
    """
    if not fingerprint.matches(record.fingerprint):
        signals.notify(signals.key_reused, request, scope)
        raise KeyReused()
    if store.kept_as_tombstone(record):
        logger.info("Refused a retry of %s: past retention, kept as a tombstone.", scope)
        signals.notify(signals.key_expired, request, scope)
        raise KeyExpired()
    with step_span("idempotency.replay", scope) as span:
        span.set_attribute("http.response.status_code", record.response_status or 200)
        try:
            headers, body = unseal(
                record.response_headers, record.response_body, sealed=record.response_sealed
            )
        except UnreadableRecord as exc:
            logger.error("Cannot replay record %s (%s): %s", record.pk, scope, exc)
            raise StoreUnavailable(
                str(UNREADABLE_RECORD), retry_after=UNAVAILABLE_RETRY_AFTER
            ) from exc
        signals.notify(signals.response_replayed, request, scope, status=record.response_status)
        return advertise_replay(replay(record.response_status or 200, headers, body), record)


def store_unavailable(
    request: HttpRequest,
    scope: Scope,
    view: Callable[[], HttpResponseBase],
    exc: Exception,
) -> HttpResponseBase:
    fail_open = idempotency_settings.FAIL_OPEN
    signals.notify(signals.store_unavailable, request, scope, fail_open=fail_open)
    if fail_open:
        logger.warning(
            "Idempotency store unreachable (%s); FAIL_OPEN runs %s unprotected.",
            exc,
            scope,
        )
        return run_unprotected(view)
    logger.error("Idempotency store unreachable (%s); refusing %s with 503.", exc, scope)
    raise StoreUnavailable(retry_after=UNAVAILABLE_RETRY_AFTER) from exc
