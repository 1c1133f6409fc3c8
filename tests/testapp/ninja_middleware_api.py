"""A Django Ninja API whose operations protect nothing themselves: ``IdempotencyMiddleware`` does.

Served by ``tests.testapp.ninja_middleware_urls`` (tests/test_ninja_middleware.py).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.http import HttpRequest
from ninja import NinjaAPI

from django_idempotency import idempotent_exempt
from django_idempotency.ninja import idempotent
from tests.testapp import ninja_api
from tests.testapp.models import Charge
from tests.testapp.ninja_api import ApiKey, ChargeIn, ChargeOut

api = NinjaAPI(urls_namespace="ninja_middleware", auth=ApiKey())


@api.post("/orders", response={201: ChargeOut})
def create_order(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return ninja_api._charge(request, charge, tenant="order")


@api.put("/orders/{int:pk}", response={201: ChargeOut})
def replace_order(request: HttpRequest, pk: int, charge: ChargeIn) -> dict[str, Any]:
    return ninja_api._charge(request, charge, tenant=f"order {pk}")


@api.get("/orders", response=int)
def count_orders(request: HttpRequest) -> int:
    return Charge.objects.filter(tenant="order").count()


@api.post("/async-orders", response={201: ChargeOut})
async def create_order_async(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    row = await Charge.objects.acreate(tenant="async order", amount=charge.amount)
    return {"id": row.pk, "amount": row.amount, "tenant": ninja_api._tenant(request)}


@api.post("/own", response={201: ChargeOut})
@idempotent(required=False, operation="ninja order with its own options")
def create_own(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return ninja_api._charge(request, charge, tenant="own")


@api.post("/exempt", response={201: ChargeOut})
@idempotent_exempt
def create_exempt(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return ninja_api._charge(request, charge, tenant="exempt")


@api.post("/open", response={201: ChargeOut}, auth=None)
def create_open(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    """No authentication: an anonymous client's."""
    return ninja_api._charge(request, charge, tenant="open")


@api.post("/probe", response={201: ninja_api.Seen})
def probe(request: HttpRequest) -> dict[str, Any]:
    """What another connection sees of this request's record while it runs."""
    key = request.headers["Idempotency-Key"]
    return {
        "record_states": ninja_api._seen_from_another_connection(key),
        "in_atomic_block": transaction.get_connection().in_atomic_block,
    }
