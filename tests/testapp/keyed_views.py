"""Views keyed by something else than the Idempotency-Key header, or with their own outcome policy.

Each writes a Charge (one row per run of the view) steered by the body as
``views.perform`` is: ``status`` answers with it, ``invalid`` raises DRF's
ValidationError, and so on.
"""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.outcomes import Verdict, by_status
from tests.testapp.models import Charge
from tests.testapp.views import ChargeSerializer, charge_response, perform


@api_view(["POST"])
@idempotent(key="header:X-Delivery", operation="delivery-header")
def delivery_header(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


@api_view(["POST"])
@idempotent(key="body:data.object.id", operation="body-field")
def body_field(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


@api_view(["POST"])
@idempotent(key="body:id", operation="body-field-standard-policy", outcome=by_status({}))
def body_field_standard_policy(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


@api_view(["POST"])
@idempotent(key="digest:body", operation="body-digest")
def body_digest(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


def _reference(request: Any) -> object:
    return request.headers.get("X-Reference")


@csrf_exempt
@idempotent(key=_reference, operation="callable")
def plain_callable_key(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body) if request.content_type == "application/json" else request.POST
    charge, code = perform(request, data)
    return JsonResponse({"id": charge.pk}, status=code)


@csrf_exempt
@idempotent(key="body:id", operation="plain-body")
def plain_body_field(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body) if request.content_type == "application/json" else request.POST
    charge, code = perform(request, data)
    return JsonResponse({"id": charge.pk}, status=code)


def _signed(request: HttpRequest) -> HttpResponse | None:
    if request.headers.get("X-Signature") != "good":
        return HttpResponse("forged", status=401)
    return None


def _sender(request: Any) -> str:
    return "sender:" + str(request.headers.get("X-Sender", "unknown"))


@csrf_exempt
@idempotent(key="header:X-Delivery", verify=_signed, tenant=_sender, operation="verified")
def verified_delivery(request: HttpRequest) -> JsonResponse:
    charge, code = perform(request, json.loads(request.body))
    return JsonResponse({"id": charge.pk}, status=code)


class MixinBodyKeyView(IdempotentMixin, generics.CreateAPIView[Charge]):
    serializer_class = ChargeSerializer
    idempotency_key = "body:note"
    idempotency_operation = "mixin-body"

    def perform_create(self, serializer: Any) -> None:
        serializer.save(tenant="mixin")


@api_view(["POST"])
@idempotent(
    operation="policy",
    outcome=by_status(
        {504: Verdict.UNCERTAIN, 418: Verdict.RELEASE, range(300, 400): Verdict.FAILED}
    ),
)
def policy_view(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)
