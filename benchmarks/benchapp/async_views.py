"""DRF class-based views with ``IdempotentMixin``, sync and async (adrf): benchmarks/async_drf.py.

The same business write as views.py (one Payment row), the same body and
answer: ``sync_*`` are DRF's ``APIView``, served by gunicorn (WSGI);
``async_*`` are adrf's, with ``async def post`` and the ORM's async API,
served by uvicorn (ASGI). The ``*_mixin`` views are protected by
``IdempotentMixin``, the others not.
"""

from __future__ import annotations

from typing import Any

from adrf.views import APIView as AsyncAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from benchmarks.benchapp.models import Payment
from benchmarks.benchapp.views import _payment
from django_idempotency.drf import IdempotentMixin


def _created(payment: Payment) -> Response:
    body, location = _payment(payment.pk, payment.amount, payment.currency)
    return Response(body, status=201, headers={"Location": location})


def _fields(data: Any) -> dict[str, Any]:
    return {"amount": int(data["amount"]), "currency": str(data["currency"])}


class SyncUnprotected(APIView):
    def post(self, request: Request) -> Response:
        return _created(Payment.objects.create(**_fields(request.data)))


class SyncMixin(IdempotentMixin, SyncUnprotected):
    pass


class AsyncUnprotected(AsyncAPIView):
    async def post(self, request: Request) -> Response:
        return _created(await Payment.objects.acreate(**_fields(request.data)))


class AsyncMixin(IdempotentMixin, AsyncUnprotected):
    pass
