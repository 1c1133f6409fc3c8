"""``@idempotent``: HTTP glue for function views and view methods."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast, overload

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import Http404, HttpRequest, HttpResponseBase
from rest_framework import exceptions
from rest_framework.exceptions import APIException
from rest_framework.request import Request
from rest_framework.views import APIView

from django_idempotency._protection.answers import render_refusal, rendered
from django_idempotency._protection.flow import PROTECTED_METHODS, Options, protect
from django_idempotency._protection.keys import KeySource, KeySpec
from django_idempotency._protection.refused import (
    key_of,
    presented_credential,
    principal_of,
    replay_past_authentication_failure,
    replay_past_permission_refusal,
)
from django_idempotency._protection.transactions import (
    CallersMarks,
    durable_block_refused,
    run_as_django_would,
    run_unprotected,
)
from django_idempotency.conf import as_timedelta
from django_idempotency.exceptions import DurableTransactionInView, IdempotencyRefusal
from django_idempotency.fingerprint import FingerprintSpec
from django_idempotency.outcomes import INPUT_REFUSALS, Outcome, mark_input_refused
from django_idempotency.scope import OperationSpec

__all__ = [
    "DRF_HANDLED",
    "EVERY_DATABASE",
    "REFUSED_IN_INITIAL",
    "AsyncIdempotentView",
    "EveryDatabase",
    "IdempotentView",
    "answer_refused_retry",
    "idempotent",
    "idempotent_exempt",
    "mark_refused_retries_answered",
    "mark_views_non_atomic",
    "protected_view",
    "replay_owed",
]

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])
View = TypeVar("View")

#: What ``idempotent_exempt`` sets on a view, a view class or a handler.
EXEMPT_ATTRIBUTE = "idempotency_exempt"
#: The ``__qualname__`` of the class ``@api_view`` makes for each function.
API_VIEW_CLASS = "WrappedAPIView"

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


def unprotected_handler(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, a DRF handler, run unprotected where its class is exempt from ATOMIC_REQUESTS.

    For a request that a protecting class leaves alone (the middleware's
    anonymous requests): the blocks ``ATOMIC_REQUESTS`` would have opened
    are opened here, and DRF's exceptions are answered inside them, as DRF
    answers them inside Django's, so that its rollback mark lands on them.
    """

    def handler(view: APIView, request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        def call() -> HttpResponseBase:
            return cast(HttpResponseBase, function(view, request, *args, **kwargs))

        return run_unprotected(lambda: _call_drf(view, request, call, args, kwargs))

    return handler


def idempotent_exempt(view: View) -> View:
    """Leave a view out of what ``IdempotencyMiddleware`` protects, as ``csrf_exempt`` does.

    Works on a function view, a DRF view class (its subclasses inherit it),
    an ``@api_view`` function (above or below ``@api_view``), the callable
    ``as_view()`` returns (that route only), and a handler method of a DRF
    view or viewset (that method or action only). The view's own
    ``@idempotent`` or ``IdempotentMixin``, if any, still applies.

    Args:
        view: The view, view class or handler.

    Returns:
        ``view`` itself, marked.
    """
    setattr(view, EXEMPT_ATTRIBUTE, True)
    view_class = getattr(view, "cls", None)
    if isinstance(view_class, type) and view_class.__qualname__ == API_VIEW_CLASS:
        # @api_view's own class, made for this one function: marked too, so
        # that what reads classes (the OpenAPI schema) sees it.
        setattr(view_class, EXEMPT_ATTRIBUTE, True)
    return view


class IdempotentView:
    """The decorated view: a plain callable for function views, a descriptor in classes."""

    def __init__(self, view: Callable[..., Any], options: Options) -> None:
        functools.update_wrapper(self, view)
        self.view = view
        self.options = options
        self._non_atomic_requests = EVERY_DATABASE

    def __set_name__(self, owner: type, name: str) -> None:
        mark_views_non_atomic(owner)
        mark_refused_retries_answered(owner)

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run_protected(
            self.view, self.options, args, kwargs, lambda: self.view(*args, **kwargs)
        )


class AsyncIdempotentView(IdempotentView, functools.partial):  # type: ignore[type-arg]
    """The decorated ``async def`` view: Django, adrf and asgiref await it as a coroutine.

    Its call is ``_async_view``'s coroutine function. A ``functools.partial``
    of it, because ``inspect.iscoroutinefunction`` (which adrf asks, of the
    handler it is about to await, of its ``@api_view`` function and of a
    viewset's members) sees through partials on every Python we support,
    where ``inspect.markcoroutinefunction`` only came with 3.12; and a class
    of ours, because a view class learns of its protected handlers through
    ``__set_name__``, as it does of the sync ones.
    """

    def __new__(cls, view: Callable[..., Any], options: Options) -> AsyncIdempotentView:
        return super().__new__(cls, _async_view(view, options))

    # Not IdempotentView's: the partial's, which returns the coroutine.
    __call__ = functools.partial.__call__


def protected_view(view: Callable[..., Any], options: Options) -> IdempotentView:
    """``view`` protected with ``options``: awaitable if ``view`` is an ``async def``.

    Or marked as one, as Django marks the ``as_view()`` of a class of
    ``async def`` handlers (asgiref's test, as Django's: ``inspect``'s sees
    no mark before Python 3.12).
    """
    if iscoroutinefunction(view):
        return AsyncIdempotentView(view, options)
    return IdempotentView(view, options)


def _run_protected(
    view: Callable[..., Any],
    options: Options,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: Callable[[], Any],
) -> HttpResponseBase:
    """Protect one call of ``view`` with ``args``; ``call`` runs it and returns its response."""
    if isinstance(args[0], (HttpRequest, Request)):
        request, view_args, instance = args[0], args[1:], None
    else:  # a method: (view instance, request, *args)
        instance, request, view_args = args[0], args[1], args[2:]

    drf_view: APIView | None = None
    if isinstance(request, Request):
        drf_view = instance if isinstance(instance, APIView) else request.parser_context["view"]

        def run() -> HttpResponseBase:
            return _call_drf(drf_view, request, call, view_args, kwargs)
    else:

        def run() -> HttpResponseBase:
            return rendered(call())

    try:
        return protect(request, run, options, view_args, kwargs)
    except IdempotencyRefusal as exc:
        return render_refusal(request, exc, drf_view=drf_view)
    except RuntimeError as exc:
        named = durable_block_named(exc, view)
        if named is None:
            raise  # the view's own error, its cause kept
        raise named from exc


def _async_view(func: Callable[..., Any], options: Options) -> Callable[..., Any]:
    """The call of ``@idempotent`` on an ``async def`` view: a Django view, adrf's, or a method.

    The claim, the view and the completion run in one thread-sensitive sync
    block: Django's transactions are not available to async code, and the
    view's writes must share the completion's transaction; no query runs
    on the event loop's thread. The view itself still runs as a coroutine
    on the event loop (``async_to_sync``); its ORM calls (``await
    Model.objects.acreate(...)``, adrf's ``asave()``) come back to that same
    thread, and so to the same connection and transaction. A DRF request
    gets what the sync path gives it: DRF's exceptions handled and the
    response finalised before it is stored.
    """

    @functools.wraps(func)
    async def view(*args: Any, **kwargs: Any) -> HttpResponseBase:
        def call() -> HttpResponseBase:
            return cast(HttpResponseBase, async_to_sync(func)(*args, **kwargs))

        def run() -> HttpResponseBase:
            return _run_protected(func, options, args, kwargs, call)

        return await sync_to_async(run, thread_sensitive=True)()

    return view


def durable_block_named(
    error: RuntimeError, view: Callable[..., Any]
) -> DurableTransactionInView | None:
    """For Django's refusal of a durable block, an error naming the view and the fix; else None.

    Raised after the protection released the claim (the refused block ran
    nothing): every retry would fail the same way, and Django's message
    names neither the view nor what to do instead.
    """
    database = durable_block_refused(error)
    if database is None:
        return None
    return DurableTransactionInView(
        f"{view.__module__}.{view.__qualname__} opened transaction.atomic(durable=True) on "
        f"database {database!r}, where a protected view runs inside the transaction that "
        "commits its writes together with its outcome, so no block in it is the outermost "
        "one: Django refused it, and would at every retry (the claim was released). Drop "
        "durable=True there: the view's writes already commit together, once, with the "
        "recorded outcome. Work that must commit on its own belongs outside the view, or "
        "after the commit (transaction.on_commit); see 'Durable blocks' in "
        "docs/transactions.md. A view that must keep its own transactions cannot be "
        "protected: where IdempotencyMiddleware protects it (it has no @idempotent or "
        "IdempotentMixin of its own), mark it idempotent_exempt."
    )


def mark_views_non_atomic(view_class: type) -> None:
    """Exempt a class-based view from ATOMIC_REQUESTS where it is protected.

    Django reads ``_non_atomic_requests`` off ``as_view()``'s function, which
    copies it from ``dispatch``; so ``dispatch`` gets a wrapper carrying it.
    The wrapper restores Django's behaviour for the handlers that are not
    protected. A class served as a coroutine (adrf's async views, a Django
    view of ``async def`` handlers) is dispatched as it is: Django gives
    async views no ``ATOMIC_REQUESTS`` transaction to restore, and DRF's
    checks refuse on the event loop's thread, where no transaction of the
    caller's is open.
    """
    if not hasattr(view_class, "dispatch"):
        return  # not a view (a mixin of handlers): nothing to exempt here
    inherited = view_class.dispatch
    if getattr(inherited, "_idempotency_dispatch", False):
        return  # already exempted here or on a base class; the check is per request

    def dispatch(self: Any, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        own_class: type = type(self)  # a subclass may serve other handlers
        if _served_async(own_class):
            return inherited(self, request, *args, **kwargs)  # a coroutine, awaited by Django
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


@functools.cache
def _served_async(view_class: type) -> bool:
    """Whether ``as_view()`` serves ``view_class`` as a coroutine (Django's ``view_is_async``).

    Asked once per class: adrf's viewsets answer it by inspecting every member.
    """
    return bool(getattr(view_class, "view_is_async", False))


#: What DRF's ``initial()`` raises for a refused permission (an
#: authenticated caller) and for a failed authentication: narrow paths may
#: answer such a retry with its replay (``answer_refused_retry``).
REFUSED_IN_INITIAL = (
    exceptions.PermissionDenied,
    exceptions.NotAuthenticated,
    exceptions.AuthenticationFailed,
)


def answer_refused_retry(
    view: APIView, request: Request, refusal: APIException, args: Any, kwargs: Any
) -> bool:
    """Whether a retry refused in DRF's ``initial()`` is owed its replay.

    If it is, the replay travels with ``refusal``, which the caller raises
    on: it leaves every ``initial()`` as DRF's refusal would, so that no
    code written after DRF's checks runs (a subclass's ``initial()`` that
    loads what the checks allowed), and the view's ``handle_exception()``
    answers with the replay (``replay_owed``). Only for a method the view
    protects and a request with a key: a permission refused to the
    principal that sent the first request, or (views with
    ``credential_rotation``) a failed authentication with the credential
    the first request presented. The view's throttles run first (they may
    raise ``Throttled``), so that a throttled request runs no SQL. Looked
    up once per refusal, however many ``initial()`` wrappers it passes.
    """
    if getattr(refusal, "_idempotency_looked_up", False):
        return False
    refusal._idempotency_looked_up = True  # type: ignore[attr-defined]
    options = _options_for(view, request)
    if options is None:
        return False
    replay: HttpResponseBase | None = None
    if isinstance(refusal, exceptions.PermissionDenied):
        principal = principal_of(request)
        key = key_of(request, options) if principal is not None else None
        if principal is None or key is None:
            return False
        view.check_throttles(request)
        replay = replay_past_permission_refusal(
            request, options, args, kwargs, principal=principal, key=key
        )
    elif options.credential_window is not None:
        credential = presented_credential(request)
        key = key_of(request, options) if credential is not None else None
        if credential is None or key is None:
            return False
        view.check_throttles(request)
        replay = replay_past_authentication_failure(
            request, options, args, kwargs, credential=credential, key=key
        )
    if replay is None:
        return False
    refusal._idempotency_replay = replay  # type: ignore[attr-defined]
    return True


def replay_owed(exc: Exception) -> HttpResponseBase | None:
    """The replay a refusal of DRF's ``initial()`` carries (``answer_refused_retry``), or None.

    For a view's ``handle_exception()``: a refusal that carries one is
    answered with it, instead of DRF's 403 or 401.
    """
    return cast("HttpResponseBase | None", getattr(exc, "_idempotency_replay", None))


def _options_for(view: APIView, request: Request) -> Options | None:
    """The options the view protects the request's method with; None: unprotected."""
    if request.method not in PROTECTED_METHODS:
        return None
    handler = getattr(view, (request.method or "").lower(), None)
    function = getattr(handler, "__func__", None)
    if isinstance(function, IdempotentView):
        return function.options
    protects = getattr(view, "idempotency_protects", None)  # IdempotentMixin's
    if handler is not None and protects is not None and protects(request.method):
        return cast(Options, type(view).idempotency_options())  # type: ignore[attr-defined]
    return None


def mark_refused_retries_answered(view_class: type) -> None:
    """Answer the retries DRF refuses in ``initial()`` where the class protects a handler.

    For DRF views with ``@idempotent`` methods (``IdempotentMixin`` does it
    in its own ``initial()`` and ``handle_exception()``): ``initial`` gets a
    wrapper that hands a refused permission or a failed authentication to
    ``answer_refused_retry``, and ``handle_exception`` one that answers a
    refusal carrying a replay with it. A plain Django view, or a class of
    handlers that is no view, is left alone.
    """
    inherited = getattr(view_class, "initial", None)
    handle = getattr(view_class, "handle_exception", None)
    if (
        inherited is None
        or handle is None
        or not hasattr(view_class, "check_throttles")  # not a DRF view
        or hasattr(view_class, "idempotency_protects")  # IdempotentMixin: its own
        or getattr(inherited, "_idempotency_initial", False)  # here or on a base already
    ):
        return

    def initial(self: Any, request: Request, *args: Any, **kwargs: Any) -> None:
        try:
            inherited(self, request, *args, **kwargs)
        except REFUSED_IN_INITIAL as refusal:
            answer_refused_retry(self, request, refusal, args, kwargs)
            raise  # with its replay, if owed: answered by handle_exception

    def handle_exception(self: Any, exc: Exception) -> Any:
        replay = replay_owed(exc)
        return handle(self, exc) if replay is None else replay

    for name, function, wrapped in (
        ("initial", initial, inherited),
        ("handle_exception", handle_exception, handle),
    ):
        function.__name__ = name
        function.__qualname__ = f"{view_class.__qualname__}.{name}"
        function.__doc__ = wrapped.__doc__
        setattr(view_class, name, function)
    initial._idempotency_initial = True  # type: ignore[attr-defined]


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
    credential_rotation: timedelta | float | None = None,
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
    credential_rotation: timedelta | float | None = None,
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
    ``IdempotentMixin`` view. On a method of a DRF class, a retry that a
    permission check refuses is answered with its replay when the same
    principal sent the first request (docs/security.md).

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
            header, echoed in the response. ``"header:<Name>"`` (another
            header), ``"body:<field>"`` (dotted for nested, ``"body:id"`` for
            a Stripe event), ``"digest:body"`` (the SHA-256 of the raw body,
            for a signed webhook whose body names no event id, such as
            GitHub's), or a callable taking the request and returning the
            key (a string or an integer; ``None``: no key). Validated like
            the header. A webhook's key must come from what its signature
            covers: an unsigned header lets a captured body run again.
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
        credential_rotation: For a DRF view that rotates or revokes the
            credential its caller authenticates with (a device key roll):
            for how long (seconds or a ``timedelta``, at most an hour) a
            retry whose authentication fails still gets the replay, when
            it presents the same credential (its ``Authorization``
            header, kept as a keyed digest) with the same key and input.
            ``None``: such a retry gets DRF's 401 (docs/security.md).

    Returns:
        The protected view (an async view for an ``async def`` one), or,
        called with arguments, a decorator returning it.

    Raises:
        ImproperlyConfigured: ``fingerprint`` is a string (a list of names
            was meant), ``ttl`` is not positive, ``key`` is no key source,
            ``outcome``, ``tenant`` or ``verify`` is not callable, or
            ``credential_rotation`` is not a positive duration of an hour
            at most.
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
        credential_rotation=credential_rotation,
    )

    def decorate(func: Callable[..., Any]) -> Any:
        return protected_view(func, options)

    return decorate(view) if view is not None else decorate


def options_from(
    *,
    fingerprint: FingerprintSpec,
    operation: OperationSpec,
    required: bool | None,
    ttl: timedelta | float | None,
    optimistic: bool,
    key: KeySpec,
    outcome: Outcome | None,
    tenant: Callable[[Any], str] | None,
    verify: Callable[[Any], HttpResponseBase | None] | None,
    credential_rotation: timedelta | float | None = None,
) -> Options:
    """``idempotent()``'s keyword arguments as ``Options``, checked (its Raises section)."""
    for name, value in (("outcome", outcome), ("tenant", tenant), ("verify", verify)):
        if value is not None and not callable(value):
            raise ImproperlyConfigured(f"idempotent({name}={value!r}) must be a callable.")
    if isinstance(fingerprint, str):
        raise ImproperlyConfigured(
            "idempotent(fingerprint=...) takes a list of field names, not a string."
        )
    if ttl is not None and as_timedelta(ttl) <= timedelta(0):
        raise ImproperlyConfigured(f"idempotent(ttl={ttl!r}) must be a positive duration.")
    return Options(
        fingerprint=fingerprint,
        operation=operation,
        required=required,
        ttl=ttl,
        optimistic=optimistic,
        key=KeySource.of(key),
        outcome=outcome,
        tenant=tenant,
        verify=verify,
        credential_rotation=credential_rotation,
    )
