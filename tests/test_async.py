"""``async def`` Django views through Django's ASGI handler (AsyncClient)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import AsyncClient

from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/async/charges"
State = IdempotencyRecord.State


async def send(client: AsyncClient, body: dict[str, Any], key: str | None) -> Any:
    headers = {} if key is None else {"Idempotency-Key": key}
    return await client.post(
        URL, json.dumps(body), content_type="application/json", headers=headers
    )


# Database access from the test itself runs in asgiref's sync thread; its
# connection is closed each time, or PostgreSQL refuses to drop the test
# database at the end while that thread still holds a session.
@sync_to_async
def counts() -> tuple[int, list[str]]:
    try:
        states = list(IdempotencyRecord.objects.values_list("state", flat=True))
        return Charge.objects.count(), states
    finally:
        connections.close_all()


@sync_to_async
def mark_in_flight() -> None:
    try:
        IdempotencyRecord.objects.update(state=State.CLAIMED)
    finally:
        connections.close_all()


async def test_first_execution_replay_and_mismatch() -> None:
    client = AsyncClient()
    first = await send(client, {"amount": 5}, "k")
    retry = await send(client, {"amount": 5}, "k")
    mismatch = await send(client, {"amount": 6}, "k")
    missing = await send(client, {"amount": 5}, None)

    assert first.status_code == 201 and first["Idempotency-Key"] == "k"
    assert retry.content == first.content and retry["Idempotent-Replayed"] == "true"
    assert mismatch.status_code == 422 and json.loads(mismatch.content)["code"] == (
        "idempotency_key_reused"
    )
    assert missing.status_code == 400
    assert await counts() == (1, [State.COMPLETED])


async def test_in_flight_duplicate_gets_409() -> None:
    client = AsyncClient()
    await send(client, {"amount": 5}, "k")
    await mark_in_flight()

    response = await send(client, {"amount": 5}, "k")

    assert response.status_code == 409 and response["Retry-After"] == "1"


@pytest.mark.parametrize("status", [500, 503, 429])
async def test_retryable_outcome_releases_and_rolls_back_the_async_views_writes(
    status: int,
) -> None:
    response = await send(AsyncClient(), {"amount": 5, "status": status}, "k")

    assert response.status_code == status
    # The view's acreate() ran in the completion's transaction: rolled back.
    assert await counts() == (0, [])


async def test_raising_async_view_releases_the_claim() -> None:
    client = AsyncClient(raise_request_exception=False)
    response = await send(client, {"amount": 5, "raise": True}, "k")

    assert response.status_code == 500
    assert await counts() == (0, [])


async def test_stored_failure_commits_with_the_async_views_writes() -> None:
    client = AsyncClient()
    first = await send(client, {"amount": 5, "status": 404}, "k")
    retry = await send(client, {"amount": 5, "status": 404}, "k")

    assert retry.content == first.content and retry["Idempotent-Replayed"] == "true"
    assert await counts() == (1, [State.FAILED])
