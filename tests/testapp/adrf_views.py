"""Protected async views of every kind adrf offers (tests/test_adrf.py).

The body steers them as it does ``views.perform``: ``amount``, ``status``
(answer with it after writing), ``invalid`` (DRF's ValidationError),
``external`` (write, then ``await request.idempotency.abegin_external()``),
``sleep`` (seconds to hold the claim, for the live race), ``hold`` (the
name of a ``Hold`` to wait on after writing, while a test sends a
duplicate). Two headers, which are no part of the fingerprint, make the
view write, then fail, so that its retry is the same request: ``X-Raise``
(an error) and ``X-Crash`` (the worker "dies": ``SimulatedCrash``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from adrf import generics, serializers, viewsets
from adrf.decorators import api_view
from adrf.views import APIView
from rest_framework import status
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.testing import SimulatedCrash
from tests.testapp.models import Charge
from tests.utils import data_of, idempotency_of


@dataclass
class Hold:
    """A request held in its view, after its write, until the test releases it."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)


#: The holds the tests set up, by name (the body's ``hold``).
holds: dict[str, Hold] = {}


def _tenant(request: Any) -> str:
    user = getattr(request, "user", None)
    return f"user:{user.pk}" if user is not None and user.is_authenticated else "anonymous"


async def charge(request: Request) -> Response:
    """The side effect, steered by the body, through the ORM's async API."""
    data = data_of(request)
    if data.get("invalid"):
        raise ValidationError({"amount": ["This amount is not accepted."]})
    created = await Charge.objects.acreate(
        tenant=_tenant(request), amount=int(data.get("amount", 0)), note=str(data.get("note", ""))
    )
    body: dict[str, Any] = {"id": created.pk, "amount": created.amount}
    if data.get("external"):
        body["provider_key"] = await idempotency_of(request).abegin_external()
    if data.get("sleep"):
        await asyncio.sleep(float(data["sleep"]))
    if data.get("hold"):
        hold = holds[data["hold"]]
        hold.entered.set()
        await hold.released.wait()
    if request.headers.get("X-Crash"):
        raise SimulatedCrash("the worker died after writing")
    if request.headers.get("X-Raise"):
        raise RuntimeError("the async view failed after writing")
    code = int(data.get("status", status.HTTP_201_CREATED))
    return Response(body, status=code, headers={"Location": f"/charges/{created.pk}"})


class MixinAPIView(IdempotentMixin, APIView):
    async def post(self, request: Request) -> Response:
        return await charge(request)

    async def get(self, request: Request) -> Response:
        return Response({"count": await Charge.objects.acount()})


class DecoratedAPIView(APIView):
    @idempotent
    async def post(self, request: Request) -> Response:
        return await charge(request)


@api_view(["POST"])
@idempotent
async def function_view(request: Request) -> Response:
    return await charge(request)


class ChargeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Charge
        fields = ["id", "tenant", "amount", "note", "refunded"]
        read_only_fields = ["id", "tenant", "refunded"]


class MixinGenericView(IdempotentMixin, generics.ListCreateAPIView):
    """adrf's generic view: the async twin of ``views.MixinChargeView``."""

    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    async def perform_acreate(self, serializer: Any) -> None:
        await serializer.asave(tenant=_tenant(self.request))


class MixinModelViewSet(IdempotentMixin, viewsets.ModelViewSet):
    serializer_class = ChargeSerializer
    queryset = Charge.objects.all()

    async def perform_acreate(self, serializer: Any) -> None:
        await serializer.asave(tenant=_tenant(self.request))


class DecoratedViewSet(viewsets.ViewSet):
    # adrf's router routes POST to an async viewset's acreate.
    @idempotent
    async def acreate(self, request: Request) -> Response:
        return await charge(request)

    @action(detail=False, methods=["post"])  # type: ignore[type-var]  # stubs: sync handlers only
    @idempotent(operation="async-viewset-refund")
    async def refund(self, request: Request) -> Response:
        return await charge(request)


class AsyncIsAuthenticated:
    """An async permission, as adrf allows: awaited in DRF's checks, before any claim."""

    message = "Authentication credentials were not provided."

    async def has_permission(self, request: Request, view: Any) -> bool:
        return bool(request.user and request.user.is_authenticated)

    async def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        return True


class FirstChargeOnly(AsyncIsAuthenticated):
    """Refuses a caller who was charged already: its own retry too, once the first ran."""

    message = "You were charged already."

    async def has_permission(self, request: Request, view: Any) -> bool:
        if not await super().has_permission(request, view):
            return False
        return not await Charge.objects.filter(tenant=_tenant(request)).aexists()


class AuthenticatedMixinView(MixinAPIView):
    permission_classes = [AsyncIsAuthenticated]


class AuthenticatedDecoratedView(DecoratedAPIView):
    permission_classes = [AsyncIsAuthenticated]


class FirstChargeMixinView(MixinAPIView):
    permission_classes = [FirstChargeOnly]


class FirstChargeDecoratedView(DecoratedAPIView):
    permission_classes = [FirstChargeOnly]
