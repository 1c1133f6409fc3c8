"""The record store cannot be reached: 503, or FAIL_OPEN runs the view unprotected.

The store is a real PostgreSQL alias pointed at a port where nothing
listens, so every connection attempt is refused, as in an outage.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from rest_framework.test import APIClient

from tests.conftest import post
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # released again: nothing listens


@pytest.fixture
def unreachable_store(settings: Any) -> Iterator[None]:
    """Point IDEMPOTENCY["DATABASE"] at a PostgreSQL alias nobody listens for.

    The alias is registered on this thread only, not in DATABASES: Django's
    test case would otherwise refuse it, or try to create a test database
    on a server that cannot be reached.
    """
    from django.db.backends.postgresql.base import DatabaseWrapper

    alias = "unreachable"
    settings_dict = {
        **connections["default"].settings_dict,
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "idempotency",
        "USER": "postgres",
        "PASSWORD": "",
        "HOST": "127.0.0.1",
        "PORT": str(_closed_port()),
        "OPTIONS": {"connect_timeout": 2},
        "ATOMIC_REQUESTS": False,
    }
    connections[alias] = DatabaseWrapper(settings_dict, alias)
    settings.IDEMPOTENCY = {"DATABASE": alias}
    try:
        yield
    finally:
        connections[alias].close()
        del connections[alias]


def test_store_outage_refuses_with_503_and_retry_after(
    api: APIClient, unreachable_store: None, caplog: pytest.LogCaptureFixture
) -> None:
    response = post(api, "/api-view/charges", {"amount": 1}, "k")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert int(response["Retry-After"]) > 0
    assert Charge.objects.count() == 0
    assert "refusing" in caplog.text


def test_store_outage_with_fail_open_runs_the_view_and_logs(
    api: APIClient, unreachable_store: None, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "FAIL_OPEN": True}

    response = post(api, "/api-view/charges", {"amount": 1}, "k")

    assert response.status_code == 201
    assert "Idempotent-Replayed" not in response
    assert Charge.objects.count() == 1
    assert "FAIL_OPEN runs" in caplog.text
