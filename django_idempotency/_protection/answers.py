"""What a request that does not get to run the view is answered.

A replay or 422 for a settled record (422 too for one past retention kept
as a tombstone), 409 while another request holds the key, 503 while its
record is UNCERTAIN, 503 (or, with ``FAIL_OPEN``, an unprotected run) when
the store cannot be reached.

A refusal (``exceptions.IdempotencyRefusal``) becomes a response here too.
With ``IDEMPOTENCY["ERROR_FORMAT"] = "drf"`` (the default) the project's own
``REST_FRAMEWORK["EXCEPTION_HANDLER"]`` renders it, as if the view had
raised it: through the DRF view's ``handle_exception`` for DRF views, and
through the handler directly for plain Django views. With ``"problem"`` it
is an RFC 9457 problem details document (``application/problem+json``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

from django.db import InterfaceError, OperationalError

from django_idempotency import _store as store
from django_idempotency._observability.tracing import step_span
from django_idempotency._protection.outcome import Tally
from django_idempotency._protection.retention import advertise_replay
from django_idempotency._protection.transactions import (
    callers_transactions_left_alone,
    run_unprotected,
)
from django_idempotency._store.database_time import time_left
from django_idempotency._store.digests import Fingerprint
from django_idempotency._store.sealing import UnreadableRecord, unseal
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import (
    UNREADABLE_RECORD,
    KeyExpired,
    KeyReused,
    OutcomeUncertain,
    RequestInProgress,
    StoreUnavailable,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import replay

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase
import json
from typing import Any, cast

from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from rest_framework.views import APIView

from django_idempotency.exceptions import IdempotencyRefusal

logger = logging.getLogger("django_idempotency")

#: Errors of the claim or the lookup that mean "the record store cannot be
#: reached" (unless they are mere contention, see ``database_errors``), as
#: opposed to a bug or a missing migration, which should surface as they are.
UNREACHABLE_ERRORS = (OperationalError, InterfaceError)

#: ``Retry-After`` seconds: a request in flight is usually done within one;
#: an unreachable store may take longer to come back.
IN_FLIGHT_RETRY_AFTER = 1
UNAVAILABLE_RETRY_AFTER = 5


#: An UNCERTAIN record's ``Retry-After`` is the time until recovery next asks
#: its reconciler (its lease's end), within these bounds. At least a few
#: seconds: one whose lease has ended waits for recovery's next run (every
#: minute with ``BEAT_SCHEDULE``), and clients that obey the header must
#: not poll every second through a provider's outage. At most an hour: an
#: operator may settle it long before a reconciler's ``Retry(after=...)``.
UNCERTAIN_RETRY_AFTER_MIN = 5
UNCERTAIN_RETRY_AFTER_MAX = 3600


def in_flight(tally: Tally, *, state: str, cause: BaseException | None = None) -> NoReturn:
    """Refuse with 409: another request holds the key (``state`` says how)."""
    tally.in_flight_state = state
    raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER) from cause


def held(tally: Tally, record: IdempotencyRecord) -> NoReturn:
    """Refuse a retry of the same input while ``record`` is unresolved.

    A record left UNCERTAIN is running no more: its outcome is unknown
    until recovery (or an operator) settles it, so the answer is the
    unknown outcome's 503, not "still being processed".
    """
    if record.state == IdempotencyRecord.State.UNCERTAIN:
        raise OutcomeUncertain(retry_after=until_recovery(record))
    in_flight(tally, state=record.state)


def until_recovery(record: IdempotencyRecord) -> int:
    """Whole seconds, within bounds, from the lookup that read ``record`` to its lease's end.

    Judged at ``record.read_at``, the database's time of that lookup (this
    host's where the database's clock is this host's, on SQLite).
    """
    lease_left = timedelta(0)
    if record.lease_expires_at is not None:
        lease_left = time_left(record, record.lease_expires_at)
    seconds = math.ceil(lease_left.total_seconds())
    return min(max(seconds, UNCERTAIN_RETRY_AFTER_MIN), UNCERTAIN_RETRY_AFTER_MAX)


def answer_settled(
    tally: Tally,
    fingerprint: Fingerprint,
    record: IdempotencyRecord,
    *,
    matched: bool | None = None,
) -> HttpResponseBase:
    """The answer a settled record gives: 422 for other input, else its replay.

    Past retention, with ``TOMBSTONE_TTL``, a retry of the same input is
    refused as ``idempotency_key_expired`` instead: the response is gone,
    or is due to be, and the operation is never run a second time.
    """
    scope = tally.scope
    assert scope is not None
    if matched is None:  # ``matched``: what the caller found comparing them already
        matched = fingerprint.matches(record.fingerprint)
    if not matched:
        raise KeyReused.from_source(tally.key_source)
    if store.kept_as_tombstone(record):
        logger.info("Refused a retry of %s: past retention, kept as a tombstone.", scope)
        raise KeyExpired.from_source(tally.key_source)
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
        tally.replayed = True
        tally.replayed_status = record.response_status
        return advertise_replay(replay(record.response_status or 200, headers, body), record)


def store_unavailable(
    tally: Tally, view: Callable[[], HttpResponseBase], exc: Exception
) -> HttpResponseBase:
    fail_open = idempotency_settings.FAIL_OPEN
    scope = tally.scope
    tally.store_unreachable = True
    tally.fail_open = fail_open
    if fail_open:
        logger.warning(
            "Idempotency store unreachable (%s); FAIL_OPEN runs %s unprotected.",
            exc,
            scope,
        )
        return run_unprotected(view)
    logger.error("Idempotency store unreachable (%s); refusing %s with 503.", exc, scope)
    raise StoreUnavailable(retry_after=UNAVAILABLE_RETRY_AFTER) from exc


CONTENT_TYPE = "application/problem+json"


def render_refusal(
    request: HttpRequest, refusal: IdempotencyRefusal, *, drf_view: APIView | None = None
) -> HttpResponseBase:
    """The response a refusal gets, in the configured ``ERROR_FORMAT``."""
    if idempotency_settings.ERROR_FORMAT == "problem":
        return problem_response(refusal)
    with callers_transactions_left_alone(refusal):
        if drf_view is not None:
            return drf_view.handle_exception(refusal)
        return _handled_by_drf(request, refusal)


def rendered(response: HttpResponseBase) -> HttpResponseBase:
    """``response`` with its body rendered (a template or DRF response), else as is."""
    if isinstance(response, SimpleTemplateResponse):
        response.render()
    return response


def problem_response(refusal: IdempotencyRefusal) -> HttpResponse:
    """The refusal as an RFC 9457 problem details document."""
    code = refusal.default_code
    body = {
        "type": idempotency_settings.PROBLEM_TYPE_BASE + code,
        "title": str(refusal.default_detail).split(".")[0] + ".",
        "status": refusal.status_code,
        "detail": refusal.message,
        "code": code,
    }
    response = HttpResponse(json.dumps(body), status=refusal.status_code, content_type=CONTENT_TYPE)
    wait = getattr(refusal, "wait", None)
    if wait:
        response["Retry-After"] = str(wait)
    return response


def _handled_by_drf(request: HttpRequest, exc: IdempotencyRefusal) -> HttpResponseBase:
    """Render a refusal for a plain Django view with the project's DRF handler."""
    from rest_framework.renderers import JSONRenderer
    from rest_framework.response import Response
    from rest_framework.settings import api_settings

    context: dict[str, Any] = {"request": request, "view": None, "args": (), "kwargs": {}}
    handler = cast(Callable[..., Response | None], api_settings.EXCEPTION_HANDLER)
    response = handler(exc, context)
    if response is None:
        response = Response(exc.detail, status=exc.status_code)
    response.accepted_renderer = JSONRenderer()
    response.accepted_media_type = "application/json"
    response.renderer_context = context  # type: ignore[attr-defined]
    return rendered(response)
