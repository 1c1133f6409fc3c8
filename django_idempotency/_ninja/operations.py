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

    def __init__(self, options: Options, level: Level, own_extra: dict[str, Any] | None) -> None:
        #: The operation's own ``openapi_extra``, before protection added to it.
        self.own_extra = own_extra
        self.set(options, level)

    def set(self, options: Options, level: Level) -> None:
        self.options = options
        self.level = level
        # The same options with the tenant Ninja's authentication names, for
        # a project that leaves IDEMPOTENCY["TENANT"] unset.
        self._authenticated = options
        if options.tenant is None:
            self._authenticated = dataclasses.replace(options, tenant=ninja_tenant)

    def options_now(self) -> Options:
        """The options for this request: the project's TENANT, if it set one, is respected."""
        if "TENANT" in idempotency_settings.user_settings:
            return self.options
        return self._authenticated


def protection_of(operation: object) -> Protection | None:
    """The protection installed on this operation object, or None."""
    return cast("Protection | None", getattr(operation, _PROTECTION, None))


def install(operation: Operation, options: Options, level: Level) -> None:
    """Protect ``operation``'s unsafe methods with ``options``, unless a nearer level did.

    An operation answering only safe methods is left alone. A streamed
    answer cannot be stored, so a streaming operation with an unsafe method
    is refused.
    """
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
        if current.level > level or (current.level == level and current.options == options):
            return  # the operation's own @idempotent, or a nearer router's, wins
        current.set(options, level)
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
    protection = Protection(options, level, own_extra)
    setattr(operation, _PROTECTION, protection)
    # Not operation.is_async: Ninja before 1.6 sets it after making the
    # operation, after @idempotent's callback ran.
    call_class = AsyncProtectedCall if isinstance(operation, AsyncOperation) else ProtectedCall
    operation.view_func = call_class(inner, operation, protection)
    _document(operation, protection)


def _document(operation: Operation, protection: Protection) -> None:
    operation.openapi_extra = documented(
        protection.own_extra, protection.options, operation.response_models
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
