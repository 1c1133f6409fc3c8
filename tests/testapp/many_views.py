"""Many DRF views and viewsets without protection of their own, as a large API has (generated).

Twenty ``APIView`` classes and ten ``ModelViewSet`` classes, each routed on
a URL of its own: the middleware alone must protect every one of them.
"""

from __future__ import annotations

from django.urls import URLPattern, URLResolver, path
from rest_framework import serializers, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView

from tests.testapp.models import Charge
from tests.testapp.views import ChargeSerializer, _tenant
from tests.utils import data_of

VIEWS = 20
VIEWSETS = 10


def _post(self: APIView, request: Request) -> Response:
    charge = Charge.objects.create(
        tenant=_tenant(request),
        amount=int(data_of(request).get("amount", 0)),
        note=type(self).__name__,
    )
    return Response({"id": charge.pk, "view": type(self).__name__}, status=201)


def _perform_create(
    self: viewsets.ModelViewSet[Charge], serializer: serializers.BaseSerializer[Charge]
) -> None:
    serializer.save(tenant=_tenant(self.request), note=type(self).__name__)


view_classes: list[type[APIView]] = [
    type(f"GeneratedView{number}", (APIView,), {"post": _post, "__module__": __name__})
    for number in range(VIEWS)
]
viewset_classes: list[type[viewsets.ModelViewSet[Charge]]] = [
    type(
        f"GeneratedViewSet{number}",
        (viewsets.ModelViewSet,),
        {
            "serializer_class": ChargeSerializer,
            "queryset": Charge.objects.all(),
            "perform_create": _perform_create,
            "__module__": __name__,
        },
    )
    for number in range(VIEWSETS)
]

router = SimpleRouter()
for number, viewset in enumerate(viewset_classes):
    router.register(f"sets/{number}", viewset, basename=f"generated-set-{number}")

urlpatterns: list[URLPattern | URLResolver] = [
    *(path(f"views/{number}", view.as_view()) for number, view in enumerate(view_classes)),
    *router.urls,
]
