"""The payment API's answers as bytes, shared by the view and the reconciler.

A reconciler stores the answer a retry will get; rendering it exactly as the
view's JSON answer keeps a recovered payment indistinguishable from one the
view created itself.
"""

from __future__ import annotations

from typing import Any

from django.urls import reverse
from rest_framework.renderers import JSONRenderer

from payments.models import Payment
from payments.serializers import PaymentSerializer


def payment_location(payment: Payment) -> str:
    return reverse("payment-detail", kwargs={"pk": payment.pk})


def payment_data(payment: Payment) -> dict[str, Any]:
    return dict(PaymentSerializer(payment).data)


def payment_answer(payment: Payment) -> tuple[bytes, str]:
    """The 201 body (JSON bytes, as DRF renders them) and the Location."""
    return JSONRenderer().render(payment_data(payment)), payment_location(payment)


def order_already_paid_detail(order_id: str) -> dict[str, str]:
    return {"detail": f"Order {order_id!r} has already been paid.", "code": "order_already_paid"}


def order_already_paid_body(order_id: str) -> bytes:
    return JSONRenderer().render(order_already_paid_detail(order_id))
