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

A route that wraps ``as_view()``'s function in decorators of its own
(``permission_required(View.as_view())``, a decorator above ``@api_view``)
is left to them: running the class in its place would skip them, a
permission check among them. Django then runs it as routed, unprotected,
unless the wrapping is ``@idempotent``'s, which protects it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from types import CodeType
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.views.decorators.csrf import csrf_exempt
from rest_framework import permissions
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
from django_idempotency._middleware.plain import function_options, handler_options
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
#: Why the middleware leaves a route alone whose view a decorator of its own wraps.
DECORATED_ROUTE = (
    "a decorator wraps the route's view, which the middleware would run without it: "
    "protect the class with IdempotentMixin (an @api_view function with @idempotent under it)"
)


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
        # DRF answers 405 to a method http_method_names leaves out, whatever is routed.
        allowed = getattr(self.view_class, "http_method_names", ())
        return [
            (method, routes[method])
            for method in UNSAFE_METHODS
            if method in routes and method.lower() in allowed
        ]

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
        coverage = judge(self.view_class, handler_name, self.callback)
        if coverage.by_middleware and self._decorated():
            # @idempotent above @api_view protects the route itself, with its options.
            options = function_options(self.callback)
            if options is not None:
                return Coverage(by=DECORATOR, options=options)
            return unprotected(DECORATED_ROUTE)
        return coverage

    def _decorated(self) -> bool:
        """Whether the route wraps ``as_view()``'s function in a decorator of its own.

        Told by the code of each function down its ``__wrapped__`` chain,
        against a function ``as_view()`` makes for the same class now: DRF's
        own ``csrf_exempt`` wrapping, and what a class's ``as_view()`` adds
        (a ``method_decorator`` on ``dispatch``), are in both.
        """
        return _code_chain(self.callback) != _code_chain(self._as_view(self.view_class))

    def left_alone(self, request: HttpRequest) -> bool:
        return False  # known only once DRF has authenticated: MiddlewareProtection decides

    def protected(self) -> Callable[..., HttpResponseBase]:
        if self._protected is None:
            self._protected = self._as_view(protected_class(self.view_class))
        return self._protected

    def _as_view(self, view_class: type[APIView]) -> Callable[..., HttpResponseBase]:
        """``view_class`` routed as the route routes its class: its arguments, its actions."""
        initkwargs = getattr(self.callback, "initkwargs", {})
        actions = getattr(self.callback, "actions", None)
        if actions:  # a copy: DRF adds "head" to the dict it is given
            return view_class.as_view(dict(actions), **initkwargs)  # type: ignore[call-arg]
        return view_class.as_view(**initkwargs)


def _code_chain(function: Any) -> list[CodeType | None]:
    """The code of ``function`` and of each function under it (``__wrapped__``).

    ``csrf_exempt``'s wrappers left out: DRF's ``as_view()`` adds one, and
    one more around it changes nothing the middleware would skip.
    """
    chain: list[CodeType | None] = []
    for _ in range(50):  # a cycle of __wrapped__ is not ours to loop on
        if function is None:
            break
        code = getattr(function, "__code__", None)
        if code not in _csrf_exempt_codes():
            chain.append(code)
        function = getattr(function, "__wrapped__", None)
    return chain


@functools.cache
def _csrf_exempt_codes() -> frozenset[CodeType]:
    """The code of the wrappers Django's ``csrf_exempt`` makes, of a function and a coroutine."""

    def function(request: HttpRequest) -> None: ...

    async def coroutine(request: HttpRequest) -> None: ...

    return frozenset(csrf_exempt(view).__code__ for view in (function, coroutine))


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
    """The options of ``@idempotent`` on a handler, or under ``@api_view`` (its closure).

    Or through Django's ``method_decorator``, which protects a new bound
    handler at each call but copies what the decorator sets on a function
    (``options``) onto the method it makes: a claim of the middleware's
    around it would hold the key that the handler's own claim then finds
    in flight.
    """
    options = handler_options(handler)
    if options is not None:
        return options
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


def admits_anonymous(view: APIView, method: str) -> bool:
    """Whether an anonymous request for ``method`` may reach the handler of ``view``.

    Read from the view as DRF would check it, without a request: with no
    authentication class every request is anonymous; otherwise one of its
    permissions must be known to refuse an anonymous request
    (``IsAuthenticated`` and the like). A permission whose answer is not
    known counts as admitting one: where ``MiddlewareProtection`` leaves
    anonymous requests alone, "refused without a key" is said only where
    it is sure.
    """
    if not view.get_authenticators():
        return True
    return not any(_refuses_anonymous(each, method) for each in view.get_permissions())


#: DRF's permissions that refuse every anonymous request, whatever the method.
_AUTHENTICATED_ONLY = (permissions.IsAuthenticated, permissions.IsAdminUser)


def _refuses_anonymous(permission: Any, method: str) -> bool:
    if isinstance(permission, _AUTHENTICATED_ONLY):
        return True
    if isinstance(permission, permissions.IsAuthenticatedOrReadOnly):
        return method.upper() not in permissions.SAFE_METHODS
    if isinstance(permission, permissions.DjangoModelPermissions):
        # An anonymous user may hold permissions where a backend grants them
        # (OrAnonReadOnly asks it): only authenticated_users_only is sure.
        return bool(permission.authenticated_users_only)
    # Composed with & (either refuses) or | (both refuse); the stubs do not name the operands.
    if isinstance(permission, permissions.AND | permissions.OR):
        refused = [_refuses_anonymous(getattr(permission, op), method) for op in ("op1", "op2")]
        return any(refused) if isinstance(permission, permissions.AND) else all(refused)
    return False


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
