"""An API as a new user writes it, for ``manage.py spectacular`` (test_openapi.py).

Views and URLconf in one module, so that every warning drf-spectacular
emits about them must name this file. ``charges`` and ``ChargeAPIView``
have no serializer on purpose: spectacular complains about them, and the
complaint must point here, where the user can act on it.
"""

from __future__ import annotations

from typing import Any

from django.urls import include, path
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, viewsets
from rest_framework.decorators import action, api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import DefaultRouter
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Charge

#: The docstrings below, as the schema must show them.
DOCUMENTED_VIEWSET = "Charges, as the API's author describes them."
REFUND_ACTION = "Refund a charge once, however often the client retries."
API_VIEW = "Count the charges, or make one."
APIVIEW_POST = "Make a charge."
EXTENDED_API_VIEW = "Make a charge, as @extend_schema describes it."


class ChargeSerializer(serializers.ModelSerializer[Charge]):
    class Meta:
        model = Charge
        fields = ["id", "tenant", "amount", "note", "refunded"]
        read_only_fields = ["id", "tenant", "refunded"]


class DocumentedChargeViewSet(IdempotentMixin, viewsets.ModelViewSet[Charge]):
    """Charges, as the API's author describes them."""

    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    @action(detail=True, methods=["post"])
    def refund(self, request: Request, pk: str | None = None) -> Response:
        """Refund a charge once, however often the client retries."""
        return Response(status=201)


class UndocumentedChargeViewSet(IdempotentMixin, viewsets.ModelViewSet[Charge]):
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()


@api_view(["GET", "POST"])
@idempotent
def charges(request: Request) -> Response:
    """Count the charges, or make one."""
    return Response({})


class ChargeAPIView(APIView):
    def get(self, request: Request) -> Response:
        return Response({})

    @idempotent
    def post(self, request: Request) -> Response:
        """Make a charge."""
        return Response({}, status=201)

    @idempotent
    def delete(self, request: Request, *args: Any) -> Response:
        return Response(status=204)


class NoteViewSet(IdempotentMixin, viewsets.ViewSet):
    # No docstring, and a handler with @extend_schema: drf-spectacular then
    # builds the operation's schema class from the decorator's.
    @extend_schema(request=None, responses={201: None})
    def create(self, request: Request) -> Response:
        return Response(status=201)


@extend_schema(request=None, responses={201: None}, description=EXTENDED_API_VIEW)
@api_view(["POST"])
@idempotent
def extended_charges(request: Request) -> Response:
    return Response({}, status=201)


class ExtendedChargeAPIView(APIView):
    @extend_schema(request=None, responses={201: None})
    @idempotent
    def post(self, request: Request) -> Response:
        """Make a charge, described by extend_schema's caller."""
        return Response({}, status=201)


router = DefaultRouter()
router.register("documented", DocumentedChargeViewSet, basename="documented")
router.register("undocumented", UndocumentedChargeViewSet, basename="undocumented")
router.register("notes", NoteViewSet, basename="notes")

urlpatterns = [
    path("api-view/charges", charges),
    path("apiview/charges", ChargeAPIView.as_view()),
    path("extended/api-view/charges", extended_charges),
    path("extended/apiview/charges", ExtendedChargeAPIView.as_view()),
    path("", include(router.urls)),
]
