"""Django Ninja APIs protected by ``django_idempotency.ninja`` (tests/test_ninja.py).

Served by ``tests.testapp.ninja_urls``, a URLconf of their own: the suite's
other URLs stay as they are.
"""

from __future__ import annotations

import threading
from typing import Any

import ninja
from django.db import connection, transaction
from django.http import HttpRequest
from ninja import NinjaAPI, Router, Schema
from ninja.errors import HttpError
from ninja.security import APIKeyHeader, HttpBearer
from ninja.throttling import BaseThrottle
from rest_framework.authtoken.models import Token

from django_idempotency.models import IdempotencyRecord
from django_idempotency.ninja import idempotent
from tests.testapp.models import Charge

#: The API keys ``ApiKey`` accepts; its authentication returns the key itself.
API_KEYS = ("ninja-key-alpha-0123456789", "ninja-key-beta-0123456789")
#: Ninja 1.6 made a router mountable more than once (one copy of it per mount).
MOUNTS_TWICE = tuple(int(part) for part in ninja.__version__.split(".")[:2]) >= (1, 6)


class ApiKey(APIKeyHeader):
    param_name = "X-API-Key"

    def authenticate(self, request: HttpRequest, key: str | None) -> str | None:
        return key if key in API_KEYS else None


class TokenUser(HttpBearer):
    """``Authorization: Bearer <DRF token key>``: the token's user is the result."""

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        found = Token.objects.select_related("user").filter(key=token).first()
        return None if found is None else found.user


class RefusedWhenAsked(BaseThrottle):
    """Throttles a request that asks for it (``X-Throttle: refuse``): no shared counter."""

    def allow_request(self, request: HttpRequest) -> bool:
        return request.headers.get("X-Throttle") != "refuse"

    def wait(self) -> float:
        return 7


class ChargeIn(Schema):
    amount: int
    note: str = ""
    #: Answer with this status instead (an HttpError), after writing the charge.
    fail: int = 0


class ChargeOut(Schema):
    id: int
    amount: int
    tenant: str


def _charge(request: HttpRequest, charge: ChargeIn, tenant: str = "ninja") -> dict[str, Any]:
    row = Charge.objects.create(tenant=tenant, amount=charge.amount, note=charge.note)
    if charge.fail:
        raise HttpError(charge.fail, f"failed with {charge.fail} after writing")
    return {"id": row.pk, "amount": row.amount, "tenant": _tenant(request)}


def _tenant(request: HttpRequest) -> str:
    """The tenant the protection resolved ("" for a request it ran unprotected)."""
    context = getattr(request, "idempotency", None)
    return "" if context is None else str(context.tenant)


api = NinjaAPI(urls_namespace="ninja_tests", auth=ApiKey())
# Every unsafe operation of the API, keys optional; its routers' and its
# operations' own options win.
api.add_decorator(idempotent(required=False), mode="view")


@api.post("/charges", response={201: ChargeOut}, throttle=RefusedWhenAsked())
@idempotent
def create_charge(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return _charge(request, charge)


@api.post("/charges/{int:account}", response={201: ChargeOut})
@idempotent(ttl=3600, operation="ninja charge of an account")
def charge_account(request: HttpRequest, account: int, charge: ChargeIn) -> dict[str, Any]:
    return _charge(request, charge, tenant=f"account {account}")


@api.post("/user-charges", response={201: ChargeOut}, auth=TokenUser())
@idempotent
def charge_as_user(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return _charge(request, charge)


@api.post("/async-charges", response={201: ChargeOut})
@idempotent
async def create_charge_async(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    row = await Charge.objects.acreate(tenant="ninja", amount=charge.amount, note=charge.note)
    if charge.fail:
        raise HttpError(charge.fail, f"failed with {charge.fail} after writing")
    return {"id": row.pk, "amount": row.amount, "tenant": _tenant(request)}


@api.put("/api-level", response={201: ChargeOut})
def api_level_charge(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    """Protected by the API's add_decorator alone."""
    return _charge(request, charge, tenant="api level")


#: Set by a request to ``/held`` once it runs; it then waits for ``release``.
entered = threading.Event()
release = threading.Event()


@api.post("/held", response={201: ChargeOut})
@idempotent
def held_charge(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    entered.set()
    release.wait(timeout=20)
    return _charge(request, charge)


# A router mounted twice: each mount has copies of its operations.
orders = Router()


@orders.post("/orders", response={201: ChargeOut})
@idempotent
def create_order(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return _charge(request, charge, tenant="order")


api.add_router("/first", orders)
if MOUNTS_TWICE:
    api.add_router("/second", orders, url_name_prefix="second")


# A router protected as a whole, Ninja's way.
routed = Router()
routed.add_decorator(idempotent(required=True), mode="view")


@routed.post("/notes", response={201: ChargeOut})
def create_note(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return _charge(request, charge, tenant="note")


@routed.post("/own-options", response={201: ChargeOut})
@idempotent(required=False, operation="ninja note with its own options")
def create_note_with_own_options(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return _charge(request, charge, tenant="note")


@routed.get("/notes", response=list[int])
def list_notes(request: HttpRequest) -> list[int]:
    return list(Charge.objects.filter(tenant="note").values_list("pk", flat=True))


# A router nested in it, with an add_decorator of its own: the nearer one wins.
nested = Router()
nested.add_decorator(idempotent(required=False, operation="ninja nested note"), mode="view")


@nested.post("/notes", response={201: ChargeOut})
def create_nested_note(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return _charge(request, charge, tenant="nested note")


routed.add_router("/nested", nested)
api.add_router("/routed", routed)


# An API whose URLs ``non_atomic_requests`` exempts from ATOMIC_REQUESTS.
transactions_api = NinjaAPI(urls_namespace="ninja_transactions", auth=ApiKey())


class Seen(Schema):
    #: What another connection sees of this request's record while the operation runs.
    record_states: list[str]
    in_atomic_block: bool


def _seen_from_another_connection(key: str) -> list[str]:
    states: list[str] = []

    def look() -> None:
        try:
            found = IdempotencyRecord.objects.filter(key=key).values_list("state", flat=True)
            states.extend(found)
        finally:
            connection.close()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join(timeout=20)
    return states


@transactions_api.post("/probe", response={201: Seen})
@idempotent
def transaction_probe(request: HttpRequest) -> dict[str, Any]:
    Charge.objects.create(tenant="probe", amount=1)
    key = request.headers["Idempotency-Key"]
    return {
        "record_states": _seen_from_another_connection(key),
        "in_atomic_block": transaction.get_connection().in_atomic_block,
    }


@transactions_api.get("/probe", response=Seen)
def transaction_probe_unprotected(request: HttpRequest) -> dict[str, Any]:
    return {"record_states": [], "in_atomic_block": transaction.get_connection().in_atomic_block}
