"""adrf's async views and async plain Django views with no protection of their own.

What ``IdempotencyMiddleware`` protects under ASGI, or leaves alone
(tests/test_middleware_async.py): one of each kind adrf offers (a view, a
generic view, a viewset with a custom action, an ``@api_view`` function),
the ``idempotent_exempt`` forms, views that protect themselves (for
"protected once"), and async plain Django views for the path prefixes.
The DRF views' bodies steer the side effect as ``adrf_views.charge`` says
(``hold`` keeps a request in flight).
"""

from __future__ import annotations

import json
from typing import Any

from adrf import generics, viewsets
from adrf.decorators import api_view
from adrf.views import APIView
from django.http import HttpRequest, JsonResponse
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent, idempotent_exempt
from django_idempotency.drf import IdempotentMixin
from tests.testapp.adrf_views import ChargeSerializer, _tenant, charge
from tests.testapp.middleware_views import OncePerMinute
from tests.testapp.models import Charge


class PaymentView(APIView):
    """POST charges, PUT charges too, DELETE answers 204: ``async def`` handlers, no mixin."""

    async def get(self, request: Request) -> Response:
        return Response({"count": await Charge.objects.acount()})

    async def post(self, request: Request) -> Response:
        return await charge(request)

    async def put(self, request: Request) -> Response:
        return await charge(request)

    async def delete(self, request: Request) -> Response:
        await charge(request)
        return Response(status=status.HTTP_204_NO_CONTENT)


class PaymentCreateView(generics.CreateAPIView):
    serializer_class = ChargeSerializer

    async def perform_acreate(self, serializer: Any) -> None:
        await serializer.asave(tenant=_tenant(self.request))


class PaymentViewSet(viewsets.ModelViewSet):
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    async def perform_acreate(self, serializer: Any) -> None:
        await serializer.asave(tenant=_tenant(self.request))

    @action(detail=False, methods=["post"])  # type: ignore[type-var]  # stubs: sync handlers only
    async def refund(self, request: Request) -> Response:
        return await charge(request)

    @action(detail=False, methods=["post"])  # type: ignore[type-var]
    @idempotent_exempt
    async def note(self, request: Request) -> Response:
        return await charge(request)


@api_view(["POST"])
async def payment_api_view(request: Request) -> Response:
    return await charge(request)


class GuardedPaymentView(PaymentView):
    """Authenticated callers only, once a minute each: DRF's checks, before any claim."""

    permission_classes = [IsAuthenticated]
    throttle_classes = [OncePerMinute]


# -- idempotent_exempt ------------------------------------------------------------------


@idempotent_exempt
class ExemptView(PaymentView):
    pass


@idempotent_exempt
@api_view(["POST"])
async def exempt_above_api_view(request: Request) -> Response:
    return await charge(request)


@api_view(["POST"])
@idempotent_exempt
async def exempt_below_api_view(request: Request) -> Response:
    return await charge(request)


# -- views that protect themselves ------------------------------------------------------


class OwnMixinView(IdempotentMixin, PaymentView):
    idempotency_operation = "own-async-mixin-payment"


class OwnDecoratedMethodView(APIView):
    @idempotent(operation="own-async-method-payment")
    async def post(self, request: Request) -> Response:
        return await charge(request)


@api_view(["POST"])
@idempotent(operation="own-async-decorator-payment", ttl=60)
async def own_decorator_api_view(request: Request) -> Response:
    return await charge(request)


# -- async plain Django views -------------------------------------------------------------


@csrf_exempt
async def plain_charge(request: HttpRequest) -> JsonResponse:
    """An async view reads its user with ``auser()``: ``request.user`` would query on the loop."""
    user = await request.auser()
    data = json.loads(request.body or b"{}")
    created = await Charge.objects.acreate(
        tenant=f"user:{user.pk}" if user.is_authenticated else "anonymous",
        amount=int(data.get("amount", 0)),
    )
    return JsonResponse({"id": created.pk, "amount": created.amount}, status=201)


class PlainChargeView(View):
    async def post(self, request: HttpRequest) -> JsonResponse:
        return await plain_charge(request)


@csrf_exempt
@idempotent(operation="own-async-plain-charge")
async def own_plain_charge(request: HttpRequest) -> JsonResponse:
    return await plain_charge(request)
