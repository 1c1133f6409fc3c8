"""``IdempotencyMiddleware``: the unsafe requests of a whole API protected, without a decorator.

Add it last to ``MIDDLEWARE``::

    MIDDLEWARE = [
        ...,
        "django_idempotency.middleware.IdempotencyMiddleware",
    ]

It protects the POST, PUT, PATCH and DELETE handlers of every DRF view the
URLconf routes (views, generic views, viewsets, ``@api_view`` functions),
and plain Django views only under ``IDEMPOTENCY["MIDDLEWARE_PLAIN_VIEW_PREFIXES"]``.
See docs/middleware.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponseBase

from django_idempotency._middleware import keyless
from django_idempotency._middleware.coverage import sends_no_key
from django_idempotency._middleware.frameworks import routed_view
from django_idempotency._protection.flow import PROTECTED_METHODS
from django_idempotency.conf import idempotency_settings

__all__ = ["IdempotencyMiddleware"]


class IdempotencyMiddleware:
    """Protect every DRF view's unsafe handlers, and plain views under configured prefixes.

    DRF views are protected as ``IdempotentMixin`` protects them: the claim
    comes after DRF's authentication, permissions and throttles. A view
    with its own ``@idempotent`` or ``IdempotentMixin`` keeps its options
    and is protected once. Left alone: ``idempotent_exempt`` views, views
    that issue credentials (DRF's ``ObtainAuthToken``), anonymous requests
    unless ``IDEMPOTENCY["TENANT"]`` is set, and safe methods.

    ``IDEMPOTENCY["MIDDLEWARE_KEYS"]``: ``"report"`` (the default) lets a
    request without a key run unprotected, counting and logging it;
    ``"required"`` refuses it with 400 ``idempotency_key_missing``.

    It must be last in ``MIDDLEWARE`` (check ``django_idempotency.E050``):
    it answers a protected request from ``process_view``, by running the
    view itself, so a later middleware's ``process_view`` would not run.
    """

    sync_capable = True
    async_capable = False
    #: Recognised in ``MIDDLEWARE`` by the checks and ``idempotency_routes``, subclasses too.
    idempotency_middleware = True

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        keyless.report(request, response)
        return response

    def process_view(
        self,
        request: HttpRequest,
        view_func: Callable[..., Any],
        view_args: tuple[Any, ...],
        view_kwargs: dict[str, Any],
    ) -> HttpResponseBase | None:
        """Run a protected view here; None: Django runs the view as routed."""
        if request.method not in PROTECTED_METHODS:
            return None
        routed = routed_view(view_func)
        if not routed.coverage(request.method, request.path_info).by_middleware:
            return None
        if routed.left_alone(request):
            return None
        if sends_no_key(request) and idempotency_settings.MIDDLEWARE_KEYS == "report":
            keyless.note(request)
            return None
        return routed.protected()(request, *view_args, **view_kwargs)
