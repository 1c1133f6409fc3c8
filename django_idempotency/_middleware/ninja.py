"""Django Ninja's views under the middleware: every unsafe operation protected inside itself.

Ninja routes each path to a view that runs the path's operations (a
``PathView``), and authenticates, throttles and validates inside the
operation, after every middleware's ``process_view``: the claim must come
after them. So the middleware does not run the view in its place, as it
runs a DRF view: it installs the protection inside each unsafe operation
of the path, the way ``django_idempotency.ninja.idempotent`` does, at the
lowest precedence (an operation's own ``@idempotent`` and its routers'
``add_decorator`` keep their options: it is protected once), exempts the
view from ``ATOMIC_REQUESTS`` (before Django would open it), and lets
Django run the view as routed. The protection, once Ninja has
authenticated, reads the middleware's options at each request (a
request without a key then runs unprotected, report-only) and leaves
anonymous requests alone as the middleware does everywhere. Sync and async
operations alike.

``protect_every_view`` does the same for every Ninja view of a URLconf,
once per process, so that their OpenAPI schemas show the key header from
the first request on, not only after each operation's first request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from ninja.operation import Operation, PathView

from django_idempotency._middleware.coverage import (
    ADD_DECORATOR,
    DECORATOR,
    MIDDLEWARE,
    UNSAFE_METHODS,
    Coverage,
    anonymous_left_alone,
    left_alone_as_anonymous,
    middleware_options,
    unprotected,
    view_path,
)
from django_idempotency._ninja.operations import Level, function_of, protection_of
from django_idempotency._ninja.urls import path_view_of
from django_idempotency.decorators import EXEMPT_ATTRIBUTE
from django_idempotency.ninja import protect_view


def routed_view(callback: Callable[..., Any]) -> NinjaView | None:
    """The Ninja path view behind ``callback`` (what a ``NinjaAPI``'s URLs route), or None."""
    path_view = path_view_of(callback)
    return None if path_view is None else NinjaView(callback, path_view)


class NinjaView:
    """The operations of one Ninja path, as one route of the URLconf routes them."""

    framework = "ninja"

    def __init__(self, callback: Callable[..., Any], path_view: PathView) -> None:
        self.callback = callback
        #: What the route dispatches to: Ninja gives each of its operations a
        #: URL pattern of its own, all with this one (the first resolves).
        self.dispatcher = path_view
        names = dict.fromkeys(view_path(function_of(op)) for op in path_view.operations)
        self.view = ", ".join(names)

    def _operation(self, method: str) -> Operation | None:
        # As PathView finds it: the first operation answering the method.
        for operation in self.dispatcher.operations:
            if method in operation.methods:
                return operation
        return None

    def unsafe_methods(self) -> Iterable[tuple[str, str]]:
        found = []
        for method in UNSAFE_METHODS:
            operation = self._operation(method)
            if operation is not None:
                found.append((method, function_of(operation).__name__))
        return found

    def handler_function(self, method: str) -> Callable[..., Any] | None:
        """The function of the operation answering ``method``: the view does not lead to it."""
        operation = self._operation(method)
        return None if operation is None else function_of(operation)

    def coverage(self, method: str, path: str, *, exact: bool = True) -> Coverage:
        # Wherever it is routed, and read anew: MIDDLEWARE_KEYS may change.
        operation = self._operation(method)
        if operation is None:
            return unprotected("no operation (405)")
        protection = protection_of(operation)
        if protection is not None and protection.level > Level.PROJECT:
            through = ADD_DECORATOR if protection.level is Level.ROUTER else ""
            return Coverage(by=DECORATOR, options=protection.options, through=through)
        if _exempt(function_of(operation)):
            return unprotected("idempotent_exempt")
        if getattr(operation, "stream_format", None) is not None:
            return unprotected("streams its response")
        return Coverage(by=MIDDLEWARE, options=middleware_options())

    def left_alone(self, request: Any) -> bool:
        return False  # known only once Ninja has authenticated: the operation decides

    def protected(self) -> None:
        """Protect the path's operations in place: Django then runs the view as routed."""
        protect_view(
            self.callback,
            middleware_options,
            exempt=_exempt,
            left_alone=left_alone_as_anonymous,
            anonymous_left_alone=anonymous_left_alone,
        )


def _exempt(function: Callable[..., Any]) -> bool:
    """Marked by ``idempotent_exempt`` (above or below the route decorator: the same function)."""
    return getattr(function, EXEMPT_ATTRIBUTE, False) is True


_prepared: set[object] = set()
_preparing = threading.Lock()


def protect_every_view(urlconf: object) -> None:
    """Protect every Ninja view of ``urlconf`` (a dotted path or a module): once per process."""
    if urlconf in _prepared:
        return
    from django.urls import get_resolver

    with _preparing:
        if urlconf not in _prepared:
            # A dotted path, or a module (a request's own urlconf may be one).
            resolver = get_resolver(cast(str, urlconf))
            for callback in _callbacks(resolver.url_patterns):
                found = routed_view(callback)
                if found is not None:
                    found.protected()
            _prepared.add(urlconf)


def _callbacks(patterns: Iterable[Any]) -> Iterator[Callable[..., Any]]:
    from django.urls import URLPattern, URLResolver

    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _callbacks(entry.url_patterns)
        elif isinstance(entry, URLPattern):
            yield entry.callback
