"""The payments API. Both mutations are protected by ``@idempotent``.

- ``POST /v1/payments``: create a payment (``Idempotency-Key`` required).
- ``GET /v1/payments`` (``?order_id=``) and ``GET /v1/payments/<id>``: the
  caller's own payments only.
- ``POST /v1/payments/<id>/refunds``: refund part or all of a payment
  (``Idempotency-Key`` required).

The tenant is the authenticated user (the package's default resolver gives
``"user:<pk>"``), so one user's keys never replay another user's answers.

Creating a payment charges the card through the payment provider
(``provider_client``; the simulator in ``testproject/provider``) with the
context API: the intent commits before the call, the charge id as soon as
it is known, the Payment together with the stored answer. A request that
dies in between is settled by ``payments.reconcilers.settle_payment``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import QuerySet, Sum
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from payments import crash_hooks, provider_client
from payments.models import Payment
from payments.rendering import order_already_paid_detail, payment_data, payment_location
from payments.serializers import PaymentSerializer, RefundSerializer


class OrderAlreadyPaid(APIException):
    """The domain guard fired: this order already has a payment."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "order_already_paid"
    default_detail = "This order has already been paid."

    def __init__(self, order_id: str) -> None:
        # Same body shape as django-idempotency's refusals: {"detail", "code"}.
        super().__init__(order_already_paid_detail(order_id), self.default_code)


class ProviderUnavailable(APIException):
    """The provider did not answer (or failed): the charge's fate is unknown."""

    status_code = status.HTTP_502_BAD_GATEWAY
    default_code = "payment_provider_unavailable"
    default_detail = (
        "The payment provider did not confirm the charge. Retry with the same "
        "Idempotency-Key: you get 503 until the payment is settled, then its outcome."
    )

    def __init__(self) -> None:
        super().__init__(
            {"detail": str(self.default_detail), "code": self.default_code}, self.default_code
        )


def simulation_of(request: Request) -> dict[str, str | None]:
    """The provider simulator's failure mode this request asks for, if allowed.

    Only with ``PAYMENTS_PROVIDER_SIMULATION`` on (the demo and the live
    tests): ``X-Simulate`` and ``X-Simulate-Delay`` are passed to the
    provider. Headers are not part of the request fingerprint, so a retry
    without them is the same request.
    """
    if not getattr(settings, "PAYMENTS_PROVIDER_SIMULATION", False):
        return {}
    return {
        "simulate": request.headers.get("X-Simulate"),
        "simulate_delay": request.headers.get("X-Simulate-Delay"),
    }


def payer(request: Request) -> User:
    """The signed-in user, whom IsAuthenticated guarantees (never AnonymousUser)."""
    user = request.user
    assert isinstance(user, get_user_model()), user
    return user


class PaymentViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet[Payment],
):
    serializer_class = PaymentSerializer
    # Explicit, so the API stays closed whatever the project's default is.
    permission_classes = [IsAuthenticated]
    # With the router's path converters the operation name is the stable
    # "POST v1/payments/<int:pk>/refunds" and pk arrives as an int.
    lookup_value_converter = "int"

    def get_queryset(self) -> QuerySet[Payment]:
        payments = Payment.objects.filter(owner=payer(self.request))
        if self.action == "list" and "order_id" in self.request.query_params:
            payments = payments.filter(order_id=self.request.query_params["order_id"])
        return payments

    @idempotent
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        # Refused input: a 400, not stored, so the corrected body may be
        # sent with the same key.
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        order_id = data["order_id"]
        # One payment per order, checked before any money moves. Locking the
        # owner's row serialises their payments, so the check holds until
        # this transaction commits (SQLite serialises writers anyway).
        owner = payer(request)
        get_user_model().objects.select_for_update().get(pk=owner.pk)
        if Payment.objects.filter(owner=owner, order_id=order_id).exists():
            # A 409 is "retryable" for django-idempotency: the claim is
            # released and nothing is stored for this key.
            raise OrderAlreadyPaid(order_id)

        # 1. The intent (IN_PROGRESS + provider key) commits before the call.
        provider_key = request.idempotency.begin_external()  # type: ignore[attr-defined]
        crash_hooks.checkpoint(request, "after-begin-external")
        try:
            charge = provider_client.create_charge(
                provider_key,
                data["amount"],
                data["currency"],
                # What the reconciler needs to rebuild this Payment should
                # the process die before it commits.
                metadata={
                    "owner_id": request.user.pk,
                    "order_id": order_id,
                    "amount": data["amount"],
                    "currency": data["currency"],
                },
                **simulation_of(request),
            )
        except provider_client.PaymentDeclined as exc:
            # Definitive, and nothing was charged: a 402 stored as FAILED.
            return Response(
                {"detail": str(exc), "code": exc.code}, status=status.HTTP_402_PAYMENT_REQUIRED
            )
        except provider_client.ProviderRejected as exc:
            # The provider refused the request itself and charged nothing.
            return Response(
                {"detail": f"The payment provider refused the charge ({exc}).", "code": exc.code},
                status=status.HTTP_422_UNPROCESSABLE_ENTITY,
            )
        except provider_client.ProviderError as exc:
            # Unknown whether the card was charged: 502, and the record
            # stays UNCERTAIN (503 to retries) until the reconciler has
            # asked the provider.
            raise ProviderUnavailable() from exc
        if (charge.metadata.get("owner_id"), charge.metadata.get("order_id")) != (
            request.user.pk,
            order_id,
        ):
            # The provider answered with a charge it made for another order
            # under this provider key: nothing was charged for this one.
            return Response(
                {
                    "detail": f"The payment provider answered charge {charge.id}, which "
                    "pays another order. Nothing was charged; use a new Idempotency-Key.",
                    "code": "provider_key_conflict",
                },
                status=status.HTTP_422_UNPROCESSABLE_ENTITY,
            )
        crash_hooks.checkpoint(request, "after-provider-charge")
        # 2. The provider's id commits as soon as it is known.
        request.idempotency.set_provider_operation(charge.id)  # type: ignore[attr-defined]

        # 3. The Payment and the stored 201 commit together.
        try:
            # A savepoint, so that the constraint violation leaves the
            # request's transaction usable.
            with transaction.atomic():
                payment = serializer.save(owner=request.user, provider_charge_id=charge.id)
        except IntegrityError:
            if not Payment.objects.filter(owner=owner, order_id=order_id).exists():
                raise
            # Only if something bypassed the lock above. After the charge,
            # the 409 leaves the record UNCERTAIN; the reconciler answers it
            # (409 order_already_paid, FAILED). A real integration would
            # refund the charge.
            raise OrderAlreadyPaid(order_id) from None
        crash_hooks.checkpoint(request, "after-payment-write")
        body = payment_data(payment)
        return Response(
            body, status=status.HTTP_201_CREATED, headers={"Location": payment_location(payment)}
        )

    @action(detail=True, methods=["post"], url_path="refunds")
    @idempotent
    def refund(self, request: Request, pk: int | None = None) -> Response:
        payment = self.get_object()  # 404 unless it is the caller's payment
        # Lock the payment so that concurrent refunds (different keys) cannot
        # together exceed it; SQLite serialises writers anyway.
        payment = Payment.objects.select_for_update().get(pk=payment.pk)
        serializer = RefundSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        amount = serializer.validated_data["amount"]
        refunded = payment.refunds.aggregate(total=Sum("amount"))["total"] or 0
        if refunded + amount > payment.amount:
            # A definitive 4xx, decided by what was refunded so far: returned
            # (not raised, as refused input is), so it is stored as FAILED
            # and replayed to retries.
            left = payment.amount - refunded
            return Response(
                {
                    "amount": [
                        f"Refunds would total {refunded + amount}, more than the "
                        f"payment's {payment.amount} ({left} left)."
                    ]
                },
                status=status.HTTP_400_BAD_REQUEST,
            )
        refund = serializer.save(payment=payment)
        payment.status = (
            Payment.Status.REFUNDED
            if refunded + amount == payment.amount
            else Payment.Status.PARTIALLY_REFUNDED
        )
        payment.save(update_fields=["status"])
        return Response(RefundSerializer(refund).data, status=status.HTTP_201_CREATED)
