"""A URLconf with an optimistic view that calls out: check E036 must name it."""

from __future__ import annotations

from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
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


urlpatterns = [
    path("calls-out", charges_the_provider),
    path("records-an-id", RecordsTheProvidersId.as_view()),
    path("stays-in", stays_in_the_database),
]
