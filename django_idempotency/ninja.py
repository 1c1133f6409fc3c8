"""Django Ninja: ``@idempotent`` for Ninja operations, and for a whole Router or NinjaAPI.

Place it directly under the route decorator, bare or with the keyword
arguments of ``django_idempotency.idempotent``::

    from django_idempotency.ninja import idempotent

    @api.post("/payments")
    @idempotent
    def create_payment(request, payment: PaymentIn): ...

Or protect every POST, PUT, PATCH and DELETE operation of a Router or an
API: ``router.add_decorator(idempotent, mode="view")``. Needs Django Ninja
1.5 or newer: ``pip install "django-idempotency[ninja]"``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, overload

from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase

try:
    from ninja.decorators import decorate_view
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImproperlyConfigured(
        'django_idempotency.ninja needs Django Ninja: pip install "django-idempotency[ninja]"'
    ) from exc

from django_idempotency._ninja.operations import (
    Installer,
    Level,
    function_of,
    install,
    operation_of_run,
)
from django_idempotency._ninja.urls import exempt_from_atomic_requests, path_view_of
from django_idempotency._protection.flow import Options
from django_idempotency._protection.keys import KeySpec
from django_idempotency.decorators import options_from
from django_idempotency.fingerprint import FingerprintSpec
from django_idempotency.outcomes import Outcome
from django_idempotency.scope import OperationSpec

__all__ = ["idempotent", "non_atomic_requests"]

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])
URLs = TypeVar("URLs")


@overload
def idempotent(view: ViewFunc) -> ViewFunc: ...
@overload
def idempotent(
    view: None = None,
    *,
    fingerprint: FingerprintSpec = None,
    operation: OperationSpec = None,
    required: bool | None = None,
    ttl: timedelta | float | None = None,
    optimistic: bool = False,
    key: KeySpec = None,
    outcome: Outcome | None = None,
    tenant: Callable[[Any], str] | None = None,
    verify: Callable[[Any], HttpResponseBase | None] | None = None,
) -> Callable[[ViewFunc], ViewFunc]: ...


def idempotent(
    view: Callable[..., Any] | None = None,
    *,
    fingerprint: FingerprintSpec = None,
    operation: OperationSpec = None,
    required: bool | None = None,
    ttl: timedelta | float | None = None,
    optimistic: bool = False,
    key: KeySpec = None,
    outcome: Outcome | None = None,
    tenant: Callable[[Any], str] | None = None,
    verify: Callable[[Any], HttpResponseBase | None] | None = None,
) -> Any:
    """Run a Django Ninja operation once per ``Idempotency-Key`` and replay its outcome.

    Place it directly under the route decorator (``@api.post(...)``,
    ``@router.put(...)``), on a ``def`` or an ``async def`` operation, bare
    (``@idempotent``) or with arguments (``@idempotent(ttl=3600)``). To
    protect every operation of a Router or a NinjaAPI, hand it to Ninja's
    ``add_decorator(idempotent, mode="view")`` (bare or with arguments); an
    operation's own ``@idempotent`` keeps its options, and a nested router's
    win over its parent's. Only POST, PUT, PATCH and DELETE are protected;
    an operation of safe methods only is left alone.

    The claim comes after Ninja's authentication, throttles and input
    validation (a request Ninja refuses claims nothing), and what is stored
    and replayed is the response the client gets, the operation's result
    rendered or its exception answered by the API's exception handlers.
    The tenant is the client Ninja's authentication names (``request.auth``:
    a user is ``"user:<pk>"``, a string such as an API key a keyed digest of
    it), unless ``IDEMPOTENCY["TENANT"]`` or ``tenant=`` says otherwise.
    Refusals are answered as Ninja answers errors, ``{"detail": ..., "code":
    ...}`` with the statuses, codes and ``Retry-After`` of the DRF path;
    ``@api.exception_handler(IdempotencyRefusal)`` renders them otherwise.
    The operation's OpenAPI schema gets the key header and the refusals.

    Args:
        view: The operation's function, when used bare; ``None`` when called
            with arguments.
        fingerprint: As ``django_idempotency.idempotent``.
        operation: As ``django_idempotency.idempotent``; ``None``: the method
            plus the URL route, ``"POST api/payments"``.
        required: As ``django_idempotency.idempotent``.
        ttl: As ``django_idempotency.idempotent``.
        optimistic: As ``django_idempotency.idempotent``.
        key: As ``django_idempotency.idempotent``.
        outcome: As ``django_idempotency.idempotent``.
        tenant: A callable taking the request and returning the tenant, for
            this operation instead of ``IDEMPOTENCY["TENANT"]``.
        verify: As ``django_idempotency.idempotent``; it runs after Ninja's
            authentication, before anything is read or claimed.

    Returns:
        The function as it was (Ninja protects the operation made from it),
        or, called with arguments, a decorator returning it.

    Raises:
        ImproperlyConfigured: An argument ``django_idempotency.idempotent``
            refuses; or the decorator was applied to a function that is an
            operation already (above the route decorator, or through
            ``add_decorator`` without ``mode="view"``), where it would
            protect nothing; or a protected operation streams its response.
    """
    options = options_from(
        fingerprint=fingerprint,
        operation=operation,
        required=required,
        ttl=ttl,
        optimistic=optimistic,
        key=key,
        outcome=outcome,
        tenant=tenant,
        verify=verify,
    )

    def decorate(target: Callable[..., Any]) -> Any:
        operation = operation_of_run(target)
        if operation is not None:  # add_decorator(..., mode="view"): a router's
            install(operation, options, Level.ROUTER)
            return target
        if hasattr(target, "_ninja_operation"):
            raise ImproperlyConfigured(
                f"@idempotent was given {target.__module__}.{target.__qualname__}, which is a "
                "Ninja operation already: place @idempotent directly under the route "
                "decorator (@api.post(...)), and protect a Router or NinjaAPI with "
                'add_decorator(idempotent, mode="view"), not the default mode="operation".'
            )
        return decorate_view(Installer(options, Level.OPERATION))(target)

    return decorate(view) if view is not None else decorate


def non_atomic_requests(urls: URLs) -> URLs:
    """Hand ``ATOMIC_REQUESTS`` of a Ninja API's protected operations to the protection.

    ``path("api/", non_atomic_requests(api.urls))``: for a database with
    ``ATOMIC_REQUESTS``, as Django's ``transaction.non_atomic_requests`` does
    for a view. A claim made inside the request's transaction would commit
    only with the operation, too late to stop a concurrent duplicate with
    409 or to commit ``begin_external()``'s intent before the call; the
    protection opens the operation's transactions itself, after the claim.
    The API's other operations keep Django's transaction. Check W002 names
    every protected operation that still needs it.

    Args:
        urls: ``api.urls`` (or the list of URL patterns in it).

    Returns:
        ``urls``, its views marked.
    """
    patterns = urls[0] if isinstance(urls, tuple) else urls
    for pattern in patterns if isinstance(patterns, list) else ():
        callback = getattr(pattern, "callback", None)
        if callback is not None:
            exempt_from_atomic_requests(callback)
    return urls


def protect_view(
    view: Callable[..., Any],
    options: Options | Callable[[], Options],
    *,
    exempt: Callable[[Callable[..., Any]], bool] = lambda function: False,
    left_alone: Callable[[HttpRequest], bool] | None = None,
    anonymous_left_alone: Callable[[], bool] | None = None,
) -> bool:
    """Protect the unsafe-method operations of a Ninja URL's view, for project-wide protection.

    For ``IdempotencyMiddleware``'s ``process_view``, which gets the URL
    pattern's view before Django opens ``ATOMIC_REQUESTS``'s transaction:
    each POST, PUT, PATCH or DELETE operation behind ``view`` whose function
    ``exempt`` does not excuse is protected with ``options`` (or what the
    callable gives at each request), at the lowest precedence (its own
    ``@idempotent`` and its routers' ``add_decorator`` keep theirs; an
    operation is protected once), and the view is exempted from
    ``ATOMIC_REQUESTS`` when it has a protected operation. The protection
    sits inside the operation, after Ninja's authentication, where
    ``left_alone`` may let a request run unprotected (an anonymous one:
    ``anonymous_left_alone`` says whether, for the schema).
    Calling it again with the same arguments changes nothing.

    Returns:
        Whether ``view`` is a Ninja view (protected or not).
    """
    path_view = path_view_of(view)
    if path_view is None:
        return False
    for operation in path_view.operations:
        if not exempt(function_of(operation)):
            install(
                operation,
                options,
                Level.PROJECT,
                left_alone=left_alone,
                anonymous_left_alone=anonymous_left_alone,
            )
    exempt_from_atomic_requests(view)
    return True
