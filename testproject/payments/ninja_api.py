"""The refunds of the payments API again, as a Django Ninja API (``/ninja/v1/``).

The same users and tokens as the DRF API (``Authorization: Token <key>``),
so a user is the same tenant through both; ``@idempotent`` from
``django_idempotency.ninja`` protects the operation. Its OpenAPI schema,
with the key header and the refusals, is at ``/ninja/v1/openapi.json``
(Swagger UI at ``/ninja/v1/docs``).
"""

from __future__ import annotations

from typing import Any

from django.db.models import Sum
from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Field, NinjaAPI, Schema
from ninja.errors import HttpError
from ninja.security import APIKeyHeader
from rest_framework.authtoken.models import Token

from django_idempotency.ninja import idempotent
from payments.models import Payment, Refund


class DrfToken(APIKeyHeader):
    """``Authorization: Token <key>``, the DRF API's tokens: the result is the token's user."""

    param_name = "Authorization"

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        scheme, _, token = (key or "").partition(" ")
        if scheme != "Token" or not token:
            return None
        found = Token.objects.select_related("user").filter(key=token).first()
        return None if found is None else found.user


api = NinjaAPI(title="Refunds (Django Ninja)", urls_namespace="ninja-refunds", auth=DrfToken())


class RefundIn(Schema):
    amount: int = Field(gt=0, description="In minor units, e.g. cents.")


class RefundOut(Schema):
    id: int
    payment_id: int
    amount: int


@api.post("/payments/{int:payment_id}/refunds", response={201: RefundOut})
@idempotent
def refund(request: HttpRequest, payment_id: int, refund: RefundIn) -> Refund:
    """Refund part of one of your payments; a retry with the same key refunds nothing more."""
    payment = get_object_or_404(Payment, pk=payment_id, owner=request.auth)  # type: ignore[attr-defined]
    # Lock the payment: concurrent refunds (different keys) cannot together exceed it.
    payment = Payment.objects.select_for_update().get(pk=payment.pk)
    refunded = payment.refunds.aggregate(total=Sum("amount"))["total"] or 0
    if refunded + refund.amount > payment.amount:
        # A definitive 4xx: stored as FAILED and replayed to retries.
        raise HttpError(
            400,
            f"Refunds would total {refunded + refund.amount}, more than the payment's "
            f"{payment.amount} ({payment.amount - refunded} left).",
        )
    created = Refund.objects.create(payment=payment, amount=refund.amount)
    fully = refunded + refund.amount == payment.amount
    payment.status = Payment.Status.REFUNDED if fully else Payment.Status.PARTIALLY_REFUNDED
    payment.save(update_fields=["status"])
    return created
