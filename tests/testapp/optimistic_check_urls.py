"""A URLconf with an optimistic view that calls out: check E036 must name it."""

from __future__ import annotations

from typing import Any

from django.urls import path
from rest_framework import serializers, viewsets
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Charge
from tests.utils import idempotency_of


@api_view(["POST"])
@idempotent(optimistic=True)
def charges_the_provider(request: Request) -> Response:
    key = idempotency_of(request).begin_external()
    return Response({"key": key}, status=201)


class RecordsTheProvidersId(APIView):
    @idempotent(optimistic=True)
    def post(self, request: Request) -> Response:
        idempotency_of(request).set_provider_operation("op_1")
        return Response(status=201)


@api_view(["POST"])
@idempotent(optimistic=True)
def stays_in_the_database(request: Request) -> Response:
    return Response(status=201)


class _ChargeSerializer(serializers.ModelSerializer[Charge]):
    class Meta:
        model = Charge
        fields = ("id", "amount")


class CallsOutOnlyFromItsUpdate(IdempotentMixin, viewsets.ModelViewSet[Charge]):
    """``create`` calls super() (its class sits in a closure cell); only perform_update calls out.

    E036 reads a handler's own source: ``create`` is clean, and the call in
    ``perform_update`` is not the handler's (the run-time refusal covers it).
    """

    idempotency_optimistic = True
    queryset = Charge.objects.all()
    serializer_class = _ChargeSerializer

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().create(request, *args, **kwargs)

    def perform_update(self, serializer: Any) -> None:
        idempotency_of(self.request).set_provider_operation("op_1")
        serializer.save()


router = DefaultRouter()
router.register("viewset", CallsOutOnlyFromItsUpdate, basename="calls-out-from-update")

urlpatterns = [
    path("calls-out", charges_the_provider),
    path("records-an-id", RecordsTheProvidersId.as_view()),
    path("stays-in", stays_in_the_database),
    *router.urls,
]
