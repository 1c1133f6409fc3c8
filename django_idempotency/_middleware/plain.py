"""Plain Django views under the middleware: protected under the configured path prefixes only.

Every view no framework module recognises is a plain Django view: a
function, or a class-based view's ``as_view()``. The admin, login and HTML
forms are such views, so they are protected only under
``MIDDLEWARE_PLAIN_VIEW_PREFIXES`` (none by default). Django's middleware
authenticated the request before this one, so an anonymous request is
known in ``process_view`` (in a thread under ASGI: the user may have to
be loaded) and left to run as routed. A protected one runs the callback
under ``@idempotent``'s protection, as a function view: an awaitable one
for an async view (an ``async def`` function, a class of ``async def``
handlers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from django.http import HttpRequest, HttpResponseBase

from django_idempotency._middleware.coverage import (
    DECORATOR,
    MIDDLEWARE,
    UNSAFE_METHODS,
    Coverage,
    left_alone_as_anonymous,
    middleware_options,
    unprotected,
    view_path,
)
from django_idempotency._protection.flow import Options
from django_idempotency.conf import idempotency_settings
from django_idempotency.decorators import EXEMPT_ATTRIBUTE, IdempotentView, protected_view

#: Why the middleware leaves a plain view alone outside the prefixes.
OUTSIDE_PREFIXES = "plain Django view outside MIDDLEWARE_PLAIN_VIEW_PREFIXES"


def routed_view(callback: Callable[..., Any]) -> PlainView:
    """Any callback: the view no framework module recognised."""
    return PlainView(callback)


class PlainView:
    """A plain Django view, a function or a class-based view's ``as_view()``."""

    framework = "django"

    def __init__(self, callback: Callable[..., Any]) -> None:
        self.callback = callback
        view_class = getattr(callback, "view_class", None)
        self.view_class = view_class if isinstance(view_class, type) else None
        self.view = view_path(callback)
        self._protected: dict[bool | None, IdempotentView] = {}

    def unsafe_methods(self) -> Iterable[tuple[str, str]]:
        if self.view_class is not None:
            return [
                (method, method.lower())
                for method in UNSAFE_METHODS
                if _handler(self.view_class, method) is not None
            ]
        # A function may answer any method: the ones it refuses cannot be told apart.
        name = getattr(self.callback, "__name__", "view")
        return [(method, name) for method in UNSAFE_METHODS]

    def coverage(self, method: str, path: str, *, exact: bool = True) -> Coverage:
        handler = _handler(self.view_class, method) if self.view_class else None
        options = function_options(self.callback)
        if options is None:
            options = handler_options(handler)
        if options is not None:
            return Coverage(by=DECORATOR, options=options)
        if self.view_class is not None and handler is None:
            return unprotected("no handler (405)")
        if any(
            getattr(marked, EXEMPT_ATTRIBUTE, False) is True
            for marked in (self.callback, self.view_class, handler)
        ):
            return unprotected("idempotent_exempt")
        under = under_prefixes(path, exact=exact)
        if under is False:
            return unprotected(OUTSIDE_PREFIXES)
        return Coverage(by=MIDDLEWARE, options=middleware_options(), partial=under is None)

    def left_alone(self, request: HttpRequest) -> bool:
        return left_alone_as_anonymous(request)

    def protected(self) -> Callable[..., HttpResponseBase]:
        options = middleware_options()
        view = self._protected.get(options.required)
        if view is None:
            view = self._protected[options.required] = protected_view(self.callback, options)
        return view


def under_prefixes(path: str, *, exact: bool = True) -> bool | None:
    """Whether ``path`` is under ``MIDDLEWARE_PLAIN_VIEW_PREFIXES``.

    ``exact=False``: ``path`` is only how the paths of a route begin; None
    when some of them are under a prefix and others may not be.
    """
    prefixes = idempotency_settings.MIDDLEWARE_PLAIN_VIEW_PREFIXES
    if any(path.startswith(prefix) for prefix in prefixes):
        return True
    if not exact and any(prefix.startswith(path) for prefix in prefixes):
        return None
    return False


def _handler(view_class: type, method: str) -> Any:
    """The handler ``view_class`` answers ``method`` with; None where Django answers 405.

    As ``View.dispatch`` finds it: a method ``http_method_names`` leaves
    out is refused, whatever the class defines.
    """
    if method.lower() not in getattr(view_class, "http_method_names", ()):
        return None
    return getattr(view_class, method.lower(), None)


def handler_options(handler: Any) -> Options | None:
    """The options of ``@idempotent`` on a handler, directly or through ``method_decorator``.

    Django's ``method_decorator`` protects a new bound method at each call,
    so the class holds no ``IdempotentView``; but it copies what the
    decorator sets on a function onto the method it makes, ``options``
    among it.
    """
    if isinstance(handler, IdempotentView):
        return handler.options
    options = getattr(handler, "options", None) if callable(handler) else None
    return options if isinstance(options, Options) else None


def function_options(callback: Any) -> Options | None:
    """The options of an ``@idempotent`` function view, under any decorators above it."""
    seen = 0
    while callback is not None and seen < 50:  # a cycle of __wrapped__ is not ours to loop on
        if isinstance(callback, IdempotentView):  # AsyncIdempotentView (an async view's) too
            return callback.options
        callback, seen = getattr(callback, "__wrapped__", None), seen + 1
    return None
