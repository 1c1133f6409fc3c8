"""A payment in two external calls: authorize the card, then capture.

``POST /v1/payments/two-step`` (``Idempotency-Key`` required) takes the
same body as ``POST /v1/payments`` and answers the same 201. Each call is a
step of the operation (``begin_external(step=...)``): its intent commits
before the call, under a provider key of its own, and its provider id as
soon as it is known. A request that dies between or inside the steps is
settled by ``payments.reconcilers.settle_two_step_payment``, which may hand
the operation back to the client's retry from the capture
(``RetryFrom("capture")``): the retry then finds the authorization already
known and does not authorize again.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from rest_framework import status
from rest_framework.decorators import api_view, permission_classes
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from django_idempotency.context import IdempotencyContext
from payments import crash_hooks, provider_client
from payments.models import Payment
from payments.rendering import payment_data, payment_location
from payments.serializers import PaymentSerializer
from payments.views import OrderAlreadyPaid, ProviderUnavailable, payer

OPERATION = "POST v1/payments/two-step"
AUTHORIZE, CAPTURE = "authorize", "capture"


def _authorization_id(
    request: Request, context: IdempotencyContext, data: dict[str, Any], metadata: dict[str, Any]
) -> str:
    """The authorization's id: an earlier attempt's, or a new authorization's."""
    known = context.step(AUTHORIZE)
    if known is not None and known.provider_operation_id:
        # Authorized by an earlier attempt (kept by the reconciler's
        # RetryFrom): never sent again, since the provider may have
        # forgotten its idempotency key by now and would authorize twice.
        return known.provider_operation_id
    key = context.begin_external(step=AUTHORIZE)
    crash_hooks.checkpoint(request, "after-authorize-begin")
    authorization = provider_client.authorize(
        key, data["amount"], data["currency"], metadata=metadata
    )
    crash_hooks.checkpoint(request, "after-authorize")
    context.set_provider_operation(authorization.id, step=AUTHORIZE)
    crash_hooks.checkpoint(request, "after-authorize-recorded")
    return authorization.id


@api_view(["POST"])
@permission_classes([IsAuthenticated])
@idempotent
def two_step_payment(request: Request) -> Response:
    serializer = PaymentSerializer(data=request.data)
    serializer.is_valid(raise_exception=True)
    data = serializer.validated_data
    order_id = data["order_id"]
    owner = payer(request)
    get_user_model().objects.select_for_update().get(pk=owner.pk)
    if Payment.objects.filter(owner=owner, order_id=order_id).exists():
        raise OrderAlreadyPaid(order_id)
    context: IdempotencyContext = request.idempotency  # type: ignore[attr-defined]
    # What the reconciler needs to rebuild the Payment from the provider.
    metadata = {
        "owner_id": owner.pk,
        "order_id": order_id,
        "amount": data["amount"],
        "currency": data["currency"],
    }
    try:
        authorization_id = _authorization_id(request, context, data, metadata)
        key = context.begin_external(step=CAPTURE)
        crash_hooks.checkpoint(request, "after-capture-begin")
        capture = provider_client.capture(
            key, authorization_id, data["amount"], data["currency"], metadata=metadata
        )
    except provider_client.PaymentDeclined as exc:
        return Response(
            {"detail": str(exc), "code": exc.code}, status=status.HTTP_402_PAYMENT_REQUIRED
        )
    except provider_client.ProviderRejected as exc:
        return Response(
            {"detail": f"The payment provider refused the payment ({exc}).", "code": exc.code},
            status=status.HTTP_422_UNPROCESSABLE_ENTITY,
        )
    except provider_client.ProviderError as exc:
        raise ProviderUnavailable() from exc  # UNCERTAIN, for the reconciler
    crash_hooks.checkpoint(request, "after-capture")
    context.set_provider_operation(capture.id, step=CAPTURE)
    crash_hooks.checkpoint(request, "after-capture-recorded")
    try:
        with transaction.atomic():
            payment = serializer.save(owner=owner, provider_charge_id=capture.id)
    except IntegrityError:
        if not Payment.objects.filter(owner=owner, order_id=order_id).exists():
            raise
        raise OrderAlreadyPaid(order_id) from None
    return Response(
        payment_data(payment),
        status=status.HTTP_201_CREATED,
        headers={"Location": payment_location(payment)},
    )
