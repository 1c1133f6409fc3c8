"""Views under ``@idempotent(optimistic=True)``, steered by the body like views.py's.

Besides ``perform()``'s switches: ``order`` (also write an ``Order`` with
this number, a business unique key that concurrent duplicates collide on
in the view body), ``swallow_order_conflict`` (catch that collision's
IntegrityError without a savepoint and answer 409 "order exists", a common
habit), ``hold`` (seconds to sleep after writing, inside the transaction,
to widen a race) and ``begin_external`` (which this mode refuses).
"""

from __future__ import annotations

import time
from typing import Any

from django.db import IntegrityError
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Order
from tests.testapp.views import charge_response, perform
from tests.utils import data_of, idempotency_of


def _charge_and_order(request: Request) -> Response:
    data = data_of(request)
    charge, code = perform(request, data)
    if data.get("order"):
        try:
            Order.objects.create(number=str(data["order"]), amount=charge.amount)
        except IntegrityError:
            if not data.get("swallow_order_conflict"):
                raise
            # The habit: no savepoint, so the transaction is doomed.
            return Response({"detail": "order exists"}, status=409)
    if data.get("hold"):
        time.sleep(float(data["hold"]))
    if data.get("begin_external"):
        idempotency_of(request).begin_external()
    if data.get("provider_operation"):
        idempotency_of(request).set_provider_operation("op_1")
    return charge_response(charge, code)


@api_view(["POST"])
@idempotent(optimistic=True)
def api_view_optimistic(request: Request) -> Response:
    return _charge_and_order(request)


class OptimisticMixinView(IdempotentMixin, APIView):
    idempotency_optimistic = True

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return _charge_and_order(request)
