"""The URLs whose views are protected, and the operation names they give records.

Read by the system checks: a reconciler must be registered under a name
that a protected operation has, and ``ATOMIC_REQUESTS`` must not wrap a
protected view; and by the metrics, which label these names alone. The
names are computed as ``scope.default_operation`` computes them for a
request, from the route Django joins while resolving.

Private; imported only by the system checks and ``apps`` (which hands
``protected_operations`` to the metrics). It imports the glue
(``decorators``, ``drf``, and ``_ninja`` where Django Ninja is installed)
to recognise protected views, so nothing below the glue may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_idempotency.scope import operation_name

if TYPE_CHECKING:
    from django_idempotency._protection.flow import Options


#: In the order a person reads them, not a set's.
_UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


@dataclass(frozen=True)
class ProtectedHandler:
    """One method a URL's view protects: ``PATCH`` by ``partial_update``, say."""

    method: str
    #: The view's method (``"post"``) or, for a viewset, the action's name
    #: (a Ninja operation's: its function's).
    handler: str
    options: Options
    #: The handler's own function, where the view's class does not lead to
    #: it (a Ninja operation's); None: found from the view.
    function: Callable[..., Any] | None = None


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
    #: Whether the view is a Django Ninja path's, whose handlers are its operations.
    ninja: bool = False

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
    from django.urls import get_resolver

    yield from _walk(get_resolver(urlconf).url_patterns, "", ())


def _walk(
    patterns: Sequence[Any],
    route: str,
    namespaces: tuple[str, ...],
    seen: set[tuple[str, int]] | None = None,
) -> Iterator[ProtectedURL]:
    from django.urls import URLPattern, URLResolver

    seen = set() if seen is None else seen
    for entry in patterns:
        joined = _join_route(route, str(entry.pattern))
        if isinstance(entry, URLResolver):
            inner = (*namespaces, entry.namespace) if entry.namespace else namespaces
            yield from _walk(entry.url_patterns, joined, inner, seen)
        elif isinstance(entry, URLPattern):
            found = _ninja_handlers(entry.callback)
            if found is not None:
                handlers, view, path_view = found
                # Ninja gives each operation of a path a pattern of its own,
                # all with the path view's one route: the first resolves.
                if (joined, id(path_view)) in seen:
                    continue
                seen.add((joined, id(path_view)))
            else:
                handlers, view = tuple(_protected_handlers(entry.callback)), None
            if handlers:
                name = ":".join((*namespaces, entry.name)) if entry.name else None
                view = view or _view_path(entry.callback)
                yield ProtectedURL(
                    joined, name, view, entry.callback, handlers, ninja=found is not None
                )


def _ninja_handlers(
    callback: Any,
) -> tuple[tuple[ProtectedHandler, ...], str, object] | None:
    """A Ninja URL's protected operations, view name and path view; None: no Ninja view."""
    try:
        from django_idempotency._ninja.urls import path_view_of, protected_operations
    except ImportError:
        return None  # Django Ninja is not installed: no view is one of its
    operations = protected_operations(callback)
    if operations is None:
        return None
    handlers = tuple(
        ProtectedHandler(method, _inner(operation).__name__, protection.options, _inner(operation))
        for operation, protection in operations
        for method in _UNSAFE_METHODS
        if method in operation.methods
    )
    names = dict.fromkeys(_view_path(_inner(operation)) for operation, _ in operations)
    return handlers, ", ".join(names), path_view_of(callback)


def _inner(operation: Any) -> Any:
    """A protected Ninja operation's own function."""
    return getattr(operation.view_func, "inner", operation.view_func)


def _join_route(outer: str, inner: str) -> str:
    """Django's own joining (``URLResolver._join_route``): a nested ``^`` goes."""
    return outer + inner.removeprefix("^") if outer else inner


def _protected_handlers(callback: Any) -> Iterator[ProtectedHandler]:
    from django_idempotency.drf import protection_of

    view_class = getattr(callback, "cls", getattr(callback, "view_class", None))
    if isinstance(view_class, type):
        # A viewset routes methods to actions; other views to same-named handlers.
        actions = getattr(callback, "actions", None)
        if actions:
            routes = {method.upper(): action for method, action in actions.items()}
        else:
            routes = {
                method: method.lower()
                for method in _UNSAFE_METHODS
                if getattr(view_class, method.lower(), None) is not None
            }
        for method, handler in routes.items():
            options = protection_of(view_class, handler, method)
            if options is not None:
                yield ProtectedHandler(method, handler, options)
        return
    options = _function_options(callback)
    if options is not None:
        # A function view may answer any method; the ones it refuses are no
        # operation, but cannot be told apart here.
        name = getattr(callback, "__name__", "view")
        yield from (ProtectedHandler(method, name, options) for method in _UNSAFE_METHODS)


def _function_options(callback: Any) -> Options | None:
    """The options of an ``@idempotent`` function view, under any decorators above it."""
    from django_idempotency.decorators import IdempotentView

    seen = 0
    while callback is not None and seen < 50:  # a cycle of __wrapped__ is not ours to loop on
        if isinstance(callback, IdempotentView):
            return callback.options
        options = getattr(callback, "idempotency_options", None)  # an async view's
        if options is not None:
            return options  # type: ignore[no-any-return]
        callback, seen = getattr(callback, "__wrapped__", None), seen + 1
    return None


def _view_path(callback: Any) -> str:
    """``module.Class`` or ``module.function``; never ``View.as_view.<locals>.view``."""
    view_class = getattr(callback, "cls", getattr(callback, "view_class", None))
    target = view_class if isinstance(view_class, type) else callback
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    short = getattr(target, "__name__", name)
    if name.rpartition(".")[2] != short:
        # Renamed after it was made: @api_view's class is given the
        # function's __name__ and __module__, not its __qualname__.
        name = short
    return f"{getattr(target, '__module__', '?')}.{name}"
