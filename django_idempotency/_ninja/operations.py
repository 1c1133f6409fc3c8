"""Protection inside a Ninja operation: claimed after Ninja's checks, settled from its response.

Ninja's ``Operation.run`` authenticates, throttles and validates the input,
then calls ``operation.view_func(request, **values)`` and makes the result a
response. ``install`` puts a ``ProtectedCall`` in place of ``view_func`` on
the operation object: so the claim comes after authentication, throttles
and validation (a request Ninja refuses claims nothing, as DRF's checks and
refused input claim nothing), and the protected run ends with the response
the client gets, the view's result made a response by the operation, or its
exception answered by the API's handlers: that is what is stored and
replayed. Ninja's ``run`` hands a response on unchanged.

A call is bound to one operation object, whose API renders its answers. A
router mounted twice gets a copy of each operation per mount
(``Operation.clone``, Ninja 1.6+); the copy keeps the original's
``view_func`` but Ninja re-applies the operation's run decorators to it, and
``Installer`` is one: it binds a call of the copy's own.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from asgiref.sync import async_to_sync, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from ninja.errors import ValidationError
from ninja.operation import AsyncOperation, Operation

from django_idempotency._ninja.answers import refusal_response
from django_idempotency._ninja.schema import documented
from django_idempotency._ninja.tenant import ninja_tenant
from django_idempotency._protection.answers import rendered
from django_idempotency._protection.flow import PROTECTED_METHODS, Options, protect
from django_idempotency._protection.transactions import run_unprotected
from django_idempotency.conf import idempotency_settings
from django_idempotency.decorators import durable_block_named
from django_idempotency.exceptions import IdempotencyRefusal
from django_idempotency.outcomes import mark_input_refused

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

#: Where an operation object keeps its ``Protection``. Never copied to a
#: clone (``Operation.clone`` copies named attributes): a copy is protected
#: when the installer binds it.
_PROTECTION = "_idempotency_protection"
#: Whether a request runs unprotected, asked once Ninja has authenticated it.
LeftAlone = Callable[["HttpRequest"], bool]
#: Whether anonymous requests run unprotected (``left_alone`` leaves them),
#: asked as the schema is written: where Ninja lets one reach the
#: operation (no authentication), the key's description says so, and the
#: key is not required.
AnonymousLeftAlone = Callable[[], bool]
#: Installs one at a time: the project-wide protection installs at requests.
_installing = threading.Lock()
#: Where an unprotected operation of a URL exempt from ATOMIC_REQUESTS
#: keeps its run before ``urls`` put it in Django's blocks.
RUN_OUTSIDE_DJANGOS_BLOCKS = "_idempotency_run_outside_djangos_blocks"


class Level(enum.IntEnum):
    """Who asked for the protection: the nearer to the operation wins."""

    #: The project-wide middleware.
    PROJECT = 1
    #: ``add_decorator`` on a NinjaAPI or a Router (a nested router's comes later, and wins).
    ROUTER = 2
    #: ``@idempotent`` under the operation's route decorator.
    OPERATION = 3


class Protection:
    """How an operation is protected, and by whom; its call reads it at each request."""

    def __init__(
        self,
        options: Options | Callable[[], Options],
        level: Level,
        own_extra: dict[str, Any] | None,
        left_alone: LeftAlone | None = None,
        anonymous_left_alone: AnonymousLeftAlone | None = None,
    ) -> None:
        #: The operation's own ``openapi_extra``, before protection added to it.
        self.own_extra = own_extra
        self.set(options, level, left_alone, anonymous_left_alone)

    def set(
        self,
        options: Options | Callable[[], Options],
        level: Level,
        left_alone: LeftAlone | None = None,
        anonymous_left_alone: AnonymousLeftAlone | None = None,
    ) -> None:
        #: The options, or what gives them at each request (the middleware's
        #: depend on a setting: ``override_settings`` must be seen).
        self.given = options
        self.level = level
        #: Asked after Ninja's authentication: True runs the request unprotected.
        self.left_alone = left_alone
        self.anonymous_left_alone = anonymous_left_alone
        self._with_tenant: dict[int, tuple[Options, Options]] = {}

    @property
    def options(self) -> Options:
        given = self.given
        return given() if callable(given) else given

    def options_now(self) -> Options:
        """The options for this request, with the tenant Ninja's authentication names.

        Unless the options name a tenant of their own, or the project set
        ``IDEMPOTENCY["TENANT"]``, which is then respected.
        """
        options = self.options
        if options.tenant is not None or "TENANT" in idempotency_settings.user_settings:
            return options
        made = self._with_tenant.get(id(options))
        if made is None or made[0] is not options:
            made = (options, dataclasses.replace(options, tenant=ninja_tenant))
            self._with_tenant[id(options)] = made
        return made[1]


def protection_of(operation: object) -> Protection | None:
    """The protection installed on this operation object, or None."""
    return cast("Protection | None", getattr(operation, _PROTECTION, None))


def install(
    operation: Operation,
    options: Options | Callable[[], Options],
    level: Level,
    *,
    left_alone: LeftAlone | None = None,
    anonymous_left_alone: AnonymousLeftAlone | None = None,
) -> None:
    """Protect ``operation``'s unsafe methods with ``options``, unless a nearer level did.

    ``options`` may be a callable giving them at each request;
    ``left_alone``, asked after Ninja's authentication, may leave a request
    unprotected (``anonymous_left_alone``: anonymous ones). An operation
    answering only safe methods is left alone. A streamed answer cannot be
    stored, so a streaming operation with an unsafe method is refused (left
    alone by the project-wide protection).
    """
    with _installing:
        _install(operation, options, level, left_alone, anonymous_left_alone)


def _install(
    operation: Operation,
    options: Options | Callable[[], Options],
    level: Level,
    left_alone: LeftAlone | None,
    anonymous_left_alone: AnonymousLeftAlone | None = None,
) -> None:
    if not PROTECTED_METHODS.intersection(operation.methods):
        return
    if getattr(operation, "stream_format", None) is not None:
        if level is Level.PROJECT:
            return  # protection everywhere it can be: a streamed answer cannot
        raise ImproperlyConfigured(
            f"The Ninja operation {_name(operation)} streams its response, which cannot be "
            "stored and replayed: leave it unprotected (move it out of the router that "
            "add_decorator(idempotent) protects)."
        )
    current = protection_of(operation)
    if current is not None:
        if current.level > level:
            return  # the operation's own @idempotent, or a nearer router's, wins
        if (current.level, current.given, current.left_alone) == (level, options, left_alone):
            return  # again: the project-wide protection asks at each request
        current.set(options, level, left_alone, anonymous_left_alone)
        _document(operation, current)
        return
    unwrapped = getattr(operation, RUN_OUTSIDE_DJANGOS_BLOCKS, None)
    if unwrapped is not None:
        # Protected after its URL was exempted (by the middleware, at its
        # first request): the protection opens the blocks, after the claim.
        operation.run = unwrapped  # type: ignore[method-assign]
        delattr(operation, RUN_OUTSIDE_DJANGOS_BLOCKS)
    copied = operation.view_func
    if isinstance(copied, ProtectedCall):
        # A copy of a protected operation (a second mount): the original's
        # call came along, bound to the original; bind one to the copy.
        inner, own_extra = copied.inner, copied.protection.own_extra
    else:
        inner, own_extra = copied, operation.openapi_extra
    protection = Protection(options, level, own_extra, left_alone, anonymous_left_alone)
    setattr(operation, _PROTECTION, protection)
    # Not operation.is_async: Ninja before 1.6 sets it after making the
    # operation, after @idempotent's callback ran.
    call_class = AsyncProtectedCall if isinstance(operation, AsyncOperation) else ProtectedCall
    operation.view_func = call_class(inner, operation, protection)
    _document(operation, protection)


def _document(operation: Operation, protection: Protection) -> None:
    anonymous = protection.anonymous_left_alone
    # Ninja refuses an anonymous request to an operation with authentication (401).
    anonymous_unprotected = anonymous is not None and anonymous() and not operation.auth_callbacks
    operation.openapi_extra = documented(
        protection.own_extra,
        protection.options,
        operation.response_models,
        anonymous_unprotected=anonymous_unprotected,
    )


def _name(operation: Operation) -> str:
    function = operation.view_func
    return f"{function.__module__}.{function.__qualname__} ({', '.join(operation.methods)})"


class Installer:
    """A Ninja run decorator that installs protection on the operation whose run it is given.

    ``ninja.decorators.decorate_view`` applies it when the operation is made,
    and ``Operation.clone`` again to each copy; ``add_decorator(...,
    mode="view")`` applies it when a router is mounted. It returns the run
    as it is: the protection sits in the view function, after Ninja's checks.
    """

    def __init__(self, options: Options, level: Level) -> None:
        self.options = options
        self.level = level

    def __call__(self, run: Callable[..., Any]) -> Callable[..., Any]:
        operation = operation_of_run(run)
        if operation is None:
            raise ImproperlyConfigured(
                f"{run!r} is not the run of a Ninja operation: django_idempotency.ninja's "
                "idempotent protects an operation when placed directly under its route "
                "decorator, or a whole Router or NinjaAPI through "
                'add_decorator(idempotent, mode="view").'
            )
        install(operation, self.options, self.level)
        return run


def function_of(operation: Operation) -> Callable[..., Any]:
    """The operation's own function: under its protection, if it has one."""
    function = operation.view_func
    return function.inner if isinstance(function, ProtectedCall) else function


def operation_of_run(run: object) -> Operation | None:
    """The operation whose bound ``run`` this is, under decorators that kept ``__wrapped__``."""
    for _ in range(50):  # a cycle of __wrapped__ is not ours to loop on
        owner = getattr(run, "__self__", None)
        if isinstance(owner, Operation):
            return owner
        run = getattr(run, "__wrapped__", None)
        if run is None:
            return None
    return None


class ProtectedCall:
    """What a protected operation calls as its view function: the protected run."""

    def __init__(
        self, inner: Callable[..., Any], operation: Operation, protection: Protection
    ) -> None:
        # Ninja names URLs and OpenAPI operations after the view function.
        functools.update_wrapper(self, inner, updated=())
        self.inner = inner
        self.operation = operation
        self.protection = protection

    def __call__(self, request: HttpRequest, *args: Any, **values: Any) -> HttpResponseBase:
        return self.protected(request, lambda: self.inner(request, *args, **values), values)

    def protected(
        self, request: HttpRequest, call: Callable[[], Any], values: dict[str, Any]
    ) -> HttpResponseBase:
        """``call``'s answer, at most once per key; refusals answered as the API answers errors."""
        operation = self.operation

        def view() -> HttpResponseBase:
            return _finished(operation, request, call, values)

        left_alone = self.protection.left_alone
        if left_alone is not None and left_alone(request):
            return run_unprotected(view)
        match = request.resolver_match
        url_kwargs = match.kwargs if match is not None else {}
        try:
            return protect(request, view, self.protection.options_now(), (), url_kwargs)
        except IdempotencyRefusal as refusal:
            return refusal_response(operation.api, request, refusal)
        except RuntimeError as exc:
            named = durable_block_named(exc, self.inner)
            if named is None:
                raise  # the view's own error, its cause kept
            raise named from exc


class AsyncProtectedCall(ProtectedCall):
    """``ProtectedCall`` for an ``async def`` operation.

    The claim, the view and the completion run in one thread-sensitive sync
    block, as for an async Django view (``decorators._async_view``): no
    database call on the event loop, and the view's ORM calls come back to
    the thread, connection and transaction of the completion.
    """

    async def __call__(  # type: ignore[override]
        self, request: HttpRequest, *args: Any, **values: Any
    ) -> HttpResponseBase:
        def call() -> Any:
            return async_to_sync(self.inner)(request, *args, **values)

        run = functools.partial(self.protected, request, call, values)
        return await sync_to_async(run, thread_sensitive=True)()


def _finished(
    operation: Operation, request: HttpRequest, call: Callable[[], Any], values: dict[str, Any]
) -> HttpResponseBase:
    """The view's answer as the client gets it: its result made a response, or its error answered.

    As ``Operation.run`` would: the result through the operation's response
    schema, an exception through the API's handlers. A database error is
    left to the protection, which knows what it means for the record.
    """
    response_arg = operation.signature.response_arg
    # The response object the view was handed, or the one run would make.
    temporal = values[response_arg] if response_arg else None
    if temporal is None:
        temporal = operation.api.create_temporal_response(request)
    try:
        # Private, but the same in every Ninja release this package supports.
        response = operation._result_to_response(request, call(), temporal)
    except DatabaseError:
        raise
    except ValidationError as exc:
        # Input the view itself refused (as DRF's ValidationError): the
        # client may correct it and retry with the same key.
        response = operation.api.on_exception(request, exc)
        mark_input_refused(response)
    except Exception as exc:
        response = operation.api.on_exception(request, exc)
    return rendered(response)
