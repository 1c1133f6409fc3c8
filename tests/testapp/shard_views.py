"""Protected views of a sharded project (IDEMPOTENCY["DATABASE"] = None, TenantShardRouter).

The tenant is the ``X-Tenant`` header. The body steers the view: ``fail``
(write, then raise: a 500), ``external`` (call ``begin_external()`` before
writing), ``note`` (the Charge's note: the live servers' hooks read
``[sleep=<s>]`` and ``[crash]`` in it, tests/live/hooks.py).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from tests.testapp.models import Charge
from tests.utils import data_of, idempotency_of

__all__ = [
    "ShardViewFailure",
    "charge_in_the_shard",
    "charge_where_the_router_says",
    "tenant_header",
]


class ShardViewFailure(RuntimeError):
    """What a view steered with ``fail`` raises, after writing."""


def tenant_header(request: HttpRequest) -> str:
    return request.headers.get("X-Tenant", "anonymous")


def _charge(request: Request, using: str | None) -> Response:
    data: dict[str, Any] = data_of(request)
    context = idempotency_of(request)
    if data.get("external"):
        context.begin_external()
    charge = Charge.objects.using(using).create(
        tenant=context.tenant, amount=int(data.get("amount", 0)), note=str(data.get("note", ""))
    )
    if data.get("fail"):
        raise ShardViewFailure("the view failed after writing")
    return Response({"charge": charge.pk, "database": context.database}, status=201)


@api_view(["POST"])
@idempotent(operation="charge")
def charge_in_the_shard(request: Request) -> Response:
    """Writes its row where the record lives: ``request.idempotency.database``."""
    return _charge(request, idempotency_of(request).database)


@api_view(["POST"])
@idempotent(operation="misrouted charge")
def charge_where_the_router_says(request: Request) -> Response:
    """Leaves its write to the routers, which never see the tenant: ``default``."""
    return _charge(request, None)
