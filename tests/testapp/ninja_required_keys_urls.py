"""A Ninja API of its own for its schema under ``MIDDLEWARE_KEYS = "required"``.

Served to tests/test_ninja_middleware.py. The middleware writes an
operation's schema when it first protects it, from the settings then: an
API no other test serves is first protected under the settings its test
sets.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.urls import path
from ninja import NinjaAPI

from tests.testapp import ninja_api
from tests.testapp.ninja_api import ApiKey, ChargeIn, ChargeOut

api = NinjaAPI(urls_namespace="ninja_required_keys", auth=ApiKey())


@api.post("/keyed", response={201: ChargeOut})
def create_keyed(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    return ninja_api._charge(request, charge, tenant="keyed")


@api.post("/open", response={201: ChargeOut}, auth=None)
def create_open(request: HttpRequest, charge: ChargeIn) -> dict[str, Any]:
    """No authentication: an anonymous client's."""
    return ninja_api._charge(request, charge, tenant="open")


urlpatterns = [path("ninja-required/", api.urls)]
