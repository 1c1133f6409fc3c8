"""The payments API. Both mutations are protected by ``@idempotent``.

- ``POST /v1/payments``: create a payment (``Idempotency-Key`` required).
- ``GET /v1/payments`` (``?order_id=``) and ``GET /v1/payments/<id>``: the
  caller's own payments only.
- ``POST /v1/payments/<id>/refunds``: refund part or all of a payment
  (``Idempotency-Key`` required).

The tenant is the authenticated user (the package's default resolver gives
``"user:<pk>"``), so one user's keys never replay another user's answers.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import QuerySet, Sum
from django.urls import reverse
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from payments.models import Payment
from payments.serializers import PaymentSerializer, RefundSerializer


class OrderAlreadyPaid(APIException):
    """The domain guard fired: this order already has a payment."""

    status_code = status.HTTP_409_CONFLICT
    default_code = "order_already_paid"
    default_detail = "This order has already been paid."

    def __init__(self, order_id: str) -> None:
        # Same body shape as django-idempotency's refusals: {"detail", "code"}.
        super().__init__(
            {"detail": f"Order {order_id!r} has already been paid.", "code": self.default_code},
            self.default_code,
        )


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
        payments = Payment.objects.filter(owner=self.request.user)
        if self.action == "list" and "order_id" in self.request.query_params:
            payments = payments.filter(order_id=self.request.query_params["order_id"])
        return payments

    @idempotent
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)  # 400, stored and replayed
        order_id = serializer.validated_data["order_id"]
        try:
            # A savepoint, so that the constraint violation leaves the
            # request's transaction usable.
            with transaction.atomic():
                payment = serializer.save(owner=request.user)
        except IntegrityError:
            if not Payment.objects.filter(owner=request.user, order_id=order_id).exists():
                raise
            # A 409 is "retryable" for django-idempotency: the claim is
            # released and nothing is stored for this key.
            raise OrderAlreadyPaid(order_id) from None
        location = reverse("payment-detail", kwargs={"pk": payment.pk})
        return Response(
            serializer.data, status=status.HTTP_201_CREATED, headers={"Location": location}
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
            # A definitive 4xx: stored as FAILED and replayed to retries.
            raise ValidationError(
                {
                    "amount": [
                        f"Refunds would total {refunded + amount}, more than the "
                        f"payment's {payment.amount} ({payment.amount - refunded} left)."
                    ]
                }
            )
        refund = serializer.save(payment=payment)
        payment.status = (
            Payment.Status.REFUNDED
            if refunded + amount == payment.amount
            else Payment.Status.PARTIALLY_REFUNDED
        )
        payment.save(update_fields=["status"])
        return Response(RefundSerializer(refund).data, status=status.HTTP_201_CREATED)
