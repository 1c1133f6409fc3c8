"""``@idempotent``: HTTP glue for function views and view methods."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from datetime import timedelta
from inspect import iscoroutinefunction
from typing import Any, TypeVar, cast, overload

from asgiref.sync import async_to_sync, sync_to_async
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import Http404, HttpRequest, HttpResponseBase
from rest_framework.exceptions import APIException
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency._protection.answers import render_refusal, rendered
from django_idempotency._protection.flow import Options, protect
from django_idempotency._protection.keys import KeySource, KeySpec
from django_idempotency._protection.transactions import (
    CallersMarks,
    durable_block_refused,
    run_as_django_would,
)
from django_idempotency.conf import as_timedelta
from django_idempotency.exceptions import DurableTransactionInView, IdempotencyRefusal
from django_idempotency.fingerprint import FingerprintSpec
from django_idempotency.outcomes import INPUT_REFUSALS, Outcome, mark_input_refused
from django_idempotency.scope import OperationSpec

__all__ = [
    "DRF_HANDLED",
    "EVERY_DATABASE",
    "EveryDatabase",
    "IdempotentView",
    "idempotent",
    "mark_views_non_atomic",
]

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])

#: Exceptions that DRF's ``handle_exception`` turns into responses. Raised
#: by a protected DRF view they are its answer (a ValidationError is a 400),
#: so they are classified and stored like a returned response.
DRF_HANDLED = (APIException, Http404, PermissionDenied)


class EveryDatabase(set[str]):
    """``_non_atomic_requests`` value exempting a view on every database.

    Protected views take over ``ATOMIC_REQUESTS``: the claim must commit
    before the view's transaction opens, so the decorator opens that
    transaction itself, after the claim (see ``view_transactions``).
    """

    def __contains__(self, alias: object) -> bool:
        return True

    def add(self, alias: str) -> None:
        """``@transaction.non_atomic_requests`` stacked on top: already exempt."""


EVERY_DATABASE = EveryDatabase()


def _call_drf(
    view: APIView, request: Request, call: Callable[[], HttpResponseBase], args: Any, kwargs: Any
) -> HttpResponseBase:
    refused_input = False
    try:
        response = call()
    except DRF_HANDLED as exc:
        refused_input = isinstance(exc, INPUT_REFUSALS)
        response = view.handle_exception(exc)
    # Finalise and render now, inside the transaction, so that the stored
    # body is the exact bytes the client receives. DRF's dispatch finalises
    # again afterwards, which changes nothing on a rendered response.
    response = rendered(view.finalize_response(request, response, *args, **kwargs))  # type: ignore[arg-type]
    if refused_input:
        mark_input_refused(response)
    return response


class IdempotentView:
    """The decorated view: a plain callable for function views, a descriptor in classes."""

    def __init__(self, view: Callable[..., Any], options: Options) -> None:
        functools.update_wrapper(self, view)
        self.view = view
        self.options = options
        self._non_atomic_requests = EVERY_DATABASE

    def __set_name__(self, owner: type, name: str) -> None:
        mark_views_non_atomic(owner)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(args[0], (HttpRequest, Request)):
            request, view_args, instance = args[0], args[1:], None
        else:  # a method: (view instance, request, *args)
            instance, request, view_args = args[0], args[1], args[2:]

        def call() -> HttpResponseBase:
            return cast(HttpResponseBase, self.view(*args, **kwargs))

        drf_view: APIView | None = None
        if isinstance(request, Request):
            drf_view = instance if isinstance(instance, APIView) else request.parser_context["view"]

            def run() -> HttpResponseBase:
                return _call_drf(drf_view, request, call, view_args, kwargs)
        else:

            def run() -> HttpResponseBase:
                return rendered(call())

        try:
            return protect(request, run, self.options, view_args, kwargs)
        except IdempotencyRefusal as exc:
            return render_refusal(request, exc, drf_view=drf_view)
        except RuntimeError as exc:
            raise _named(exc, self.view) from exc


def _async_view(func: Callable[..., Any], options: Options) -> Callable[..., Any]:
    """``@idempotent`` on an ``async def`` Django view.

    The claim, the view and the completion run in one thread-sensitive sync
    block: Django's transactions are not available to async code, and the
    view's writes must share the completion's transaction. The view itself
    still runs as a coroutine on the event loop (``async_to_sync``); its ORM
    calls (``await Model.objects.acreate(...)``) come back to that same
    thread, and so to the same connection and transaction.
    """

    @functools.wraps(func)
    async def view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        def call() -> HttpResponseBase:
            return rendered(async_to_sync(func)(request, *args, **kwargs))

        def run() -> HttpResponseBase:
            try:
                return protect(request, call, options, args, kwargs)
            except IdempotencyRefusal as exc:
                return render_refusal(request, exc)
            except RuntimeError as exc:
                raise _named(exc, func) from exc

        return await sync_to_async(run, thread_sensitive=True)()

    view._non_atomic_requests = EVERY_DATABASE  # type: ignore[attr-defined]
    view.idempotency_options = options  # type: ignore[attr-defined]  # read by routes.py
    return view


def _named(error: RuntimeError, view: Callable[..., Any]) -> RuntimeError:
    """``error``, or for Django's refusal of a durable block, one naming the view and the fix.

    Raised after the protection released the claim (the refused block ran
    nothing): every retry would fail the same way, and Django's message
    names neither the view nor what to do instead.
    """
    database = durable_block_refused(error)
    if database is None:
        return error
    return DurableTransactionInView(
        f"{view.__module__}.{view.__qualname__} opened transaction.atomic(durable=True) on "
        f"database {database!r}, where a protected view runs inside the transaction that "
        "commits its writes together with its outcome, so no block in it is the outermost "
        "one: Django refused it, and would at every retry (the claim was released). Drop "
        "durable=True there: the view's writes already commit together, once, with the "
        "recorded outcome. Work that must commit on its own belongs outside the view, or "
        "after the commit (transaction.on_commit); see 'Durable blocks' in "
        "docs/transactions.md."
    )


def mark_views_non_atomic(view_class: type) -> None:
    """Exempt a class-based view from ATOMIC_REQUESTS where it is protected.

    Django reads ``_non_atomic_requests`` off ``as_view()``'s function, which
    copies it from ``dispatch``; so ``dispatch`` gets a wrapper carrying it.
    The wrapper restores Django's behaviour for the handlers that are not
    protected.
    """
    if not hasattr(view_class, "dispatch"):
        return  # not a view (a mixin of handlers): nothing to exempt here
    inherited = view_class.dispatch
    if getattr(inherited, "_idempotency_dispatch", False):
        return  # already exempted here or on a base class; the check is per request

    def dispatch(self: Any, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        handler = getattr(self, (request.method or "").lower(), None)
        if isinstance(getattr(handler, "__func__", None), IdempotentView) or getattr(
            self, "idempotency_protects", lambda method: False
        )(request.method):
            if isinstance(self, APIView):
                return _dispatch_protected(self, lambda: inherited(self, request, *args, **kwargs))
            return inherited(self, request, *args, **kwargs)
        return run_as_django_would(lambda: inherited(self, request, *args, **kwargs))

    # Not functools.wraps: as_view() copies dispatch's __dict__ onto the view
    # function, and a __wrapped__ there would mislead signature inspection.
    dispatch.__name__ = "dispatch"
    dispatch.__qualname__ = f"{view_class.__qualname__}.dispatch"
    dispatch.__doc__ = inherited.__doc__
    vars(dispatch).update(_non_atomic_requests=EVERY_DATABASE, _idempotency_dispatch=True)
    view_class.dispatch = dispatch


def _dispatch_protected(view: APIView, dispatch: Callable[[], Any]) -> Any:
    """DRF's dispatch of a protected handler: a refusal of DRF's checks dooms no transaction.

    Authentication, permissions and throttles run in ``initial()``, before
    the handler claims anything, outside any transaction of the request's
    (the view is exempt from ``ATOMIC_REQUESTS``). Their refusal (a 401)
    leaves the caller's transaction, a test's, as the same view unprotected
    leaves it, where Django's savepoint takes DRF's mark.
    """
    refused: list[Exception] = []
    checks = view.initial

    def initial(*args: Any, **kwargs: Any) -> None:
        try:
            checks(*args, **kwargs)
        except Exception as exc:
            refused.append(exc)
            raise

    view.initial = initial  # type: ignore[method-assign]  # this request's instance only
    marks = CallersMarks()
    try:
        return dispatch()
    finally:
        if refused:
            marks.put_back(refused[0])


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
    """Run the decorated view once per ``Idempotency-Key`` and replay its outcome.

    Works on DRF ``@api_view`` functions (place it under ``@api_view``), on
    methods of APIView / GenericAPIView / ViewSet classes (``post``, ``put``,
    ``patch``, ``delete``, ``create``, ``update``, ``partial_update``,
    ``destroy``, custom ``@action``s, placed under ``@action``), and on plain
    Django function views, sync or ``async def``. Usable bare
    (``@idempotent``) or with arguments (``@idempotent(ttl=3600)``). Only
    POST, PUT, PATCH and DELETE are protected; other methods run the view
    unprotected. A method decorated with it keeps its own options inside an
    ``IdempotentMixin`` view.

    Args:
        view: The view, when used bare; ``None`` when called with arguments.
        fingerprint: What makes two requests the same request. ``None``: the
            whole canonical input (body, query parameters, URL arguments); a
            list of field names, dotted for nested ones (``"card.token"``); or
            a callable taking the request and returning a JSON-like value.
        operation: The record's namespace within the tenant: a stable name,
            or a callable taking the request. ``None``: the method plus the
            URL route, ``"POST v1/payments"``, written as
            ``IDEMPOTENCY["OPERATION_NAMES"]`` says.
        required: Whether a request without a key is refused with 400 (else
            it runs unprotected). ``None``: ``IDEMPOTENCY["REQUIRED"]``.
        ttl: How long the outcome is kept and replayed, in seconds or as a
            ``timedelta``; must be positive. ``None``: ``IDEMPOTENCY["TTL"]``.
        optimistic: Run the view first and write its record once, finished,
            with one conditional INSERT before the view's transaction
            commits: one commit, no UPDATE. For views whose effects all
            live in the records' database: concurrent duplicates may each
            run the view body; exactly one commits, and the others roll
            back and answer with its replay (or 422; 409 when they gave up
            waiting). ``begin_external()`` is refused. See
            docs/transactions.md, "Optimistic mode".
        key: Where the key comes from. ``None``: the ``IDEMPOTENCY["HEADER"]``
            header, echoed in the response. ``"header:<Name>"`` (a webhook's
            delivery id, ``"header:X-GitHub-Delivery"``), ``"body:<field>"``
            (dotted for nested, ``"body:id"`` for a Stripe event), or a
            callable taking the request and returning the key (a string or
            an integer; ``None``: no key). Validated like the header.
        outcome: Which answers are stored, which release the claim and which
            leave the record UNCERTAIN: a callable taking the response and
            returning a ``Verdict`` (``outcomes.by_status(...)`` builds one).
            ``None``: ``outcomes.standard`` for the ``Idempotency-Key``
            header, ``outcomes.webhook`` (only 2xx stored) for any other key.
        tenant: A callable taking the request and returning the tenant, for
            this view instead of ``IDEMPOTENCY["TENANT"]`` (a webhook's
            verified sender, say).
        verify: A callable taking the request, run before anything is read
            or claimed: it returns ``None`` to go on, or a response (a 401)
            to answer unprotected, or raises. The place to check a plain
            Django view's webhook signature; DRF views use an
            authentication class, which runs before the view.

    Returns:
        The protected view (an async view for an ``async def`` one), or,
        called with arguments, a decorator returning it.

    Raises:
        ImproperlyConfigured: ``fingerprint`` is a string (a list of names
            was meant), ``ttl`` is not positive, ``key`` is no key source,
            or ``outcome``, ``tenant`` or ``verify`` is not callable.
    """
    for name, value in (("outcome", outcome), ("tenant", tenant), ("verify", verify)):
        if value is not None and not callable(value):
            raise ImproperlyConfigured(f"idempotent({name}={value!r}) must be a callable.")
    options = Options(
        fingerprint=fingerprint,
        operation=operation,
        required=required,
        ttl=ttl,
        optimistic=optimistic,
        key=KeySource.of(key),
        outcome=outcome,
        tenant=tenant,
        verify=verify,
    )

    def decorate(func: Callable[..., Any]) -> Any:
        if isinstance(fingerprint, str):
            raise ImproperlyConfigured(
                "idempotent(fingerprint=...) takes a list of field names, not a string."
            )
        if ttl is not None and as_timedelta(ttl) <= timedelta(0):
            raise ImproperlyConfigured(f"idempotent(ttl={ttl!r}) must be a positive duration.")
        if iscoroutinefunction(func):
            return _async_view(func, options)
        return IdempotentView(func, options)

    return decorate(view) if view is not None else decorate
