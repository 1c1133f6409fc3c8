"""Review of issue 14: steps in an ``async def`` view (``abegin_external(step=...)``).

Two steps, the first's provider id recorded, then the view fails: the record
is UNCERTAIN with both steps, as for a sync view; a clean run completes with
both steps and their ids.
"""

from __future__ import annotations

import json

import pytest
from django.http import HttpRequest, JsonResponse
from django.test import Client, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord, IdempotencyStep

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.not_under(
        "repeatable-read", reason="IsolationNotSupported", databases=("postgres",)
    ),
]
State = IdempotencyRecord.State


@csrf_exempt
@idempotent(operation="async-steps")
async def async_two_steps(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body)
    context = request.idempotency  # type: ignore[attr-defined]
    known = await context.astep("authorize")
    if known is None or not known.provider_operation_id:
        await context.abegin_external(step="authorize")
        await context.aset_provider_operation("au_1", step="authorize")
    await context.abegin_external(step="capture")
    if data.get("fail"):
        raise RuntimeError("the capture's connection dropped")
    await context.aset_provider_operation("ca_1", step="capture")
    return JsonResponse({"steps": [s.name for s in context.steps]}, status=201)


urlpatterns = [path("async-steps", async_two_steps)]


def send(body: dict[str, object], key: str) -> object:
    client = Client(raise_request_exception=False)
    return client.post(
        "/async-steps", json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )


def steps() -> list[tuple[str, str]]:
    return list(
        IdempotencyStep.objects.order_by("begun_at", "pk").values_list(
            "name", "provider_operation_id"
        )
    )


@override_settings(ROOT_URLCONF=__name__)
def test_an_async_view_completes_with_its_steps() -> None:
    response = send({"amount": 1}, "a-1")

    assert response.status_code == 201, response.content  # type: ignore[attr-defined]
    assert IdempotencyRecord.objects.get().state == State.COMPLETED
    assert steps() == [("authorize", "au_1"), ("capture", "ca_1")]


@override_settings(ROOT_URLCONF=__name__)
def test_an_async_view_failing_between_steps_leaves_both_steps_uncertain() -> None:
    response = send({"amount": 1, "fail": True}, "a-2")

    assert response.status_code == 500  # type: ignore[attr-defined]
    record = IdempotencyRecord.objects.get()
    assert record.state == State.UNCERTAIN
    assert steps() == [("authorize", "au_1"), ("capture", "")]
