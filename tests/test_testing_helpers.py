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
    simulate_crash_after_set_provider_operation,
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


#: Where a crash after begin_external() leaves a committed intent behind.
CRASHES_LEAVE_AN_INTENT = [
    pytest.mark.not_under(
        "atomic-requests",
        reason="a non-exempt @api_view claims inside the request transaction (W002)",
    ),
    pytest.mark.not_under(
        "repeatable-read",
        reason="begin_external() is refused above READ COMMITTED on PostgreSQL "
        "(IsolationNotSupported)",
        databases=("postgres",),
    ),
    pytest.mark.postgres,
]


def crashes_leave_an_intent(test: Any) -> Any:
    for mark in CRASHES_LEAVE_AN_INTENT:
        test = mark(test)
    return test


@crashes_leave_an_intent
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


TWO_STEPS = {
    "amount": 1,
    "steps": [
        {"name": "authorize", "provider_id": "auth_1"},
        {"name": "capture", "provider_id": "cap_1"},
    ],
}


def steps_of_the_record() -> dict[str, str]:
    """Each step the record kept, with the provider id it committed ("" when none)."""
    record = IdempotencyRecord.objects.get()
    assert record.state == State.IN_PROGRESS
    return dict(
        record.steps.order_by("begun_at", "pk").values_list("name", "provider_operation_id")
    )


@crashes_leave_an_intent
def test_a_simulated_crash_after_a_given_steps_begin_external_lets_the_steps_before_it_run(
    api: APIClient,
) -> None:
    with simulate_crash_after_begin_external(step="capture"), pytest.raises(SimulatedCrash):
        post(api, "/api-view/steps", TWO_STEPS, "k")

    assert steps_of_the_record() == {"authorize": "auth_1", "capture": ""}
    assert Charge.objects.count() == 0  # the view's writes died with it


@crashes_leave_an_intent
@pytest.mark.parametrize(
    ("step", "kept"),
    [
        ("capture", {"authorize": "auth_1", "capture": "cap_1"}),
        ("authorize", {"authorize": "auth_1"}),
        (None, {"authorize": "auth_1"}),  # the first call whose id is recorded
    ],
)
def test_a_simulated_crash_after_a_given_steps_call_keeps_the_id_it_recorded(
    api: APIClient, step: str | None, kept: dict[str, str]
) -> None:
    """The provider answered and its id committed; the process died before the answer did."""
    with simulate_crash_after_set_provider_operation(step=step), pytest.raises(SimulatedCrash):
        post(api, "/api-view/steps", TWO_STEPS, "k")

    assert steps_of_the_record() == kept
    assert Charge.objects.count() == 0


@crashes_leave_an_intent
def test_a_simulated_crash_after_the_one_calls_id_leaves_it_for_the_reconciler(
    api: APIClient,
) -> None:
    seen: list[str] = []

    @recovery.register_reconciler("POST api-view/provider-charge")
    def settle(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        seen.append(record.provider_operation_id)
        return recovery.Completed(status=201, body={"charge": record.provider_operation_id})

    try:
        with simulate_crash_after_set_provider_operation(), pytest.raises(SimulatedCrash):
            post(api, "/api-view/provider-charge", {"amount": 1}, "k")
        assert expire_leases() == 1
        assert recovery.recover_stale_records().completed == 1
    finally:
        del recovery._reconcilers["POST api-view/provider-charge"]

    assert seen == ["ch_1"]
    replay = post(api, "/api-view/provider-charge", {"amount": 1}, "k")
    assert (replay.status_code, replay.json()) == (201, {"charge": "ch_1"})


class ProviderDouble:
    """A client double whose provider charges, then the worker dies before the answer."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}

    def charge(self, amount: int, idempotency_key: str) -> str:
        self.charges[idempotency_key] = f"ch_{len(self.charges) + 1}"
        raise SimulatedCrash("killed while the provider's answer was on its way")


@crashes_leave_an_intent
def test_a_client_double_raising_simulated_crash_dies_between_the_call_and_its_id(
    api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What docs/testing.md shows: the crash point no helper can reach from outside."""
    from tests.testapp import views

    provider = ProviderDouble()
    monkeypatch.setattr(views, "provider", provider)

    with pytest.raises(SimulatedCrash):
        post(api, "/api-view/provider-charge", {"amount": 1}, "k")

    record = IdempotencyRecord.objects.get()
    assert (record.state, record.provider_operation_id) == (State.IN_PROGRESS, "")
    assert list(provider.charges) == [record.provider_key]  # charged: the reconciler finds it
    assert Charge.objects.count() == 0
