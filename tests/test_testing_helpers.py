"""django_idempotency.testing: the helpers users get for their own suites."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rest_framework.test import APIClient

from django_idempotency import recovery
from django_idempotency.models import IdempotencyRecord
from django_idempotency.testing import (
    SimulatedCrash,
    assert_protected,
    expire_leases,
    fire_duplicates,
    simulate_crash_after_begin_external,
)
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.guarantees]
State = IdempotencyRecord.State


def test_assert_protected_passes_for_a_protected_view() -> None:
    assert_protected(APIClient(), "/api-view/charges", {"amount": 5})


def test_assert_protected_fails_for_an_unprotected_view() -> None:
    with pytest.raises(AssertionError, match="no key: expected 400"):
        assert_protected(APIClient(), "/api-view/unprotected", {"amount": 5})


def test_fire_duplicates_runs_the_view_once(live_server: Any) -> None:
    result = fire_duplicates(
        f"{live_server.url}/api-view/charges", count=8, body={"amount": 3, "sleep": 0.2}
    )

    assert len(result.statuses) == 8
    assert result.executed == 1
    assert Charge.objects.count() == 1
    assert all(status in (201, 409) for status in result.statuses)


@pytest.fixture
def reconciler() -> Iterator[list[str]]:
    seen: list[str] = []

    @recovery.register_reconciler("POST api-view/external")
    def settle(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        seen.append(record.provider_key)
        return recovery.Completed(status=201, body={"reconciled": True})

    yield seen
    del recovery._reconcilers["POST api-view/external"]


@pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view claims inside the request transaction (W002)",
)
@pytest.mark.not_under(
    "repeatable-read",
    reason="begin_external() is refused above READ COMMITTED on PostgreSQL (IsolationNotSupported)",
    databases=("postgres",),
)
@pytest.mark.postgres
def test_a_simulated_crash_leaves_the_intent_for_the_reconciler(
    api: APIClient, reconciler: list[str]
) -> None:
    with simulate_crash_after_begin_external(), pytest.raises(SimulatedCrash):
        post(api, "/api-view/external", {"amount": 1}, "k")

    record = IdempotencyRecord.objects.get()
    assert record.state == State.IN_PROGRESS
    assert Charge.objects.count() == 0  # the view's writes died with it
    assert post(api, "/api-view/external", {"amount": 1}, "k").status_code == 409

    assert expire_leases() == 1
    report = recovery.recover_stale_records()

    assert report.completed == 1 and reconciler == [record.provider_key]
    replay = post(api, "/api-view/external", {"amount": 1}, "k")
    assert (replay.status_code, replay.json()) == (201, {"reconciled": True})


def test_a_simulated_crash_needs_a_database_with_a_second_writer() -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.db import connection

    if connection.vendor == "sqlite":
        with pytest.raises(ImproperlyConfigured, match="PostgreSQL or MySQL"):
            simulate_crash_after_begin_external().__enter__()
    else:
        with simulate_crash_after_begin_external():
            pass
