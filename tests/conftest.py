from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.factories import TokenFactory


@pytest.fixture
def client_for() -> Callable[..., APIClient]:
    """An API client authenticated with a fresh token (a tenant of its own)."""

    def make(**credentials: Any) -> APIClient:
        token = TokenFactory()
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}", **credentials)
        client.user = token.user  # type: ignore[attr-defined]
        return client

    return make


@pytest.fixture
def api(db: None) -> APIClient:
    return APIClient()


@pytest.fixture
def new_key() -> Callable[[], str]:
    counter = itertools.count()
    run = uuid.uuid4().hex[:8]
    return lambda: f"key-{run}-{next(counter)}"


def post(client: APIClient, url: str, data: Any, key: str | None, **extra: Any) -> Any:
    headers = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
    return client.post(url, data, format="json", **headers, **extra)


@pytest.fixture
def atomic_requests() -> Iterator[None]:
    """Turn on ATOMIC_REQUESTS for the default database for one test."""
    settings_dict = connections["default"].settings_dict
    settings_dict["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        settings_dict["ATOMIC_REQUESTS"] = False


def record_states() -> list[str]:
    return list(IdempotencyRecord.objects.order_by("pk").values_list("state", flat=True))
