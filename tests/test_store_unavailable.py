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

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import post

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


def test_store_unavailable_is_announced_with_the_outcome_once_the_view_ran(
    api: APIClient, unreachable_store: None, settings: Any
) -> None:
    """Sent once, when the request is answered: ``fail_open`` says the view ran, and it has."""
    settings.IDEMPOTENCY = {**settings.IDEMPOTENCY, "FAIL_OPEN": True}
    seen: list[tuple[bool, int]] = []

    def receiver(sender: Any, fail_open: bool, **kwargs: Any) -> None:
        seen.append((fail_open, Charge.objects.count()))

    signals.store_unavailable.connect(receiver, weak=False)
    try:
        response = post(api, "/api-view/charges", {"amount": 1}, "k")
    finally:
        signals.store_unavailable.disconnect(receiver)

    assert response.status_code == 201
    assert seen == [(True, 1)]


@pytest.mark.postgres
def test_a_session_lost_mid_view_is_a_503_and_the_retry_runs(api: APIClient) -> None:
    """The session ends after the view wrote: its writes and completion are lost.

    The release reconnects (the server is up) and frees the key at once.
    """
    response = post(api, "/api-view/charges", {"amount": 1, "lose_store": True}, "k")

    assert response.status_code == 503
    assert int(response["Retry-After"]) == 120  # the lease
    assert not Charge.objects.exists()  # the view's write died with its session
    assert not IdempotencyRecord.objects.exists()  # released
    assert post(api, "/api-view/charges", {"amount": 1}, "k").status_code == 201


@pytest.fixture
def reopen_database() -> Iterator[None]:
    """Allow connections to the test database again, whatever the test did."""
    yield
    import psycopg

    where = connections["default"].settings_dict
    with psycopg.connect(
        host=where["HOST"],
        port=where["PORT"] or 5432,
        user=where["USER"],
        password=where["PASSWORD"],
        dbname="postgres",
        autocommit=True,
    ) as admin:
        admin.execute(f'ALTER DATABASE "{where["NAME"]}" ALLOW_CONNECTIONS true')


@pytest.mark.postgres
def test_a_store_gone_mid_view_is_a_503_and_one_untraced_log_line(
    api: APIClient, caplog: pytest.LogCaptureFixture, reopen_database: None
) -> None:
    """The server ends the session and refuses new ones: nothing can be released.

    An outage is not a bug: the log says what happened without a traceback
    (the live outage test counts tracebacks as unexplained errors). The
    record waits, CLAIMED, for its lease to end.
    """
    response = post(api, "/api-view/charges", {"amount": 1, "lose_store": "refuse"}, "k")

    assert response.status_code == 503
    assert int(response["Retry-After"]) == 120
    lost = [r for r in caplog.records if "Could not release the claim" in r.getMessage()]
    assert len(lost) == 1
    # What went wrong, and what happens next, in one line.
    assert "OperationalError" in lost[0].getMessage()
    assert "not currently accepting connections" in lost[0].getMessage()
    assert "stays CLAIMED until its lease ends" in lost[0].getMessage()
    assert lost[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info and r.name == "django_idempotency"]
