"""DRF's views under the middleware: each view class run as a subclass with the protection mixed in.

DRF authenticates, checks permissions and throttles inside the view
(``APIView.initial()``), after every middleware's ``process_view``; the
claim must come after them, where ``IdempotentMixin`` makes it. So the
middleware runs, in the routed view's place, a subclass of its class with
``MiddlewareProtection`` (an ``IdempotentMixin``) first among its bases:
made once per class, which runs the mixin's class setup (its options
checked, the class exempted from ``ATOMIC_REQUESTS`` where it protects, so
that the claim commits before the view's transaction opens), and routed
as the URLconf routes the class (the same ``as_view()`` arguments, a
viewset's actions). The user's class is left as it is: where the
middleware protects nothing (GET, an exempt view), Django runs it as
routed. adrf's async views are made the same way: the mixin's ``initial()``
(which adrf runs in a thread) swaps in an awaitable protected handler,
and the subclass's ``as_view()`` is a coroutine function, which the
middleware awaits.
"""

from __future__ import annotations

import dataclasses
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency._middleware.coverage import (
    DECORATOR,
    MIDDLEWARE,
    MIXIN,
    UNSAFE_METHODS,
    Coverage,
    ProtectedBy,
    left_alone_as_anonymous,
    middleware_options,
    unprotected,
    view_path,
)
from django_idempotency._protection.flow import Options
from django_idempotency.decorators import (
    API_VIEW_CLASS,
    EXEMPT_ATTRIBUTE,
    IdempotentView,
    unprotected_handler,
)
from django_idempotency.drf import IdempotentMixin

#: Views that issue credentials (and their subclasses), named by their
#: dotted path so that none is imported: ``rest_framework.authtoken`` may
#: not be installed, and its models then cannot be. A replay would hand a
#: token out again, and a stored one would sit in the records.
CREDENTIAL_VIEWS = frozenset({"rest_framework.authtoken.views.ObtainAuthToken"})


class MiddlewareProtection(IdempotentMixin):
    """``IdempotentMixin`` with the middleware's options, leaving anonymous requests alone."""

    @classmethod
    def idempotency_options(cls) -> Options:
        return middleware_options()

    def _idempotency_handler(self, request: Request, function: Callable[..., Any]) -> Any:
        if not left_alone_as_anonymous(request):
            return super()._idempotency_handler(request, function)
        if iscoroutinefunction(function):
            # adrf's async handler, as routed: Django opens no ATOMIC_REQUESTS
            # transaction around an async view, so there is none to restore.
            return types.MethodType(function, self)
        return types.MethodType(unprotected_handler(function), self)


def routed_view(callback: Callable[..., Any]) -> DrfView | None:
    """The DRF view behind ``callback`` (``as_view()``'s, a router's, ``@api_view``'s), or None."""
    view_class = getattr(callback, "cls", None)
    if isinstance(view_class, type) and issubclass(view_class, APIView):
        return DrfView(callback, view_class)
    return None


class DrfView:
    """A DRF view class as one route of the URLconf routes it."""

    framework = "drf"

    def __init__(self, callback: Callable[..., Any], view_class: type[APIView]) -> None:
        self.callback = callback
        self.view_class = view_class
        self.view = view_path(callback)
        self._coverage: dict[str, Coverage] = {}
        self._protected: Callable[..., HttpResponseBase] | None = None

    def unsafe_methods(self) -> Iterable[tuple[str, str]]:
        # A viewset routes methods to actions; other views to same-named handlers.
        actions = getattr(self.callback, "actions", None)
        if actions:
            routes = {method.upper(): action for method, action in actions.items()}
        else:
            routes = {
                method: method.lower()
                for method in UNSAFE_METHODS
                if getattr(self.view_class, method.lower(), None) is not None
            }
        return [(method, routes[method]) for method in UNSAFE_METHODS if method in routes]

    def coverage(self, method: str, path: str, *, exact: bool = True) -> Coverage:
        # Wherever it is routed: the path does not matter to a DRF view.
        found = self._coverage.get(method)
        if found is None:
            found = self._coverage[method] = self._judge(method)
        if found.by == MIDDLEWARE:
            # Read anew: MIDDLEWARE_KEYS may change (override_settings).
            return dataclasses.replace(found, options=middleware_options())
        return found

    def _judge(self, method: str) -> Coverage:
        handler_name = dict(self.unsafe_methods()).get(method)
        if handler_name is None:
            return unprotected("no handler (405)")
        return judge(self.view_class, handler_name, self.callback)

    def left_alone(self, request: HttpRequest) -> bool:
        return False  # known only once DRF has authenticated: MiddlewareProtection decides

    def protected(self) -> Callable[..., HttpResponseBase]:
        if self._protected is None:
            view_class = protected_class(self.view_class)
            initkwargs = getattr(self.callback, "initkwargs", {})
            actions = getattr(self.callback, "actions", None)
            if actions:  # a copy: DRF adds "head" to the dict it is given
                view = view_class.as_view(dict(actions), **initkwargs)  # type: ignore[call-arg]
            else:
                view = view_class.as_view(**initkwargs)
            self._protected = view
        return self._protected


def judge(view_class: type[APIView], handler_name: str, callback: Any = None) -> Coverage:
    """What protects the handler ``handler_name`` of ``view_class``.

    ``callback``: the route's ``as_view()`` callable, which may be exempt
    on its own; None where only the class is known (the OpenAPI schema).
    """
    handler = getattr(view_class, handler_name, None)
    own = own_protection(view_class, handler)
    if own is not None:
        return Coverage(by=own[0], options=own[1])
    if _exempt(callback, view_class, handler):
        return unprotected("idempotent_exempt")
    credential = _credential_view(view_class)
    if credential is not None:
        return unprotected(f"issues credentials ({credential})")
    return Coverage(by=MIDDLEWARE, options=middleware_options())


def own_protection(view_class: type, handler: Any) -> tuple[ProtectedBy, Options] | None:
    """What protects ``handler`` of ``view_class`` without the middleware, and how."""
    decorated = decorated_options(handler)
    if decorated is not None:
        return DECORATOR, decorated
    if issubclass(view_class, IdempotentMixin):
        return MIXIN, view_class.idempotency_options()
    return None


def decorated_options(handler: Any) -> Options | None:
    """The options of ``@idempotent`` on a handler, or under ``@api_view`` (its closure)."""
    if isinstance(handler, IdempotentView):
        return handler.options
    for cell in getattr(handler, "__closure__", None) or ():
        contents = cell.cell_contents
        if isinstance(contents, IdempotentView):
            return contents.options
    return None


def _exempt(callback: Any, view_class: type, handler: Any) -> bool:
    """Marked by ``idempotent_exempt``: the route, the class (or a base), the handler.

    Or the function under ``@api_view``, whose handler calls it from its closure.
    """
    marked = [callback, view_class, handler]
    if view_class.__qualname__ == API_VIEW_CLASS:
        marked.extend(cell.cell_contents for cell in getattr(handler, "__closure__", None) or ())
    return any(getattr(each, EXEMPT_ATTRIBUTE, False) is True for each in marked)


def _credential_view(view_class: type) -> str | None:
    for cls in view_class.__mro__:
        if f"{cls.__module__}.{cls.__qualname__}" in CREDENTIAL_VIEWS:
            return cls.__name__
    return None


_classes: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()
_making = threading.Lock()


def protected_class(view_class: type[APIView]) -> type[APIView]:
    """``view_class`` with ``MiddlewareProtection`` first among its bases: made once per class.

    It keeps the class's name, module and docstring: DRF shows them (the
    browsable API's title, ``OPTIONS``' name and description).
    """
    made = _classes.get(view_class)
    if made is None:
        with _making:
            made = _classes.get(view_class)
            if made is None:
                made = type(
                    view_class.__name__,
                    (MiddlewareProtection, view_class),
                    {
                        "__module__": view_class.__module__,
                        "__qualname__": view_class.__qualname__,
                        "__doc__": view_class.__doc__,
                    },
                )
                _classes[view_class] = made
    return made
