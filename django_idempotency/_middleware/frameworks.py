"""Which framework answers for a routed view: the middleware's one question per callback.

``FRAMEWORKS`` lists a function per framework, asked in this order; the
first that recognises the callback returns its ``RoutedView``, and
``plain`` answers for every callback none recognises.

Django Ninja plugs in here, with one function: a module
``_middleware/ninja.py`` whose ``routed_view(callback)`` recognises the
callables a ``NinjaAPI``'s URL patterns route (Ninja's path views), and
returns a ``RoutedView`` whose ``coverage()`` names Ninja's own
``django_idempotency.ninja.idempotent`` as the ``DECORATOR`` where an
operation carries it, whose ``left_alone()`` says False (Ninja
authenticates inside the operation, as DRF does inside the view), and
whose ``protected()`` runs the operation with the protection applied
after Ninja's authentication, as that decorator applies it; its entry goes
before ``plain``'s.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from rest_framework.views import APIView

from django_idempotency._middleware import drf, plain
from django_idempotency._middleware.coverage import (
    UNSAFE_METHODS,
    Coverage,
    RoutedView,
    unprotected,
)
from django_idempotency._protection.flow import Options

#: How each framework recognises its views; None: not one of its views.
FRAMEWORKS: tuple[Callable[[Callable[..., Any]], RoutedView | None], ...] = (drf.routed_view,)

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


def protection_by_middleware(view_class: type, handler_name: str, method: str) -> Options | None:
    """The options the installed middleware protects a DRF class's handler with, or None.

    For what reads view classes, not routes (the OpenAPI schema): an
    ``idempotent_exempt`` on one route's ``as_view()`` is not seen here.
    """
    if method.upper() not in UNSAFE_METHODS or not installed():
        return None
    if not (isinstance(view_class, type) and issubclass(view_class, APIView)):
        return None
    coverage = drf.judge(view_class, handler_name)
    return coverage.options if coverage.by_middleware else None
