"""System checks of the protected views, read from the URLconf.

A view inside ``ATOMIC_REQUESTS`` (W002), an optimistic view calling out
(E036), reconcilers registered for no protected operation (W004, W005) and
operations sharing a name (W006). Beside ``_routes``, which finds the
protected views in ``ROOT_URLCONF``. Imported only by
``django_idempotency.checks``, which registers these checks with the
``urls`` tag. Private: it reaches the HTTP glue (through ``_routes``), so
it sits at the top, not in ``_protection``.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.checks import CheckMessage, Warning

from django_idempotency._checks import error
from django_idempotency._middleware.coverage import MIDDLEWARE
from django_idempotency._store.routing import routed_record_databases
from django_idempotency.conf import idempotency_settings
from django_idempotency.scope import OPERATION_NAMES

if TYPE_CHECKING:
    from django_idempotency._routes import ProtectedURL


def check_atomic_requests(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    # Only the records' database matters: the claim commits on its own
    # unless that database's request transaction is already open.
    configured = idempotency_settings.DATABASE
    every = routed_record_databases() if configured is None else [configured]
    atomic = {alias for alias in every if settings.DATABASES.get(alias, {}).get("ATOMIC_REQUESTS")}
    if not atomic or not getattr(settings, "ROOT_URLCONF", None):
        return []
    from django_idempotency._routes import protected_urls

    messages: list[CheckMessage] = []
    for url in protected_urls():
        exempt: set[str] = getattr(url.callback, "_non_atomic_requests", set())
        if all(alias in exempt for alias in atomic):
            continue
        if all(handler.by == MIDDLEWARE for handler in url.handlers):
            continue  # the middleware runs its own class, exempt where it protects
        messages.append(
            Warning(
                f"The view {url.view} at {url.route!r} is protected by @idempotent but "
                "runs inside ATOMIC_REQUESTS, so its claim commits only with the view, and "
                "begin_external() no longer commits the intent before the external call: a "
                "crash during the call leaves no record of it, and the retry calls the "
                "provider again.",
                hint="For an @api_view, put @transaction.non_atomic_requests above "
                "@api_view. For a class whose own dispatch() is overridden, decorate "
                "that dispatch with @transaction.non_atomic_requests. @idempotent then "
                "opens the view's transaction itself, after committing the claim.",
                obj=url.view,
                id="django_idempotency.W002",
            )
        )
    return messages


#: What an optimistic view must not call: duplicates may each run it.
_CALLS_OUT = frozenset(
    {"begin_external", "abegin_external", "set_provider_operation", "aset_provider_operation"}
)


def check_optimistic_views(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """An ``optimistic=True`` handler whose own code calls ``begin_external()`` (E036).

    A look at the handler's source, not at what it calls: the refusal at run
    time (``ImproperlyConfigured``) covers the rest, but only once a request
    gets there.
    """
    if not getattr(settings, "ROOT_URLCONF", None):
        return []
    from django_idempotency._routes import protected_urls

    messages: list[CheckMessage] = []
    seen: set[tuple[str, str]] = set()
    for url in protected_urls():
        for handler in url.handlers:
            # Once per handler: a router's format-suffix route repeats it.
            if not handler.options.optimistic or (url.view, handler.handler) in seen:
                continue
            seen.add((url.view, handler.handler))
            calls = sorted(_calls_out(_handler_function(url, handler.handler)))
            if calls:
                messages.append(
                    error(
                        36,
                        f"The view {url.view} ({handler.handler}) at {url.route!r} runs with "
                        f"optimistic=True but calls {', '.join(calls)}: concurrent duplicates "
                        "may each run an optimistic view, so a call outside the records' "
                        "database would be made once per duplicate (and the call is refused "
                        "at run time).",
                        "Drop optimistic=True from this view (the default mode commits the "
                        "intent before the call and runs the view once), or keep the view's "
                        "effects inside the records' database.",
                    )
                )
    return messages


def _handler_function(url: ProtectedURL, handler: str) -> Any:
    view_class = getattr(url.callback, "cls", getattr(url.callback, "view_class", None))
    function = getattr(view_class, handler, None) if isinstance(view_class, type) else None
    if function is None:
        function = url.callback
    from django_idempotency.decorators import IdempotentView

    # Under @api_view's closure, @idempotent (IdempotentView.view) and any
    # decorators (__wrapped__). Only @api_view's closure cell is followed:
    # a method calling super() has its class in one, and the class's source
    # is not the handler's.
    for _ in range(50):
        inner = getattr(function, "__wrapped__", None)
        if isinstance(function, IdempotentView):
            inner = function.view
        for cell in getattr(function, "__closure__", None) or () if inner is None else ():
            if isinstance(cell.cell_contents, IdempotentView):
                inner = cell.cell_contents
        if inner is None or inner is function:
            break
        function = inner
    return function


def _calls_out(function: Any) -> set[str]:
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return set()  # no source to read (a builtin, a generated function)
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in _CALLS_OUT
    }


def check_operations(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Reconcilers without an operation (W004, W005); operations sharing a name (W006)."""
    if not getattr(settings, "ROOT_URLCONF", None):
        return []  # a worker's settings, say: no URL tells which operations exist
    from django_idempotency._routes import protected_urls
    from django_idempotency.recovery import reconciler_for, registered_operations

    style = idempotency_settings.OPERATION_NAMES
    urls = list(protected_urls())
    named = {url.operation(handler, style) for url in urls for handler in url.handlers}
    messages = list(_shared_names(urls, style))
    if None in named:
        # A callable operation= names its records per request: any name may be one.
        return messages
    for operation in registered_operations():
        # An idempotent_task's operation ("task ...") is in no URLconf, and
        # its module may be imported by workers only: not judged here.
        if operation not in named and not operation.startswith("task "):
            # Named by the reconciler, as W002 names the view.
            reconciler = _dotted(reconciler_for(operation))
            messages.append(_unknown_operation(operation, reconciler, urls, named, style))
    return messages


def _unknown_operation(
    operation: str, reconciler: str, urls: list[ProtectedURL], named: set[str | None], style: str
) -> CheckMessage:
    # The settings under which some protected view has this very name.
    others = [
        other
        for other in OPERATION_NAMES
        if other != style
        and any(
            url.operation(handler, other) == operation for url in urls for handler in url.handlers
        )
    ]
    if others:
        current = sorted(
            {
                repr(url.operation(handler, style))
                for url in urls
                for handler in url.handlers
                if any(url.operation(handler, other) == operation for other in others)
            }
        )
        under = " and ".join(repr(other) for other in others)
        # Kept on purpose while records of the old names drain, or written
        # for the wrong setting: either way never called for new records.
        return Warning(
            f"A reconciler is registered for {operation!r}, which is an operation name "
            f"under IDEMPOTENCY['OPERATION_NAMES'] = {under}, not under the current "
            f"{style!r}: records made from now on are named otherwise.",
            hint=f"Register it as {' or '.join(current)}. While switching settings, keep "
            "the old registration until no unresolved record carries the old name, "
            "then remove it.",
            obj=reconciler,
            id="django_idempotency.W005",
        )
    hint = f"Register it under a protected operation's name{_closest(operation, named)}."
    return Warning(
        f"A reconciler is registered for {operation!r}, but no view protected by "
        "@idempotent, IdempotentMixin or IdempotencyMiddleware has this operation, so it is "
        "never called.",
        hint=hint,
        obj=reconciler,
        id="django_idempotency.W004",
    )


def _dotted(function: object) -> str:
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', '?')}.{name}"


def _closest(operation: str, named: set[str | None]) -> str:
    names = [name for name in named if name is not None]
    close = difflib.get_close_matches(operation, names, n=3)
    if not close:
        return " (none is close to this one; is its view in ROOT_URLCONF?)"
    return ", e.g. " + " or ".join(repr(name) for name in close)


def _shared_names(urls: list[ProtectedURL], style: str) -> Iterator[CheckMessage]:
    """Default names that two different views' handlers share (one key space, one reconciler)."""
    sharing: dict[str, set[tuple[str, str]]] = {}
    for url in urls:
        for handler in url.handlers:
            name = url.operation(handler, style)
            if name is not None and handler.options.operation is None:
                sharing.setdefault(name, set()).add((url.view, handler.handler))
    for name, handlers in sorted(sharing.items()):
        if len(handlers) > 1:
            views = ", ".join(f"{view} ({handler})" for view, handler in sorted(handlers))
            yield Warning(
                f"The operation name {name!r} is shared by {views}: their records share one "
                "key space and one reconciler.",
                hint="Give the URLs distinct names (or namespaces), or give one view "
                "operation=... of its own.",
                obj=name,
                id="django_idempotency.W006",
            )
