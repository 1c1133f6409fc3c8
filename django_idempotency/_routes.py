"""The URLs whose views are protected, and the operation names they give records.

Protected by their own glue (``@idempotent``, ``IdempotentMixin``) or, when
it is installed, by ``IdempotencyMiddleware``: each callback is read as
the middleware reads it (``_middleware.frameworks``), so that both agree.
Read by the system checks: a reconciler must be registered under a name
that a protected operation has, and ``ATOMIC_REQUESTS`` must not wrap a
protected view; by the metrics, which label these names alone; and by
``manage.py idempotency_routes``. The names are computed as
``scope.default_operation`` computes them for a request, from the route
Django joins while resolving.

Private; imported by the system checks, the command and ``apps`` (which
hands ``protected_operations`` to the metrics). It imports the glue
(``decorators``, ``drf``, the middleware's machinery) to recognise
protected views, so nothing below the glue may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_idempotency._middleware.coverage import (
    Coverage,
    ProtectedBy,
    literal_path,
    view_path,
)
from django_idempotency._middleware.frameworks import installed, routed_view, static_coverage
from django_idempotency.scope import operation_name

if TYPE_CHECKING:
    from django_idempotency._protection.flow import Options


@dataclass(frozen=True)
class ProtectedHandler:
    """One method a URL's view protects: ``PATCH`` by ``partial_update``, say."""

    method: str
    #: The view's method (``"post"``) or, for a viewset, the action's name.
    handler: str
    options: Options
    #: What protects it: the middleware, the view's ``@idempotent``, its mixin.
    by: ProtectedBy


@dataclass(frozen=True)
class ProtectedURL:
    """A URL pattern whose view protects at least one method."""

    #: As Django joins it into ``request.resolver_match.route``.
    route: str
    #: ``"api:orders-detail"``: its name with namespaces; None when it has none.
    route_name: str | None
    #: ``"shop.views.OrderViewSet"``: the view's module and name.
    view: str
    callback: Callable[..., Any]
    handlers: tuple[ProtectedHandler, ...]

    def operation(self, handler: ProtectedHandler, style: str) -> str | None:
        """The operation name of the handler's records; None when a callable computes it."""
        spec = handler.options.operation
        if spec is None:
            # An empty route resolves with the request's path, "/" at the root.
            return operation_name(handler.method, self.route or "/", self.route_name, style)
        return None if callable(spec) else spec


def protected_operations() -> set[str]:
    """Every name a protected view of ``ROOT_URLCONF`` gives its records, but a callable's.

    The metrics label these by name (``_observability.labels``): read from
    the code, they are the same in every process of a release.
    """
    from django.conf import settings

    from django_idempotency.conf import idempotency_settings

    if not getattr(settings, "ROOT_URLCONF", None):
        return set()  # a worker's settings, say
    style = idempotency_settings.OPERATION_NAMES
    names = (url.operation(handler, style) for url in protected_urls() for handler in url.handlers)
    return {name for name in names if name is not None}


def protected_urls(urlconf: str | None = None) -> Iterator[ProtectedURL]:
    """Every URL pattern of the URLconf whose view protects some method."""
    middleware = installed()
    for route, name, callback in routed_patterns(urlconf):
        handlers = tuple(_protected_handlers(callback, route, middleware))
        if handlers:
            yield ProtectedURL(route, name, view_path(callback), callback, handlers)


def routed_patterns(urlconf: str | None = None) -> Iterator[tuple[str, str | None, Any]]:
    """(route, name with namespaces, callback) of every URL pattern, in the URLconf's order."""
    from django.urls import get_resolver

    yield from _walk(get_resolver(urlconf).url_patterns, "", ())


def _walk(
    patterns: Sequence[Any], route: str, namespaces: tuple[str, ...]
) -> Iterator[tuple[str, str | None, Any]]:
    from django.urls import URLPattern, URLResolver

    for entry in patterns:
        joined = _join_route(route, str(entry.pattern))
        if isinstance(entry, URLResolver):
            inner = (*namespaces, entry.namespace) if entry.namespace else namespaces
            yield from _walk(entry.url_patterns, joined, inner)
        elif isinstance(entry, URLPattern):
            name = ":".join((*namespaces, entry.name)) if entry.name else None
            yield joined, name, entry.callback


def _join_route(outer: str, inner: str) -> str:
    """Django's own joining (``URLResolver._join_route``): a nested ``^`` goes."""
    return outer + inner.removeprefix("^") if outer else inner


def _protected_handlers(callback: Any, route: str, middleware: bool) -> Iterator[ProtectedHandler]:
    """The methods of ``callback`` that something protects: its own glue, or the middleware."""
    routed = routed_view(callback)
    path, exact = literal_path(route)
    for method, handler in routed.unsafe_methods():
        coverage = static_coverage(routed, method, path, exact=exact, middleware=middleware)
        if coverage.by is not None and coverage.options is not None:
            yield ProtectedHandler(method, handler, coverage.options, coverage.by)


@dataclass(frozen=True)
class RouteCoverage:
    """One URL pattern, and what protects each unsafe method its view answers, or why nothing."""

    route: str
    route_name: str | None
    view: str
    #: ``"drf"`` or ``"django"``: the framework that answers for the view.
    framework: str
    #: (method, coverage), in the order a person reads methods; () for a
    #: view of safe methods only.
    methods: tuple[tuple[str, Coverage], ...]


def route_coverage(urlconf: str | None = None) -> Iterator[RouteCoverage]:
    """Every URL pattern of the URLconf, protected or not (``manage.py idempotency_routes``)."""
    middleware = installed()
    for route, name, callback in routed_patterns(urlconf):
        routed = routed_view(callback)
        path, exact = literal_path(route)
        methods = tuple(
            (method, static_coverage(routed, method, path, exact=exact, middleware=middleware))
            for method, _ in routed.unsafe_methods()
        )
        yield RouteCoverage(route, name, routed.view, routed.framework, methods)
