"""What a refused request to a Ninja operation gets, the way Ninja answers errors.

Ninja answers an error as JSON ``{"detail": ...}`` rendered by the API's
renderer; a refusal is that plus the stable ``code`` the DRF path gives,
with the same status and the same ``Retry-After``. A project that wants
its own shape registers a handler, Ninja's way:
``@api.exception_handler(IdempotencyRefusal)``. With
``IDEMPOTENCY["ERROR_FORMAT"] = "problem"`` it is the same RFC 9457
document as everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from django_idempotency._protection.answers import problem_response, refusal_detail
from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase
    from ninja import NinjaAPI

    from django_idempotency.exceptions import IdempotencyRefusal


def refusal_response(
    api: NinjaAPI, request: HttpRequest, refusal: IdempotencyRefusal
) -> HttpResponseBase:
    """The response to ``refusal`` from an operation of ``api``."""
    if idempotency_settings.ERROR_FORMAT == "problem":
        return problem_response(refusal)
    handler = _projects_handler(api, refusal)
    if handler is not None:
        response = handler(request, refusal)
    else:
        detail = refusal_detail(refusal)
        body = {"detail": str(detail), "code": refusal.default_code}
        response = api.create_response(request, body, status=refusal.status_code)
    wait = getattr(refusal, "wait", None)
    if wait and not response.has_header("Retry-After"):
        # Part of the answer whatever renders it: when to retry with the same key.
        response["Retry-After"] = str(wait)
    return response


def _projects_handler(
    api: NinjaAPI, refusal: IdempotencyRefusal
) -> Callable[[HttpRequest, Exception], HttpResponseBase] | None:
    """The handler the project registered for this refusal's class or a base of it, if any.

    Not Ninja's catch-all for ``Exception``, which answers 500 (or re-raises):
    a refusal is an answer, not an error of the view's.
    """
    # Ninja keeps the registered handlers by class; it offers no lookup that
    # stops short of its catch-all.
    handlers: dict[type, Any] = getattr(api, "_exception_handlers", {})
    for cls in type(refusal).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return cast("Callable[[HttpRequest, Exception], HttpResponseBase]", handlers[cls])
    return None
