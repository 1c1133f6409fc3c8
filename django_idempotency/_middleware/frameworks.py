"""Which framework answers for a routed view: the middleware's one question per callback.

``FRAMEWORKS`` lists a function per framework, asked in this order; the
first that recognises the callback returns its ``RoutedView``, and
``plain`` answers for every callback none recognises.

Django Ninja's module (``ninja``), where Ninja is installed, recognises the
callables a ``NinjaAPI``'s URL patterns route (Ninja's path views). Ninja
authenticates inside its operations, so its ``protected()`` installs the
protection inside them and returns None: Django then runs the view as
routed. Its ``prepare`` protects every Ninja view of the request's URLconf
at the first request, so that their schemas show the key header at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest
from rest_framework.views import APIView

from django_idempotency._middleware import drf, plain
from django_idempotency._middleware.coverage import (
    UNSAFE_METHODS,
    Coverage,
    RoutedView,
    unprotected,
)

#: How each framework recognises its views; None: not one of its views.
FRAMEWORKS: tuple[Callable[[Callable[..., Any]], RoutedView | None], ...] = (drf.routed_view,)
#: What a framework does once per URLconf, before the first view it routes runs.
PREPARE: tuple[Callable[[object], None], ...] = ()

try:
    from django_idempotency._middleware import ninja
except (ImportError, ImproperlyConfigured):  # Django Ninja is not installed
    pass
else:
    FRAMEWORKS = (*FRAMEWORKS, ninja.routed_view)
    PREPARE = (ninja.protect_every_view,)

#: What the checks and the command look for in MIDDLEWARE.
MIDDLEWARE_PATH = "django_idempotency.middleware.IdempotencyMiddleware"
#: Why a view the middleware would protect is unprotected: it is not installed.
NOT_INSTALLED = "IdempotencyMiddleware is not in MIDDLEWARE"

_routed: weakref.WeakKeyDictionary[Any, RoutedView] = weakref.WeakKeyDictionary()
_finding = threading.Lock()


def routed_view(callback: Callable[..., Any]) -> RoutedView:
    """The framework's view behind ``callback``: found once per callback."""
    try:
        return _routed[callback]
    except KeyError:
        pass
    except TypeError:  # no weak reference to it: asked again each time
        return _recognised(callback)
    with _finding:
        found = _routed.get(callback)
        if found is None:
            found = _routed[callback] = _recognised(callback)
    return found


def _recognised(callback: Callable[..., Any]) -> RoutedView:
    for framework in FRAMEWORKS:
        found = framework(callback)
        if found is not None:
            return found
    return plain.routed_view(callback)


def prepare(request: HttpRequest) -> None:
    """Let each framework prepare the request's URLconf, once (``PREPARE``)."""
    if PREPARE:
        from django.conf import settings

        urlconf = getattr(request, "urlconf", None) or settings.ROOT_URLCONF
        for each in PREPARE:
            each(urlconf)


def installed() -> bool:
    """Whether ``MIDDLEWARE`` lists ``IdempotencyMiddleware`` (or a subclass)."""
    return position() is not None


def position() -> int | None:
    """The index of ``IdempotencyMiddleware`` (or a subclass) in ``MIDDLEWARE``; None if absent."""
    from django.conf import settings
    from django.utils.module_loading import import_string

    for index, path in enumerate(getattr(settings, "MIDDLEWARE", None) or ()):
        if path == MIDDLEWARE_PATH:
            return index
        try:
            imported = import_string(path)
        except ImportError:
            continue  # Django's own start would say so
        if getattr(imported, "idempotency_middleware", False) is True:
            return index
    return None


def static_coverage(
    routed: RoutedView, method: str, path: str, *, exact: bool, middleware: bool
) -> Coverage:
    """What protects ``method`` of a route, read without a request; ``middleware``: installed."""
    coverage = routed.coverage(method, path, exact=exact)
    if coverage.by_middleware and not middleware:
        return unprotected(NOT_INSTALLED)
    return coverage


def drf_coverage(callback: Any, view_class: type, handler_name: str, method: str) -> Coverage:
    """What protects ``method`` of a DRF view, as the middleware and ``idempotency_routes`` judge.

    For what reads DRF's views rather than the URLconf (the OpenAPI schema).
    ``callback``: the route's callable, which says what the class alone
    cannot (a decorator of the route's own, an ``idempotent_exempt`` on one
    ``as_view()``); None where only the class is known.
    """
    method = method.upper()
    if method not in UNSAFE_METHODS:
        return unprotected("a safe method")
    routed = routed_view(callback) if callback is not None else None
    if isinstance(routed, drf.DrfView):
        return static_coverage(routed, method, "", exact=False, middleware=installed())
    if not (isinstance(view_class, type) and issubclass(view_class, APIView)):
        return unprotected("not a DRF view")
    coverage = drf.judge(view_class, handler_name)
    if coverage.by_middleware and not installed():
        return unprotected(NOT_INSTALLED)
    return coverage
