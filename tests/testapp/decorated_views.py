"""Views whose gate or protection a decorator carries: what the middleware must not lose.

Routed by ``decorated_view_urls`` (tests/test_middleware_decorated_views.py):
a DRF view whose route wraps ``as_view()`` in Django's
``permission_required``, an ``@api_view`` function under it, an
``@api_view`` function under ``@idempotent`` (placed above), handlers
protected through Django's ``method_decorator``, and views whose
``http_method_names`` refuse a method they have a handler for.
"""

from __future__ import annotations

import json

from django.contrib.auth.decorators import permission_required
from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.cache import never_cache
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from tests.testapp.models import Charge
from tests.testapp.views import charge_response, perform
from tests.utils import data_of

#: The permission the gated routes ask of Django's user.
ADD_CHARGE = "testapp.add_charge"


@permission_required(ADD_CHARGE, raise_exception=True)
@api_view(["POST"])
def gated_api_view(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


@idempotent(operation="api view under its own idempotent")
@api_view(["POST"])
def api_view_under_idempotent(request: Request) -> Response:
    charge, code = perform(request, request.data)
    return charge_response(charge, code)


class MethodDecoratedPlainView(View):
    """A plain Django view whose handler is protected through ``method_decorator``."""

    @method_decorator(idempotent)
    def post(self, request: HttpRequest) -> JsonResponse:
        charge, code = perform(request, json.loads(request.body or b"{}"))
        return JsonResponse({"id": charge.pk, "amount": charge.amount}, status=code)


@method_decorator(idempotent, name="post")
class MethodDecoratedAPIView(APIView):
    """A DRF view whose handler is protected through ``method_decorator``."""

    def post(self, request: Request) -> Response:
        charge, code = perform(request, request.data)
        return charge_response(charge, code)


@method_decorator(idempotent(operation="method-decorated with options"), name="post")
class MethodDecoratedWithOptionsAPIView(APIView):
    def post(self, request: Request) -> Response:
        charge, code = perform(request, request.data)
        return charge_response(charge, code)


class GetOnlyPlainView(View):
    """Has a ``post``, but ``http_method_names`` refuses POST: Django answers 405."""

    http_method_names = ["get", "head", "options"]

    def get(self, request: HttpRequest) -> JsonResponse:
        return JsonResponse({"count": Charge.objects.count()})

    def post(self, request: HttpRequest) -> JsonResponse:
        charge, code = perform(request, {})
        return JsonResponse({"id": charge.pk}, status=code)


class GetOnlyAPIView(APIView):
    """The same for DRF: ``http_method_names`` refuses POST."""

    http_method_names = ["get", "head", "options"]

    def get(self, request: Request) -> Response:
        return Response({"count": Charge.objects.count()})

    def post(self, request: Request) -> Response:
        charge, code = perform(request, request.data)
        return charge_response(charge, code)


@method_decorator(never_cache, name="dispatch")
class DispatchDecoratedAPIView(APIView):
    """A decorator of the class's own (on ``dispatch``): kept when the middleware runs it."""

    def post(self, request: Request) -> Response:
        charge, code = perform(request, request.data)
        return charge_response(charge, code)


class DurableBlockAPIView(APIView):
    """Written for no protection: its writes commit on their own, ``atomic(durable=True)``."""

    def post(self, request: Request) -> Response:
        with transaction.atomic(durable=True):
            charge = Charge.objects.create(tenant="durable", amount=int(data_of(request)["amount"]))
        return charge_response(charge, 201)
