"""Review of issue 17: request outcomes the metrics count wrongly.

Every protected request is counted once, under the outcome it was
answered with. These answers are 503s, yet nothing names them: they fall
through to ``rejected``, which the docs define as refused input (no key, a
key too long, a body too large), or stay ``executed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db import connection, connections
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.test import APIClient

from django_idempotency import idempotent
from tests.telemetry import Readings, installed
from tests.test_review_issue15_behaviour import _commit_kills_the_session
from tests.test_review_issue15_races import _send
from tests.testapp import review15_views
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)

OUTCOMES = (
    "executed",
    "replayed",
    "key_reused",
    "key_expired",
    "in_flight",
    "store_unavailable",
    "outcome_uncertain",
    "unprotected",
    "rejected",
    "error",
)


@pytest.fixture
def counted() -> Callable[..., float]:
    reader, _ = installed()
    before = Readings(reader)

    def rise(name: str, **attributes: Any) -> float:
        return Readings(reader).value(name, **attributes) - before.value(name, **attributes)

    return rise


def by_outcome(counted: Callable[..., float]) -> dict[str, float]:
    found = {outcome: counted("idempotency.requests", outcome=outcome) for outcome in OUTCOMES}
    return {outcome: amount for outcome, amount in found.items() if amount}


def test_a_replay_no_key_decrypts_is_counted_store_unavailable_not_rejected(
    api: APIClient, counted: Callable[..., float], settings: Any
) -> None:
    """The 503 ``idempotency_store_unavailable`` of an unreadable record.

    ``answers.answer_settled`` raises StoreUnavailable without sending
    ``store_unavailable``, so the request ends with no outcome and is
    counted ``rejected``: the 503 alert never sees it.
    """
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}
    post(api, "/api-view/charges", {"amount": 1}, "r17-sealed")
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}

    response = post(api, "/api-view/charges", {"amount": 1}, "r17-sealed")

    assert response.status_code == 503
    assert response.json()["code"] == "idempotency_store_unavailable"
    assert by_outcome(counted) == {"executed": 1, "store_unavailable": 1}


@pytest.mark.postgres
def test_an_optimistic_commit_lost_is_not_counted_as_refused_input(
    counted: Callable[..., float],
) -> None:
    """The view ran; whether its transaction committed is unknown (503 outcome_uncertain).

    The optimistic mode sends no signal before its record commits, so a
    connection lost at COMMIT leaves the request without an outcome and it
    is counted ``rejected``, as if its input had been refused.
    """
    with _commit_kills_the_session():
        lost = _send("/api-view/optimistic", {"amount": 1}, "k", {})
    assert lost.status_code == 503, lost.content

    counts = by_outcome(counted)
    assert counts == {"outcome_uncertain": 1}, counts


@csrf_exempt
@idempotent
def loses_its_connection(request: HttpRequest) -> JsonResponse:
    """The default mode's ``review15_views.loses_its_connection``."""
    Charge.objects.create(tenant="review17", amount=1)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    return JsonResponse({}, status=201)


urlpatterns = [
    path("default/loses-connection", loses_its_connection),
    path("optimistic/loses-connection", review15_views.loses_its_connection),
]


@pytest.mark.postgres
@pytest.mark.urls(__name__)
@pytest.mark.parametrize("mode", ["default", "optimistic"])
def test_a_store_lost_mid_view_is_counted_store_unavailable(
    mode: str, counted: Callable[..., float]
) -> None:
    """503 ``idempotency_store_unavailable``: the view's writes went with its session.

    No ``store_unavailable`` signal is sent for it: the default mode counts
    it ``executed`` (the claim's outcome stays), the optimistic mode
    ``rejected`` (no outcome at all). The ``IdempotencyStoreUnavailable``
    alert and the dashboard's 503 panel miss the outage either way.
    """
    body = {"amount": 1, "terminate": True}
    lost = _send(f"/{mode}/loses-connection", body, "k", {})
    connections.close_all()
    assert lost.status_code == 503, lost.content
    assert lost.json()["code"] == "idempotency_store_unavailable"

    assert by_outcome(counted) == {"store_unavailable": 1}


@pytest.mark.parametrize("url", ["/api-view/charges", "/api-view/optimistic"])
def test_a_view_whose_success_was_rolled_back_is_not_counted_as_refused_input(
    url: str, api: APIClient, counted: Callable[..., float]
) -> None:
    """The view ran, swallowed an IntegrityError without a savepoint, answered 201: a 500.

    The default mode counts it ``executed`` (its claim was sent); the
    optimistic mode raises ``rolled_back_success`` with no signal before it,
    so the view's run is counted ``rejected``, refused input.
    """
    api.raise_request_exception = False
    body = {"amount": 1, "swallow_integrity_error": True}

    assert post(api, url, body, "r17-doomed").status_code == 500

    assert by_outcome(counted) == {"executed": 1}


#: docs/observability.md's values of ``idempotency_releases_total``'s ``reason``.
DOCUMENTED_RELEASE_REASONS = {"exception", "status", "store_unavailable", "recovery", "reconciled"}


@pytest.mark.postgres
@pytest.mark.urls(__name__)
def test_a_release_after_the_store_was_lost_has_a_documented_reason() -> None:
    """owned_run releases with ``reason="store unavailable"`` after a lost connection.

    ``metrics.note`` turns every non-int reason into a label as it is, so
    the series ``reason="store unavailable"`` appears: a value the docs,
    the signal's docstring, the alert rules and the dashboard do not know.
    """
    reader, _ = installed()
    lost = _send("/default/loses-connection", {"amount": 1}, "k", {})
    connections.close_all()
    assert lost.status_code == 503

    reasons = {labels.get("reason") for labels in Readings(reader).labels("idempotency.releases")}
    assert reasons <= DOCUMENTED_RELEASE_REASONS, reasons
