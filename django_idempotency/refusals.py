"""How a refusal (``exceptions.IdempotencyRefusal``) becomes a response.

With ``IDEMPOTENCY["ERROR_FORMAT"] = "drf"`` (the default) the project's own
``REST_FRAMEWORK["EXCEPTION_HANDLER"]`` renders it, as if the view had
raised it: through the DRF view's ``handle_exception`` for DRF views, and
through the handler directly for plain Django views. With ``"problem"`` it
is an RFC 9457 problem details document (``application/problem+json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.template.response import SimpleTemplateResponse
from rest_framework.views import APIView

from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import IdempotencyRefusal

__all__ = ["CONTENT_TYPE", "problem_response", "render_refusal", "rendered"]

CONTENT_TYPE = "application/problem+json"


def render_refusal(
    request: HttpRequest, refusal: IdempotencyRefusal, *, drf_view: APIView | None = None
) -> HttpResponseBase:
    """The response a refusal gets, in the configured ``ERROR_FORMAT``."""
    if idempotency_settings.ERROR_FORMAT == "problem":
        return problem_response(refusal)
    with _transactions_left_alone(refusal):
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
    detail = refusal.detail["detail"] if isinstance(refusal.detail, dict) else refusal.detail
    body = {
        "type": idempotency_settings.PROBLEM_TYPE_BASE + code,
        "title": str(refusal.default_detail).split(".")[0] + ".",
        "status": refusal.status_code,
        "detail": str(detail),
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


@contextmanager
def _transactions_left_alone(refusal: IdempotencyRefusal) -> Iterator[None]:
    """Keep DRF's exception handler from dooming transactions a refusal did not open.

    DRF's handler marks the open atomic block of every ``ATOMIC_REQUESTS``
    database for rollback. A protected view opens none before its claim, so
    an open block is the caller's: ``TestCase``'s, pytest-django's
    ``django_db``, or an ``atomic()`` around the call. A refusal wrote
    nothing there, and must not make the caller's next query raise
    ``TransactionManagementError``. (One caused by a database error keeps
    the mark: that transaction may well be broken.)
    """
    marks = {
        connection.alias: connection.needs_rollback
        for connection in connections.all(initialized_only=True)
        if connection.in_atomic_block
    }
    try:
        yield
    finally:
        if not isinstance(refusal.__cause__, DatabaseError):
            for alias, mark in marks.items():
                connections[alias].needs_rollback = mark
