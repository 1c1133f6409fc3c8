"""DRF throttles run before the claim: a throttled request writes no record.

The record growth a client can cause is bounded by the rate its throttle
allows (docs/security.md, "Throttling and record growth"); that holds only
if the throttle answers before anything is claimed. DRF checks throttles in
``APIView.initial()``, before it calls the handler that ``@idempotent``
protects and before ``IdempotentMixin`` swaps in the protected handler.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import cache
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.urls import path
from rest_framework import viewsets
from rest_framework.decorators import api_view, throttle_classes
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.throttling import ScopedRateThrottle, UserRateThrottle
from rest_framework.views import APIView

from django_idempotency import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.models import IdempotencyRecord
from tests.factories import TokenFactory
from tests.utils import data_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls("tests.test_throttling")]


class TwoAMinute(UserRateThrottle):
    # A rate of its own: DRF reads DEFAULT_THROTTLE_RATES once, at import.
    rate = "2/min"


@api_view(["POST"])
@throttle_classes([TwoAMinute])
@idempotent
def throttled_function(request: Request) -> Response:
    return Response({"amount": data_of(request).get("amount")}, status=201)


class ThrottledMethod(APIView):
    throttle_classes = [TwoAMinute]

    @idempotent
    def post(self, request: Request) -> Response:
        return Response({"amount": data_of(request).get("amount")}, status=201)


class PaymentsScope(ScopedRateThrottle):
    THROTTLE_RATES = {"payments": "2/min"}


class ThrottledViewSet(viewsets.GenericViewSet):  # type: ignore[type-arg]
    """The tutorial's shape: a scoped throttle on a viewset whose create is protected."""

    throttle_classes = [PaymentsScope]
    throttle_scope = "payments"

    @idempotent
    def create(self, request: Request) -> Response:
        return Response({"amount": data_of(request).get("amount")}, status=201)


class ThrottledMixin(IdempotentMixin, APIView):
    throttle_classes = [TwoAMinute]

    def post(self, request: Request) -> Response:
        return Response({"amount": data_of(request).get("amount")}, status=201)


urlpatterns = [
    path("function", throttled_function),
    path("method", ThrottledMethod.as_view()),
    path("mixin", ThrottledMixin.as_view()),
    path("viewset", ThrottledViewSet.as_view({"post": "create"})),
]


@pytest.fixture(autouse=True)
def _fresh_rates() -> Iterator[None]:
    cache.clear()  # the throttles' request history
    yield
    cache.clear()


def _client() -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {TokenFactory.create().key}")
    return client


def _post(client: APIClient, url: str, key: str) -> Any:
    return client.post(url, {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY=key)


@pytest.mark.parametrize("url", ["/function", "/method", "/mixin", "/viewset"])
def test_a_throttled_request_answers_429_and_never_touches_the_records(url: str) -> None:
    client = _client()
    assert [_post(client, url, f"k{n}").status_code for n in range(2)] == [201, 201]

    with CaptureQueriesContext(connections["default"]) as queries:
        throttled = _post(client, url, "k-fresh")

    assert throttled.status_code == 429
    assert throttled["Retry-After"]
    # Not even a claim that was then released: no statement on the table.
    assert not [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]
    assert sorted(IdempotencyRecord.objects.values_list("key", flat=True)) == ["k0", "k1"]


def test_a_throttle_counts_per_user_so_another_tenant_is_not_throttled() -> None:
    busy, other = _client(), _client()
    for n in range(3):
        _post(busy, "/function", f"k{n}")

    assert _post(other, "/function", "k0").status_code == 201
    assert IdempotencyRecord.objects.count() == 3
