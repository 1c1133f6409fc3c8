"""Query budgets: deterministic, so asserted (time is measured by benchmarks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)

TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE SAVEPOINT")
URL = "/api-view/optional"  # the key is optional here, so the bare view can be measured


def statements(action: Callable[[], Any]) -> tuple[list[str], list[str]]:
    """(data statements, transaction control statements) run by ``action``."""
    with CaptureQueriesContext(connection) as captured:
        action()
    sql = [query["sql"] for query in captured.captured_queries]
    control = [s for s in sql if s.upper().startswith(TRANSACTION_CONTROL)]
    return [s for s in sql if s not in control], control


def test_first_execution_adds_at_most_two_statements(api: APIClient) -> None:
    bare, _ = statements(lambda: post(api, URL, {"amount": 1}, None))
    protected, control = statements(lambda: post(api, URL, {"amount": 1}, "k"))

    assert len(protected) - len(bare) <= 2, protected
    # The claim and the completion; no savepoints, one transaction at most.
    assert not [s for s in control if "SAVEPOINT" in s.upper()]
    assert sum(s.upper().startswith("COMMIT") for s in control) <= 2


@pytest.mark.parametrize(
    ("arrange", "body", "status"),
    [
        (None, {"amount": 1}, 201),  # replay
        (None, {"amount": 2}, 422),  # mismatch
        ("CLAIMED", {"amount": 1}, 409),  # in flight
    ],
    ids=["replay", "mismatch", "in-flight"],
)
def test_answers_without_running_the_view_cost_at_most_two_statements(
    api: APIClient, arrange: str | None, body: dict[str, int], status: int
) -> None:
    post(api, URL, {"amount": 1}, "k")
    if arrange:
        IdempotencyRecord.objects.update(state=arrange)

    holder: list[Any] = []
    data, control = statements(lambda: holder.append(post(api, URL, body, "k")))

    assert holder[0].status_code == status
    assert len(data) <= 2, data
    # In autocommit, on every database: no BEGIN, COMMIT or ROLLBACK around
    # the claim (SQLite and MariaDB once spent two round trips on them).
    assert control == [], control


@pytest.mark.postgres
@pytest.mark.parametrize("arrange", [None, "CLAIMED"], ids=["replay", "in-flight"])
def test_on_postgresql_an_answer_is_the_floors_two_round_trips(
    api: APIClient, arrange: str | None
) -> None:
    """The claim (a no-op INSERT) and the lookup, in autocommit: the hand-written floor's replay."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's statements")
    post(api, URL, {"amount": 1}, "k")
    if arrange:
        IdempotencyRecord.objects.update(state=arrange)
    with CaptureQueriesContext(connection) as captured:
        post(api, URL, {"amount": 1}, "k")
    sql = [query["sql"] for query in captured.captured_queries]
    assert len(sql) == 2, sql
    assert sql[0].startswith('INSERT INTO "django_idempotency_record"'), sql
    assert sql[1].startswith("SELECT") and "django_idempotency_record" in sql[1], sql


def test_a_first_execution_is_five_round_trips(api: APIClient) -> None:
    """The claim in autocommit, then BEGIN, the view's INSERT, the completion, COMMIT."""
    with CaptureQueriesContext(connection) as captured:
        assert post(api, URL, {"amount": 1}, "k").status_code == 201
    sql = [query["sql"] for query in captured.captured_queries]
    assert len(sql) == 5, sql
    assert sql[0].startswith(
        f"INSERT INTO {connection.ops.quote_name('django_idempotency_record')}"
    )
    assert sql[1].startswith("BEGIN") and sql[4] == "COMMIT", sql  # SQLite: BEGIN IMMEDIATE


@pytest.mark.postgres
def test_first_execution_claims_with_one_atomic_statement_on_postgresql(api: APIClient) -> None:
    data, _ = statements(lambda: post(api, URL, {"amount": 1}, "k"))
    claim = data[0]
    assert claim.startswith('INSERT INTO "django_idempotency_record"')
    assert 'ON CONFLICT ("tenant", "operation", "key") DO NOTHING RETURNING "id"' in claim
    assert not any(s.startswith("SELECT") and "django_idempotency_record" in s for s in data)
