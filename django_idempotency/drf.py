"""``IdempotentMixin``: protect every unsafe method of a DRF class-based view."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

from django.http import HttpResponseBase
from rest_framework.request import Request

from django_idempotency._protection.flow import PROTECTED_METHODS, Options
from django_idempotency._protection.keys import KeySource, KeySpec
from django_idempotency.decorators import (
    REFUSED_IN_INITIAL,
    IdempotentView,
    answer_refused_retry,
    mark_views_non_atomic,
    protected_view,
    replay_owed,
)
from django_idempotency.fingerprint import FingerprintSpec
from django_idempotency.outcomes import Outcome
from django_idempotency.scope import OperationSpec

__all__ = ["IdempotentMixin", "protection_of"]


class IdempotentMixin:
    """Protect the POST, PUT, PATCH and DELETE handlers of a DRF view or viewset.

    Place it first among the bases: ``class PaymentViewSet(IdempotentMixin,
    viewsets.ModelViewSet)``. Configure it with the class attributes below;
    they mean what the keyword arguments of ``@idempotent`` mean, and
    ``None`` takes the setting's value. A callable given as a class attribute
    receives only the request (it is read off the class, not bound).

    The protected handler is swapped in by ``initial()``, after
    authentication, permissions and throttling. A handler already decorated
    with ``@idempotent`` keeps its own options. A retry a permission check
    refuses there is answered with its replay when the same principal sent
    the first request (docs/security.md). On adrf's views an ``async def``
    handler is protected by an awaitable handler, its claim run off the
    event loop (docs/adrf.md).

    Attributes:
        idempotency_fingerprint: As ``idempotent(fingerprint=...)``.
        idempotency_operation: As ``idempotent(operation=...)``.
        idempotency_required: As ``idempotent(required=...)``.
        idempotency_ttl: As ``idempotent(ttl=...)``: seconds or a ``timedelta``.
        idempotency_optimistic: As ``idempotent(optimistic=...)``.
        idempotency_key: As ``idempotent(key=...)``: ``"header:<Name>"``,
            ``"body:<field>"``, ``"digest:body"`` or a callable; checked when
            the class is made.
        idempotency_outcome: As ``idempotent(outcome=...)``.
        idempotency_tenant: As ``idempotent(tenant=...)``.
        idempotency_verify: As ``idempotent(verify=...)``.
        idempotency_credential_rotation: As
            ``idempotent(credential_rotation=...)``: for a view that rotates
            or revokes its caller's credential.

    A webhook's signature is checked by the view's authentication class,
    which DRF runs before the handler and so before the claim.
    """

    idempotency_fingerprint: ClassVar[FingerprintSpec] = None
    idempotency_operation: ClassVar[OperationSpec] = None
    idempotency_required: ClassVar[bool | None] = None
    idempotency_ttl: ClassVar[timedelta | float | None] = None
    idempotency_optimistic: ClassVar[bool] = False
    idempotency_key: ClassVar[KeySpec] = None
    idempotency_outcome: ClassVar[Outcome | None] = None
    idempotency_tenant: ClassVar[Callable[[Any], str] | None] = None
    idempotency_verify: ClassVar[Callable[[Any], HttpResponseBase | None] | None] = None
    idempotency_credential_rotation: ClassVar[timedelta | float | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.idempotency_options()  # a typo fails at import, as with @idempotent
        mark_views_non_atomic(cls)

    @classmethod
    def idempotency_options(cls) -> Options:
        """The class attributes as the options ``@idempotent`` takes."""
        # Read off the class: a function stored as a class attribute would
        # come back from an instance as a bound method.
        return Options(
            fingerprint=cls.idempotency_fingerprint,
            operation=cls.idempotency_operation,
            required=cls.idempotency_required,
            ttl=cls.idempotency_ttl,
            optimistic=cls.idempotency_optimistic,
            key=KeySource.of(cls.idempotency_key),
            outcome=cls.idempotency_outcome,
            tenant=cls.idempotency_tenant,
            verify=cls.idempotency_verify,
            credential_rotation=cls.idempotency_credential_rotation,
        )

    def idempotency_protects(self, method: str | None) -> bool:
        return method in PROTECTED_METHODS

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # Runs after authentication, permissions and throttling, and before
        # DRF looks the handler up: swap in the protected handler here.
        try:
            super().initial(request, *args, **kwargs)  # type: ignore[misc]
        except REFUSED_IN_INITIAL as refusal:
            # A retry that its own first run makes a permission refuse, or
            # (credential_rotation) whose credential it revoked: its replay,
            # if it has one (narrow paths), travels with the refusal past
            # any code after DRF's checks, to handle_exception().
            answer_refused_retry(self, request, refusal, args, kwargs)  # type: ignore[arg-type]
            raise
        method = (request.method or "").lower()
        handler = getattr(self, method, None)
        function = getattr(handler, "__func__", None)
        if (
            request.method in PROTECTED_METHODS
            and function is not None
            and not isinstance(function, IdempotentView)
        ):
            setattr(self, method, self._idempotency_handler(request, function))

    def _idempotency_handler(self, request: Request, function: Callable[..., Any]) -> Any:
        """The handler that answers ``request``: ``function`` protected with the class's options.

        Asked after DRF's checks; the middleware's classes answer some
        requests (anonymous ones) with the handler unprotected instead.
        """
        # adrf awaits an ``async def`` handler, and only one: its protection
        # is awaitable too.
        return protected_view(function, type(self).idempotency_options()).__get__(self)

    def handle_exception(self, exc: Exception) -> Any:
        # A refusal of initial() that carries its retry's replay is answered with it.
        replay = replay_owed(exc)
        if replay is not None:
            return replay
        return super().handle_exception(exc)  # type: ignore[misc]


def protection_of(view_class: type, handler_name: str, method: str) -> Options | None:
    """The options a view class protects a handler with, or None if it does not.

    ``handler_name`` is the method's name (``"post"``) or, for a viewset, the
    action's (``"create"``). Used by the system checks and the OpenAPI schema.
    """
    if method.upper() not in PROTECTED_METHODS:
        return None
    if issubclass(view_class, IdempotentMixin):
        return view_class.idempotency_options()
    handler = getattr(view_class, handler_name, None)
    if isinstance(handler, IdempotentView):
        return handler.options
    # @api_view wraps the function in a closure of its own.
    for cell in getattr(handler, "__closure__", None) or ():
        if isinstance(cell.cell_contents, IdempotentView):
            return cell.cell_contents.options
    return None
