"""``IdempotencyMiddleware``: the unsafe requests of a whole API protected, without a decorator.

Add it last to ``MIDDLEWARE``::

    MIDDLEWARE = [
        ...,
        "django_idempotency.middleware.IdempotencyMiddleware",
    ]

It protects the POST, PUT, PATCH and DELETE handlers of every DRF view the
URLconf routes (views, generic views, viewsets, ``@api_view`` functions,
adrf's async ones too) and of every Django Ninja operation, and plain
Django views only under ``IDEMPOTENCY["MIDDLEWARE_PLAIN_VIEW_PREFIXES"]``.
See docs/middleware.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponseBase

from django_idempotency._middleware import keyless
from django_idempotency._middleware.coverage import RoutedView, sends_no_key
from django_idempotency._middleware.frameworks import prepare, routed_view
from django_idempotency._protection.flow import PROTECTED_METHODS
from django_idempotency.conf import idempotency_settings

__all__ = ["IdempotencyMiddleware"]


class IdempotencyMiddleware:
    """Protect the unsafe handlers of every DRF view and Ninja operation, plain views by prefix.

    DRF views are protected as ``IdempotentMixin`` protects them: the claim
    comes after DRF's authentication, permissions and throttles. adrf's
    async views are protected too, their claim run off the event loop.
    Django Ninja's operations as ``django_idempotency.ninja.idempotent``
    protects them: after Ninja's authentication, throttles and validation. A
    view with its own ``@idempotent`` or ``IdempotentMixin`` keeps its
    options and is protected once. Left alone: ``idempotent_exempt`` views,
    views that issue credentials (DRF's ``ObtainAuthToken``), anonymous
    requests unless ``IDEMPOTENCY["TENANT"]`` is set, and safe methods.

    ``IDEMPOTENCY["MIDDLEWARE_KEYS"]``: ``"report"`` (the default) lets a
    request without a key run unprotected, counting and logging it;
    ``"required"`` refuses it with 400 ``idempotency_key_missing``.

    It must be last in ``MIDDLEWARE`` (check ``django_idempotency.E050``):
    it answers a protected request from ``process_view``, by running the
    view itself, so a later middleware's ``process_view`` would not run.

    Sync and async: under ASGI it runs on the event loop (its
    ``process_view`` is then a coroutine function, ``aprocess_view``), so
    that an async view is awaited there, not run through a thread; what may
    query the database (a plain view's user, the claim) runs in the
    request's thread, as Django runs a sync view. A subclass that overrides
    ``process_view`` overrides ``aprocess_view`` too.
    """

    sync_capable = True
    async_capable = True
    #: Recognised in ``MIDDLEWARE`` by the checks and ``idempotency_routes``, subclasses too.
    idempotency_middleware = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
            # Django awaits a process_view that is a coroutine function on the
            # event loop, and runs any other in a thread: this instance's is.
            self.process_view = self.aprocess_view  # type: ignore[method-assign,assignment]

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self._acall(request)
        response = self.get_response(request)
        keyless.report(request, response)
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        response: HttpResponseBase = await self.get_response(request)
        if keyless.noted(request):
            # Names the client: a plain view's user may still have to be loaded.
            await sync_to_async(keyless.report, thread_sensitive=True)(request, response)
        return response

    def process_view(
        self,
        request: HttpRequest,
        view_func: Callable[..., Any],
        view_args: tuple[Any, ...],
        view_kwargs: dict[str, Any],
    ) -> HttpResponseBase | None:
        """Run a protected view here; None: Django runs the view as routed."""
        routed = self._protecting(request, view_func)
        return None if routed is None else self._run(routed, request, view_args, view_kwargs)

    async def aprocess_view(
        self,
        request: HttpRequest,
        view_func: Callable[..., Any],
        view_args: tuple[Any, ...],
        view_kwargs: dict[str, Any],
    ) -> HttpResponseBase | None:
        """``process_view`` under ASGI: an async view awaited here, a sync one in a thread."""
        routed = self._protecting(request, view_func)
        if routed is None:
            return None
        protected = routed.protected()
        if protected is None:
            return None  # protected in place (Ninja's operations): run as routed
        if not iscoroutinefunction(protected):
            return await sync_to_async(self._run, thread_sensitive=True)(
                routed, request, view_args, view_kwargs
            )
        # A plain view's anonymous request is told by its user: maybe a query.
        if await sync_to_async(routed.left_alone, thread_sensitive=True)(request):
            return None
        return await protected(request, *view_args, **view_kwargs)  # type: ignore[no-any-return]

    def _protecting(self, request: HttpRequest, view_func: Callable[..., Any]) -> RoutedView | None:
        """The routed view if the middleware protects this request; None: it runs as routed.

        Decided from the route and the headers alone, without a query: a
        keyless request in report-only mode is noted here, and counted once
        answered, unless it turns out to be anonymous (``keyless.report``).
        """
        prepare(request)
        if request.method not in PROTECTED_METHODS:
            return None
        routed = routed_view(view_func)
        if not routed.coverage(request.method, request.path_info).by_middleware:
            return None
        if sends_no_key(request) and idempotency_settings.MIDDLEWARE_KEYS == "report":
            keyless.note(request, routed.framework)
            return None
        return routed

    def _run(
        self,
        routed: RoutedView,
        request: HttpRequest,
        view_args: tuple[Any, ...],
        view_kwargs: dict[str, Any],
    ) -> HttpResponseBase | None:
        """Run ``routed`` protected, unless it leaves ``request`` alone; in a sync context."""
        if routed.left_alone(request):
            return None
        protected = routed.protected()
        if protected is None:
            return None  # protected in place (Ninja's operations): run as routed
        if iscoroutinefunction(protected):  # an async view under WSGI, run as Django runs one
            return async_to_sync(protected)(request, *view_args, **view_kwargs)  # type: ignore[no-any-return]
        return protected(request, *view_args, **view_kwargs)
