"""Views whose retries DRF refuses before the protected handler runs.

Shaped after what pretix does (tests/test_replays_past_refusals.py):

- a permission class that reads what the first request changed: the
  caller's charge, not refunded yet (pretix reads the event a DELETE
  removed), so that the first request's own success makes its retry fail
  the permission check;
- a view that rotates the very credential the caller authenticated with
  (pretix's device key roll), so that the retry's authentication fails.

Each kind of protected DRF view has one: ``IdempotentMixin``, an
``@idempotent`` method of an APIView, an ``@idempotent`` viewset action.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.urls import include, path
from rest_framework import status, viewsets
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token
from rest_framework.decorators import action
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission, IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.throttling import AnonRateThrottle, UserRateThrottle
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Charge
from tests.utils import data_of


def owner_of(request: Any) -> str:
    return f"user:{request.user.pk}"


def organisation(request: Any) -> str:
    """One tenant for every user: a tenant coarser than the principal."""
    return "organisation:acme"


class RefundableChargeOfTheCaller(BasePermission):
    """The charge the URL names is the caller's, and not refunded yet.

    Reads the row the first request changes, as pretix's permission classes
    read the event or order a request names: the retry of a refund that
    went through fails it.
    """

    def has_permission(self, request: Any, view: Any) -> bool:
        return Charge.objects.filter(
            pk=view.kwargs["pk"], tenant=owner_of(request), refunded=False
        ).exists()


def refund(request: Request, pk: int) -> Response:
    Charge.objects.filter(pk=pk).update(refunded=True)
    amount = data_of(request).get("amount")
    return Response({"refunded": int(pk), "amount": amount}, status=status.HTTP_201_CREATED)


class MixinRefund(IdempotentMixin, APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated, RefundableChargeOfTheCaller]

    def post(self, request: Request, pk: int) -> Response:
        return refund(request, pk)

    def delete(self, request: Request, pk: int) -> Response:
        Charge.objects.filter(pk=pk).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class MethodRefund(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated, RefundableChargeOfTheCaller]

    @idempotent
    def post(self, request: Request, pk: int) -> Response:
        return refund(request, pk)


class ChargeViewSet(viewsets.GenericViewSet):  # type: ignore[type-arg]
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated, RefundableChargeOfTheCaller]
    queryset = Charge.objects.all()

    @action(detail=True, methods=["post"])
    @idempotent
    def refund(self, request: Request, pk: int) -> Response:
        return refund(request, pk)


class AuditedRefund(MethodRefund):
    """An ``initial()`` of its own over a base whose ``initial()`` answers refused retries already.

    Its own ``@idempotent`` handler wraps its ``initial()`` too: a refused
    retry passes two wrappers, and must be looked up once.
    """

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)

    @idempotent
    def delete(self, request: Request, pk: int) -> Response:
        Charge.objects.filter(pk=pk).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


#: The requests ``initial()`` let through, as an audit trail written after DRF's checks.
PERMITTED: list[str] = []


class AuditTrail:
    """Records each request that passed DRF's checks, after ``super().initial()``.

    Code there may take the checks as passed (pretix loads the event the
    URL names): it must not run for a request a permission check refused,
    even when that request is answered with its replay.
    """

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        PERMITTED.append(f"{request.method} {request.path}")


class AuditedMixinRefund(AuditTrail, MixinRefund):
    pass


class AuditedMethodRefund(AuditTrail, MethodRefund):
    pass


class OptimisticRefund(MixinRefund):
    idempotency_optimistic = True


class OrganisationRefund(MixinRefund):
    """Every user of the organisation is one tenant: replays still go to one principal."""

    idempotency_tenant = organisation


def organisation_of_member(request: Any) -> str:
    """The caller's organisation, its group: callers in none are refused by ``OrganisationMember``.

    Project code that assumes the permission checks passed (raises
    ``Group.DoesNotExist`` for a caller in no group).
    """
    return "organisation:" + str(request.user.groups.get().name)


class OrganisationMember(BasePermission):
    def has_permission(self, request: Any, view: Any) -> bool:
        return bool(request.user.groups.exists())


class MemberRefund(MixinRefund):
    permission_classes = [IsAuthenticated, OrganisationMember]
    idempotency_tenant = organisation_of_member


class OnePerMinute(UserRateThrottle):
    rate = "1/min"


class ThrottledRefund(MixinRefund):
    # DRF checks permissions before throttles: a refused retry is throttled
    # only by the protection's own path.
    throttle_classes = [OnePerMinute]


#: How long the holder of a rotated credential still gets the replay.
ROTATION_WINDOW = timedelta(minutes=5)


def rotate(request: Request) -> Response:
    """Revoke the token the request authenticated with; answer the new one."""
    assert isinstance(request.auth, Token)
    user = request.auth.user
    request.auth.delete()
    new = Token.objects.create(user=user)
    label = data_of(request).get("label")
    return Response({"token": new.key, "label": label}, status=status.HTTP_201_CREATED)


class MixinRotation(IdempotentMixin, APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]
    idempotency_credential_rotation = ROTATION_WINDOW

    def post(self, request: Request) -> Response:
        return rotate(request)


class MethodRotation(APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    @idempotent(credential_rotation=ROTATION_WINDOW)
    def post(self, request: Request) -> Response:
        return rotate(request)


class QuietTokenAuthentication(TokenAuthentication):
    """Ignores an unknown token instead of refusing it: DRF's permission check then answers 401."""

    def authenticate_credentials(self, key: str) -> Any:
        try:
            return super().authenticate_credentials(key)
        except AuthenticationFailed:
            return None


class QuietRotation(MixinRotation):
    authentication_classes = [QuietTokenAuthentication]


class OneAnonymousPerMinute(AnonRateThrottle):
    rate = "1/min"


class ThrottledRotation(MixinRotation):
    # Counts the retries whose authentication failed (anonymous), by address.
    throttle_classes = [OneAnonymousPerMinute]


class RotationWithoutOptIn(IdempotentMixin, APIView):
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsAuthenticated]

    def post(self, request: Request) -> Response:
        return rotate(request)


router = SimpleRouter()
router.register("viewset/charges", ChargeViewSet, basename="refusal-charge")

urlpatterns = [
    path("mixin/charges/<int:pk>", MixinRefund.as_view()),
    path("method/charges/<int:pk>", MethodRefund.as_view()),
    path("organisation/charges/<int:pk>", OrganisationRefund.as_view()),
    path("audited/charges/<int:pk>", AuditedRefund.as_view()),
    path("audit-trail/mixin/charges/<int:pk>", AuditedMixinRefund.as_view()),
    path("audit-trail/method/charges/<int:pk>", AuditedMethodRefund.as_view()),
    path("optimistic/charges/<int:pk>", OptimisticRefund.as_view()),
    path("member/charges/<int:pk>", MemberRefund.as_view()),
    path("throttled/charges/<int:pk>", ThrottledRefund.as_view()),
    path("mixin/rotate", MixinRotation.as_view()),
    path("method/rotate", MethodRotation.as_view()),
    path("quiet/rotate", QuietRotation.as_view()),
    path("throttled/rotate", ThrottledRotation.as_view()),
    path("plain/rotate", RotationWithoutOptIn.as_view()),
    path("", include(router.urls)),
]
