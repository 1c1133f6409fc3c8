"""The takeover's bound on the other databases, and under ATOMIC_REQUESTS.

- (MariaDB, fixed) a retry whose takeover meets a row locked by a cut-off
  holder waits the server's ``innodb_lock_wait_timeout`` (50 s by default),
  not IN_FLIGHT_WAIT: conditional.py bounds the wait on PostgreSQL only.
  MariaDB can bound one statement (``SET STATEMENT innodb_lock_wait_timeout=N
  FOR UPDATE ...``, whole seconds); otherwise docs/settings.md's
  IN_FLIGHT_WAIT row and the fleet notes should say that on MariaDB the
  server's setting is the bound.
- passes (PostgreSQL): under ``ATOMIC_REQUESTS`` a view that ``@idempotent``
  exempts (a class-based view) takes over in autocommit: the bound holds.
- (PostgreSQL, fixed) under ``ATOMIC_REQUESTS`` an ``@api_view`` stacked on
  ``@idempotent`` without ``@transaction.non_atomic_requests`` (the W002
  warning) takes over inside the request's transaction: no bound at all.
  The same root cause as test_bounded_waits.py's task in a
  caller's transaction.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.sessions import row_locked_by_an_open_transaction
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
URL = "/api-view/charges"
#: Bound on the wait for a request that must end: only a hang gets near it.
HANG = 120.0
#: How long a retry must wait to count as unbounded: 40 times IN_FLIGHT_WAIT.
STUCK = 20.0


def _abandoned_claim(api: APIClient, url: str = URL) -> IdempotencyRecord:
    post(api, url, {"amount": 1}, "k")
    Charge.objects.all().delete()
    IdempotencyRecord.objects.update(
        state=State.CLAIMED,
        lease_owner="cut-off-worker:1:1",
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )
    return IdempotencyRecord.objects.get()


def _retry_behind_a_locked_row(
    api: APIClient, record: IdempotencyRecord, url: str = URL
) -> tuple[bool, Any]:
    """(still waiting after STUCK seconds, the answer once the lock is gone)."""
    answers: list[Any] = []

    def retry() -> None:
        try:
            answers.append(post(api, url, {"amount": 1}, "k"))
        finally:
            connections.close_all()

    with row_locked_by_an_open_transaction(record.pk):
        thread = threading.Thread(target=retry, daemon=True)
        thread.start()
        thread.join(STUCK)
        stuck = thread.is_alive()
    thread.join(HANG)
    assert not thread.is_alive()
    return stuck, answers[0]


@pytest.fixture
def short_wait(settings: Any) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "IN_FLIGHT_WAIT": 0.5}


def test_on_mariadb_a_retry_waits_at_most_in_flight_wait_on_a_locked_row(
    api: APIClient, short_wait: None
) -> None:
    if not getattr(connection, "mysql_is_mariadb", False):
        pytest.skip("runs in the MariaDB pass")
    record = _abandoned_claim(api)

    stuck, answer = _retry_behind_a_locked_row(api, record)

    assert not stuck, (
        f"the retry still waited on the locked row after {STUCK} s (IN_FLIGHT_WAIT is 0.5 s): "
        "the server's innodb_lock_wait_timeout is the only bound on MariaDB"
    )
    assert answer.status_code == 409


@pytest.mark.postgres
def test_under_atomic_requests_an_exempt_view_still_waits_at_most_in_flight_wait(
    api: APIClient, short_wait: None, atomic_requests: None
) -> None:
    """A class-based view: ``@idempotent`` exempts it, the takeover runs in autocommit."""
    record = _abandoned_claim(api, "/cbv/charges")

    stuck, answer = _retry_behind_a_locked_row(api, record, "/cbv/charges")

    assert not stuck
    assert answer.status_code == 409
    assert answer.json()["code"] == "idempotency_request_in_progress"
    record.refresh_from_db()
    assert record.fencing_token == 1


@pytest.mark.postgres
def test_under_atomic_requests_an_api_view_waits_at_most_in_flight_wait(
    api: APIClient, short_wait: None, atomic_requests: None
) -> None:
    """Was failing, now fixed:

    ``@api_view`` over ``@idempotent`` (W002) runs the takeover in the request's
    transaction, where conditional.py leaves the bound out: the retry hangs behind the
    cut-off holder for as long as the server keeps that holder's session.

    W002's message speaks of begin_external() only; the bound is lost too.
    """
    record = _abandoned_claim(api)

    stuck, answer = _retry_behind_a_locked_row(api, record)

    assert not stuck, f"the retry still waited on the locked row after {STUCK} s"
    assert answer.status_code == 409
