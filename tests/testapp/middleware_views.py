"""Views with no protection of their own: what ``IdempotencyMiddleware`` protects, or leaves alone.

One of each kind DRF offers (a view, a generic view, a viewset with a
custom action, an ``@api_view`` function), plain Django views for the path
prefixes, the ``idempotent_exempt`` forms, and views that protect
themselves (for "protected once"). Routed by ``middleware_urls``. The
bodies steer the side effect as in ``views.perform``.
"""

from __future__ import annotations

import json
import threading

from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics, serializers, status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import UserRateThrottle
from rest_framework.views import APIView

from django_idempotency import idempotent, idempotent_exempt
from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Charge
from tests.testapp.views import (
    ChargeSerializer,
    _tenant,
    charge_response,
    committed_claims,
    perform,
)
from tests.utils import data_of


class PaymentView(APIView):
    """POST charges, PUT changes a charge's amount, DELETE refunds it: no decorator, no mixin."""

    def get(self, request: Request) -> Response:
        return Response({"count": Charge.objects.count()})

    def post(self, request: Request) -> Response:
        charge, code = perform(request, request.data)
        return charge_response(charge, code)

    def put(self, request: Request) -> Response:
        charge, _ = perform(request, request.data)
        return charge_response(charge, status.HTTP_200_OK)

    def delete(self, request: Request) -> Response:
        perform(request, request.data)
        return Response(status=status.HTTP_204_NO_CONTENT)


class PaymentCreateView(generics.CreateAPIView[Charge]):
    serializer_class = ChargeSerializer

    def perform_create(self, serializer: serializers.BaseSerializer[Charge]) -> None:
        serializer.save(tenant=_tenant(self.request))


class PaymentViewSet(viewsets.ModelViewSet[Charge]):
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    def perform_create(self, serializer: serializers.BaseSerializer[Charge]) -> None:
        serializer.save(tenant=_tenant(self.request))

    @action(detail=True, methods=["post"])
    def refund(self, request: Request, pk: str | None = None) -> Response:
        charge = self.get_object()
        charge.refunded = True
        charge.save(update_fields=["refunded"])
        Charge.objects.create(tenant=_tenant(request), amount=-charge.amount, note="refund")
        return Response({"id": charge.pk, "refunded": True}, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["post"])
    @idempotent_exempt
    def note(self, request: Request, pk: str | None = None) -> Response:
        Charge.objects.create(tenant=_tenant(request), amount=0, note="note")
        return Response({"noted": True}, status=status.HTTP_201_CREATED)


class OncePerMinute(UserRateThrottle):
    rate = "1/min"


class GuardedPaymentView(PaymentView):
    """Authenticated callers only, once a minute each: DRF's checks, before any claim."""

    permission_classes = [IsAuthenticated]
    throttle_classes = [OncePerMinute]


@api_view(["POST"])
def payment_api_view(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


# -- idempotent_exempt ------------------------------------------------------------------


@idempotent_exempt
class ExemptView(PaymentView):
    pass


class ExemptSubclassView(ExemptView):
    """Inherits its base's exemption, as DRF's class attributes are inherited."""


@idempotent_exempt
@api_view(["POST"])
def exempt_above_api_view(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


@api_view(["POST"])
@idempotent_exempt
def exempt_below_api_view(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


# -- plain Django views -----------------------------------------------------------------


@csrf_exempt
def plain_charge(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body or b"{}")
    charge, code = perform(request, data)
    return JsonResponse({"id": charge.pk, "amount": charge.amount}, status=code)


@csrf_exempt
def versioned_plain_charge(request: HttpRequest, version: str) -> JsonResponse:
    return plain_charge(request)


@idempotent_exempt
@csrf_exempt
def exempt_plain_charge(request: HttpRequest) -> JsonResponse:
    return plain_charge(request)


class PlainChargeView(View):
    def post(self, request: HttpRequest) -> JsonResponse:
        return plain_charge(request)


# -- views that protect themselves ------------------------------------------------------


class OwnMixinView(IdempotentMixin, PaymentView):
    idempotency_operation = "own-mixin-payment"


@api_view(["POST"])
@idempotent(operation="own-decorator-payment", ttl=60)
def own_decorator_api_view(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


# -- transactions and a request held in flight ------------------------------------------


class ProbeView(APIView):
    """The transaction the handler runs in, and whether its claim committed before it."""

    def post(self, request: Request) -> Response:
        Charge.objects.create(tenant="probe", amount=int(data_of(request).get("amount", 0)))
        return Response(
            {"in_atomic_block": connection.in_atomic_block, "committed_claims": committed_claims()},
            status=int(data_of(request).get("status", 201)),
        )


@api_view(["POST"])
def probe_api_view(request: Request) -> Response:
    return ProbeView().post(request)


#: Set by a test while a request holds its claim in ``HeldView``.
held = threading.Event()
#: Set by the test to let the held request finish.
release = threading.Event()


class HeldView(APIView):
    """Holds its claim until the test releases it: a duplicate meanwhile is in flight."""

    def post(self, request: Request) -> Response:
        held.set()
        release.wait(30)
        charge, code = perform(request, request.data)
        return charge_response(charge, code)
