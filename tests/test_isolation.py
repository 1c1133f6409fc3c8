"""External calls and the transaction isolation level of the view.

``begin_external()`` commits the intent on a second connection while the
view's transaction is open; the completion then updates that same row. At
REPEATABLE READ or SERIALIZABLE, PostgreSQL refuses that update ("could not
serialize access") after the provider was called. So the call is refused
before it is made, read from the server (a settings check cannot see
``ALTER DATABASE ... SET default_transaction_isolation``). And once an
external call has begun, an answer never says "not run".
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import connection
from rest_framework.test import APIClient

from django_idempotency.exceptions import IsolationNotSupported
from django_idempotency.models import IdempotencyRecord
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/api-view/external"
State = IdempotencyRecord.State


@pytest.fixture(params=["REPEATABLE READ", "SERIALIZABLE"])
def session_isolation(request: pytest.FixtureRequest) -> Iterator[str]:
    """The level a project set outside Django's settings (as ALTER DATABASE would)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL {request.param}"
        )
    yield str(request.param)
    connection.close()


@pytest.mark.postgres
def test_begin_external_is_refused_above_read_committed_before_the_call(
    api: APIClient, session_isolation: str
) -> None:
    with pytest.raises(IsolationNotSupported, match=session_isolation):
        post(api, URL, {"amount": 1}, "k")

    assert not IdempotencyRecord.objects.exists()  # released: no call was made
    assert not Charge.objects.exists()


@pytest.mark.postgres
def test_at_read_committed_the_view_reads_then_calls_out_and_completes(api: APIClient) -> None:
    first = post(api, URL, {"amount": 1}, "k")
    assert first.status_code == 201
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


def test_a_store_lost_after_begin_external_says_uncertain_not_not_run(api: APIClient) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the view ends its session through pg_terminate_backend")
    body = {"amount": 1, "lose_store": True}
    response = post(api, URL, body, "k")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_outcome_uncertain"
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN
    retry = post(api, URL, body, "k")
    # Until a reconciler settles it, the outcome stays unknown.
    assert retry.status_code == 503
    assert retry.json()["code"] == "idempotency_outcome_uncertain"


@pytest.fixture
def mariadb_snapshot_isolation() -> Iterator[None]:
    if connection.vendor != "mysql":
        pytest.skip("MariaDB's innodb_snapshot_isolation")
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cursor.execute("SET SESSION innodb_snapshot_isolation = ON")
    yield
    connection.close()


def test_mariadb_snapshot_isolation_refuses_begin_external_before_the_call(
    api: APIClient, mariadb_snapshot_isolation: None
) -> None:
    with pytest.raises(IsolationNotSupported, match="REPEATABLE READ"):
        post(api, URL, {"amount": 1, "read_first": True}, "k")

    assert not IdempotencyRecord.objects.exists()  # released: no call was made


def test_a_completion_that_fails_after_begin_external_says_uncertain_not_not_run(
    api: APIClient, mariadb_snapshot_isolation: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Were the level not refused (an older check, a level set mid-view), the
    completion's "record has changed" error leaves the record UNCERTAIN."""
    # Where the request path looks the level up (context imports the name).
    monkeypatch.setattr("django_idempotency.context.snapshot_isolated", lambda alias: None)
    response = post(api, URL, {"amount": 1, "read_first": True}, "k")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_outcome_uncertain"
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN
