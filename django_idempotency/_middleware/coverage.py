"""What protects one method of one routed view, and the questions every framework shares.

A framework module (``drf``, ``ninja``, ``plain``) answers for its views with a
``RoutedView``; each of its unsafe methods has a ``Coverage``. Whether a
request is left alone as anonymous, and the options the middleware
protects with, are the same for every framework and decided here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from django_idempotency._protection.flow import Options
from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

#: What protects a method: the middleware, the view's own ``@idempotent``
#: (on the function or the handler), or its ``IdempotentMixin``.
ProtectedBy = Literal["middleware", "decorator", "mixin"]
MIDDLEWARE: ProtectedBy = "middleware"
DECORATOR: ProtectedBy = "decorator"
MIXIN: ProtectedBy = "mixin"

#: A decorator protects it through Django Ninja's ``add_decorator`` on a
#: ``Router`` or the ``NinjaAPI``, not placed on the operation (``Coverage.through``).
ADD_DECORATOR = "add_decorator"

#: The unsafe methods, in the order a person reads them.
UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


@dataclass(frozen=True)
class Coverage:
    """What protects one method of one routed view, or why nothing does."""

    #: None: the method runs unprotected.
    by: ProtectedBy | None
    #: The options it is protected with; None when it is not.
    options: Options | None = None
    #: Why it is unprotected, in a few words ("idempotent_exempt").
    reason: str = ""
    #: Protected for some of the paths its route matches only (a plain
    #: view whose route's path is not known up to the prefixes' length).
    partial: bool = False
    #: How a decorator was put there, where not on the view itself: ``ADD_DECORATOR``.
    through: str = ""

    @property
    def by_middleware(self) -> bool:
        return self.by == MIDDLEWARE


def unprotected(reason: str) -> Coverage:
    return Coverage(by=None, reason=reason)


class RoutedView(Protocol):
    """One callback of the URLconf, as its framework sees it."""

    #: ``"drf"``, ``"django"``: the framework that answers for it.
    framework: str
    #: ``"shop.views.OrderViewSet"``: the view's module and name.
    view: str

    def unsafe_methods(self) -> Iterable[tuple[str, str]]:
        """(method, handler name) of each unsafe method the view answers."""
        ...

    def coverage(self, method: str, path: str, *, exact: bool = True) -> Coverage:
        """What protects ``method`` on ``path``.

        ``exact=False``: ``path`` is only the beginning of the paths the
        route matches (its literal part), for those who read routes, not
        requests.
        """
        ...

    def left_alone(self, request: HttpRequest) -> bool:
        """Whether ``request`` runs as routed, unprotected, from what is known of its client now.

        Asked in a sync context, under ASGI too: it may query (a plain
        view's user, loaded from the session).
        """
        ...

    def protected(self) -> Callable[..., HttpResponseBase] | None:
        """The callable the middleware calls in the view's place, with the view's arguments.

        A coroutine function for an async view: the middleware awaits it
        under ASGI, and runs it through ``async_to_sync`` under WSGI.
        None: the view is protected in place (Ninja's operations), and
        Django runs it as routed.
        """
        ...


def middleware_options() -> Options:
    """The options the middleware protects a view with: the defaults, and keys as configured.

    ``required`` says what a keyless request meets once it reaches the
    protection: with ``MIDDLEWARE_KEYS = "report"`` none does (the
    middleware lets it run as routed), and the OpenAPI schema shows the
    header as optional.
    """
    required = idempotency_settings.MIDDLEWARE_KEYS == "required"
    return _REQUIRED if required else _OPTIONAL


_REQUIRED = Options(required=True)
_OPTIONAL = Options(required=False)


def left_alone_as_anonymous(request: HttpRequest | Any) -> bool:
    """Whether the middleware leaves ``request`` unprotected as anonymous.

    Every anonymous client is one tenant (``scope.ANONYMOUS_TENANT``) under
    the default ``TENANT``: one anonymous client's key would fetch another's
    replay. So anonymous requests are protected only where the project
    sets ``TENANT`` (to something that tells its anonymous clients apart,
    or knowing that it does not). Read after authentication: DRF's
    (``request.user``, ``request.auth``) or Django's middleware.
    """
    if not anonymous_left_alone():
        return False
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return False
    return getattr(request, "auth", None) is None


def anonymous_left_alone() -> bool:
    """Whether the middleware leaves anonymous requests alone: unless the project sets ``TENANT``.

    Asked by ``left_alone_as_anonymous`` at each request, and by the schemas,
    which say so where anonymous callers reach an operation.
    """
    return "TENANT" not in idempotency_settings.user_settings


def sends_no_key(request: HttpRequest) -> bool:
    """Whether ``request`` has no ``HEADER`` header at all (an empty one is an invalid key)."""
    return request.headers.get(idempotency_settings.HEADER) is None


def view_path(callback: Any) -> str:
    """``module.Class`` or ``module.function``; never ``View.as_view.<locals>.view``.

    Nor ``functools.partial``: the function it calls, as Django Ninja routes
    its docs and schema views (``partial(openapi_json, api=api)``).
    """
    for _ in range(50):  # partials of partials; a cycle is not ours to loop on
        if not isinstance(callback, functools.partial):
            break
        callback = callback.func
    view_class = getattr(callback, "cls", getattr(callback, "view_class", None))
    target = view_class if isinstance(view_class, type) else callback
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    short = getattr(target, "__name__", name)
    if name.rpartition(".")[2] != short:
        # Renamed after it was made: @api_view's class is given the
        # function's __name__ and __module__, not its __qualname__.
        name = short
    return f"{getattr(target, '__module__', '?')}.{name}"


#: Where a route stops being literal text: a converter, a regex's syntax.
#: ("." too: in a regex it matches any character.)
_NOT_LITERAL = frozenset("<([\\.*+?{|^$")


def literal_path(route: str) -> tuple[str, bool]:
    """The path a route's requests begin with, and whether it is the whole path.

    ``"api/orders/<int:pk>"`` begins every path with ``"/api/orders/"``;
    ``"admin/login/"`` (or ``"^admin/login/$"``) is the path itself.
    """
    text = route.removeprefix("^")
    end = next((index for index, char in enumerate(text) if char in _NOT_LITERAL), len(text))
    return "/" + text[:end], text[end:] in ("", "$")
