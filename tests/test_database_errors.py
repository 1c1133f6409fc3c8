"""A database error is an outage only when the claim or the lookup cannot reach the store.

Once the view has started, its own database errors (a deadlock, a
serialization failure, a statement timeout) are the view's: the claim is
released and the error answers 500, so the retry runs once more. FAIL_OPEN
never runs the view a second time. A claim that waits on a busy key and
times out is contention, answered 409, never an outage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection
from rest_framework.test import APIClient

from tests.sessions import key_held_by_an_open_transaction
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)
VIEW_ERRORS = ["deadlock", "serialization", "statement_timeout"]


def _needs_a_server() -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite raises none of these errors; the PostgreSQL and MariaDB passes do")


@pytest.fixture
def fail_open(settings: Any) -> None:
    settings.IDEMPOTENCY = {"FAIL_OPEN": True}


@pytest.mark.parametrize("url", ["/api-view/charges"], ids=["two-commit"])
@pytest.mark.parametrize("kind", VIEW_ERRORS)
def test_a_views_database_error_is_not_an_outage_even_with_fail_open(
    api: APIClient, fail_open: None, kind: str, url: str, new_key: Callable[[], str]
) -> None:
    _needs_a_server()
    api.raise_request_exception = False
    key = new_key()
    body = {"amount": 1, "db_error": kind, "db_error_once": True}

    first = post(api, url, body, key)
    retry = post(api, url, body, key)
    replay = post(api, url, body, key)

    assert first.status_code == 500  # not 503, and not run again unprotected
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert replay["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def _bound_lock_waits() -> None:
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET lock_timeout = '200ms'")
        else:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")


@pytest.fixture
def lock_waits_restored() -> Iterator[None]:
    yield
    connection.close()  # the session settings go with the session


def test_a_claim_that_times_out_on_a_busy_key_is_409_not_an_outage(
    api: APIClient, fail_open: None, lock_waits_restored: None
) -> None:
    _needs_a_server()
    _bound_lock_waits()
    with key_held_by_an_open_transaction("POST api-view/charges"):
        response = post(api, "/api-view/charges", {"amount": 1}, "k")

    assert response.status_code == 409  # FAIL_OPEN would have run it alongside the holder
    assert response.json()["code"] == "idempotency_request_in_progress"
    assert not Charge.objects.exists()
