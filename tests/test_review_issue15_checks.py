"""Review of issue 15: check E036 on optimistic handlers whose own code calls out.

This module is its own URLconf: every view here calls ``begin_external()``
(or its async form) in its own code, so E036 must name each one, and none
of the views that stay in the database.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.checks import check_optimistic_views
from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Charge


@csrf_exempt
@idempotent(optimistic=True)
def plain_django_view(request: HttpRequest) -> JsonResponse:
    key = request.idempotency.begin_external()  # type: ignore[attr-defined]
    return JsonResponse({"key": key}, status=201)


@idempotent(optimistic=True)
async def async_view(request: HttpRequest) -> JsonResponse:
    key = await request.idempotency.abegin_external()  # type: ignore[attr-defined]
    return JsonResponse({"key": key}, status=201)


class MixinView(IdempotentMixin, APIView):
    idempotency_optimistic = True

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.idempotency.begin_external()  # type: ignore[attr-defined]
        return Response({"key": key}, status=201)


class MixinViewSet(IdempotentMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    idempotency_optimistic = True
    queryset = Charge.objects.all()

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.idempotency.begin_external()  # type: ignore[attr-defined]
        return Response({"key": key}, status=201)


class QuietView(IdempotentMixin, APIView):
    idempotency_optimistic = True

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(status=201)


router = SimpleRouter()
router.register("viewset", MixinViewSet, basename="review15-viewset")

urlpatterns = [
    path("plain", plain_django_view),
    path("async", async_view),
    path("mixin", MixinView.as_view()),
    path("quiet", QuietView.as_view()),
    *router.urls,
]


def _named() -> set[str]:
    return {message.msg.split(" at ")[0] for message in check_optimistic_views()}


@pytest.mark.urls(__name__)
@pytest.mark.parametrize(
    "view",
    [
        f"The view {__name__}.plain_django_view",
        f"The view {__name__}.async_view",
        f"The view {__name__}.MixinView (post)",
        f"The view {__name__}.MixinViewSet (create)",
    ],
)
def test_e036_names_every_optimistic_handler_that_calls_out(view: str) -> None:
    named = _named()
    assert any(name.startswith(view) for name in named), named
    assert not any("QuietView" in name for name in named), named
