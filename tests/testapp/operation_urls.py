"""A URLconf with a route of every kind, for the operation-name tests.

``DefaultRouter`` (regexes, a format suffix, an ``@action``), ``path()``
with converters, ``re_path()`` with named and unnamed groups and with
syntax that is more than text and arguments, unnamed routes, and nested
namespaced includes. Every view answers at once; the viewset's
``partial_update`` makes an external call and fails after it when asked
(``{"external": true}``), leaving an UNCERTAIN record for a reconciler.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import URLPattern, URLResolver, include, path, re_path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import status, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter
from rest_framework.serializers import BaseSerializer
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Charge
from tests.testapp.views import ChargeSerializer, ViewFailure


class OrderViewSet(IdempotentMixin, viewsets.ModelViewSet[Charge]):
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    def perform_create(self, serializer: BaseSerializer[Charge]) -> None:
        serializer.save(tenant="anonymous")

    def partial_update(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        if dict(request.data).get("external"):
            request.idempotency.begin_external()  # type: ignore[attr-defined]
            raise ViewFailure("the provider connection dropped")
        return super().partial_update(request, *args, **kwargs)

    @action(detail=True, methods=["post"])
    def pay(self, request: Request, pk: str | None = None) -> Response:
        return Response({"paid": pk}, status=status.HTTP_201_CREATED)


class AnswerView(IdempotentMixin, APIView):
    """Answers every unsafe method at once."""

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response({"method": request.method}, status=status.HTTP_201_CREATED)

    patch = put = delete = post


@api_view(["POST"])
@idempotent
def api_view_answer(request: Request, *args: Any, **kwargs: Any) -> Response:
    return Response({"args": list(args)}, status=status.HTTP_201_CREATED)


@csrf_exempt
@idempotent
def plain_answer(request: HttpRequest, **kwargs: Any) -> JsonResponse:
    return JsonResponse({"plain": True}, status=201)


router = DefaultRouter()
router.register("orders", OrderViewSet, basename="orders")

nested_router = DefaultRouter()
nested_router.register("orders", OrderViewSet, basename="orders")

tenant_urls: list[URLPattern | URLResolver] = [
    path("v2/", include((nested_router.urls, "orders"), namespace="v2")),
    path("plain/<int:pk>", plain_answer, name="plain"),
]

urlpatterns = [
    path("api/", include(router.urls)),
    path("tenant/<slug:tenant>/", include((tenant_urls, "tenant"), namespace="tenant")),
    path("shops/<int:shop>/answers", AnswerView.as_view(), name="shop-answers"),
    path("unnamed/<uuid:ref>/answers", AnswerView.as_view()),
    re_path(r"^legacy/answers/(?P<pk>[0-9]+)/$", AnswerView.as_view(), name="legacy-answer"),
    re_path(r"^legacy/v1\.0/([0-9]+)/(\d+)/$", api_view_answer),
    re_path(r"^odd/(?:first|second)/$", AnswerView.as_view(), name="odd"),
]
