"""The demo project's payment provider: the simulator, the view's use of it, the reconciler.

The simulator runs as its own process (the session's ``payments_provider``
fixture, ``conftest.py`` at the repository root); the payments API runs
in-process on the test database. The crash tests with real gunicorn and
Celery processes are in ``tests/live/test_crashes.py``.
"""

from __future__ import annotations

import importlib.util
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from django.apps import apps

if not apps.is_installed("payments"):
    pytest.skip("the demo project's app is not installed", allow_module_level=True)

from django.utils import timezone
from payments import provider_client
from payments.models import Payment
from payments.reconcilers import OPERATION
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.context import derive_provider_key
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import recover_stale_records
from django_idempotency.scope import Scope
from tests.factories import RecordFactory, TokenFactory
from tests.utils import TokenClient, raw_body

REPO_ROOT = Path(__file__).resolve().parent.parent
State = IdempotencyRecord.State
pytestmark = [pytest.mark.usefixtures("payments_provider")]


def unique(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


# -- the simulator over HTTP -----------------------------------------------------------


class TestSimulator:
    def charge(self, url: str, body: dict[str, Any], **headers: str) -> requests.Response:
        return requests.post(f"{url}/charges", json=body, headers=headers, timeout=10)

    def test_one_charge_per_idempotency_id(self, payments_provider: str) -> None:
        body = {"idempotency_id": unique("id"), "amount": 100, "currency": "eur"}
        first = self.charge(payments_provider, body)
        again = self.charge(payments_provider, body)

        assert (first.status_code, again.status_code) == (201, 200)
        assert first.json()["id"] == again.json()["id"]
        assert first.json()["currency"] == "EUR"
        assert again.json()["attempts"] == 2
        found = requests.get(f"{payments_provider}/charges/{body['idempotency_id']}", timeout=5)
        assert found.json()["id"] == first.json()["id"]
        ledger = requests.get(f"{payments_provider}/ledger", timeout=5).json()["charges"]
        assert [c["idempotency_id"] for c in ledger].count(body["idempotency_id"]) == 1

    def test_a_reused_id_with_another_amount_is_refused(self, payments_provider: str) -> None:
        body = {"idempotency_id": unique("id"), "amount": 100, "currency": "EUR"}
        self.charge(payments_provider, body)
        refused = self.charge(payments_provider, {**body, "amount": 101})

        assert refused.status_code == 422
        assert refused.json()["error"]["code"] == "idempotency_mismatch"

    def test_unknown_id_is_404(self, payments_provider: str) -> None:
        response = requests.get(f"{payments_provider}/charges/{unique('none')}", timeout=5)
        assert response.status_code == 404

    @pytest.mark.parametrize(
        ("mode", "status", "charged"), [("decline", 402, False), ("fail-before-charge", 500, False)]
    )
    def test_failures_before_a_charge(
        self, payments_provider: str, mode: str, status: int, charged: bool
    ) -> None:
        body: dict[str, Any] = {"idempotency_id": unique("id"), "amount": 100, "currency": "EUR"}
        response = self.charge(payments_provider, body, **{"X-Simulate": mode})

        assert response.status_code == status
        assert provider_client.find_charge(body["idempotency_id"]) is None

    def test_charge_then_disconnect_charges_without_an_answer(self, payments_provider: str) -> None:
        body: dict[str, Any] = {"idempotency_id": unique("id"), "amount": 100, "currency": "EUR"}
        with pytest.raises(requests.ConnectionError):
            self.charge(payments_provider, body, **{"X-Simulate": "charge-then-disconnect"})
        assert provider_client.find_charge(body["idempotency_id"]) is not None

    def test_charge_then_timeout_charges_and_outlasts_the_client(
        self, payments_provider: str
    ) -> None:
        body: dict[str, Any] = {"idempotency_id": unique("id"), "amount": 100, "currency": "EUR"}
        with pytest.raises(requests.Timeout):
            requests.post(
                f"{payments_provider}/charges",
                json=body,
                headers={"X-Simulate": "charge-then-timeout", "X-Simulate-Delay": "5"},
                timeout=0.5,
            )
        assert provider_client.find_charge(body["idempotency_id"]) is not None

    def test_unknown_mode_and_bad_input_are_400(self, payments_provider: str) -> None:
        body = {"idempotency_id": unique("id"), "amount": 100, "currency": "EUR"}
        assert self.charge(payments_provider, body, **{"X-Simulate": "nope"}).status_code == 400
        assert self.charge(payments_provider, {**body, "amount": -1}).status_code == 400
        assert self.charge(payments_provider, {**body, "idempotency_id": ""}).status_code == 400


# -- the payments view charges through it ----------------------------------------------


@pytest.fixture
def alice(db: None) -> TokenClient:
    return TokenClient(TokenFactory.create(user__username=unique("alice")))


def pay(client: APIClient, body: dict[str, Any], key: str, **headers: str) -> Any:
    return client.post(
        "/v1/payments", body, format="json", headers={"Idempotency-Key": key, **headers}
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls("testproject.urls")
class TestView:
    def test_the_payment_records_the_providers_charge(self, alice: TokenClient) -> None:
        order = {"order_id": unique("ORD"), "amount": 1234, "currency": "EUR"}
        response = pay(alice, order, "k")

        assert response.status_code == 201
        record = IdempotencyRecord.objects.get(key="k", tenant=f"user:{alice.user.pk}")
        charge = provider_client.find_charge(record.provider_key)
        assert charge is not None
        payment = Payment.objects.get(pk=response.json()["id"])
        assert payment.provider_charge_id == charge.id == record.provider_operation_id
        assert record.provider_key == derive_provider_key(Scope(record.tenant, OPERATION, "k"))
        assert (charge.amount, charge.currency) == (1234, "EUR")
        assert charge.metadata == {
            "owner_id": alice.user.pk,
            "order_id": order["order_id"],
            "amount": 1234,
            "currency": "EUR",
        }

    def test_simulation_headers_are_ignored_unless_enabled(self, alice: TokenClient) -> None:
        order = {"order_id": unique("ORD"), "amount": 10, "currency": "EUR"}
        response = pay(alice, order, "k", **{"X-Simulate": "decline"})
        assert response.status_code == 201

    def test_a_decline_is_a_stored_402(self, alice: TokenClient, settings: Any) -> None:
        settings.PAYMENTS_PROVIDER_SIMULATION = True
        order = {"order_id": unique("ORD"), "amount": 10, "currency": "EUR"}
        first = pay(alice, order, "k", **{"X-Simulate": "decline"})
        retry = pay(alice, order, "k")

        assert first.status_code == 402
        assert first.json()["code"] == "card_declined"
        assert retry.status_code == 402
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert IdempotencyRecord.objects.get(key="k").state == State.FAILED
        assert not Payment.objects.filter(order_id=order["order_id"]).exists()

    @pytest.mark.parametrize("mode", ["fail-before-charge", "charge-then-disconnect"])
    def test_an_unknown_outcome_leaves_the_record_uncertain(
        self, alice: TokenClient, settings: Any, mode: str
    ) -> None:
        settings.PAYMENTS_PROVIDER_SIMULATION = True
        order = {"order_id": unique("ORD"), "amount": 10, "currency": "EUR"}
        first = pay(alice, order, "k", **{"X-Simulate": mode})
        retry = pay(alice, order, "k")

        assert first.status_code == 502
        assert first.json()["code"] == "payment_provider_unavailable"
        assert retry.status_code == 503
        assert retry.json()["code"] == "idempotency_outcome_uncertain"
        record = IdempotencyRecord.objects.get(key="k")
        assert record.state == State.UNCERTAIN
        assert record.provider_key

        recover_stale_records()
        settled = pay(alice, order, "k")

        assert settled.status_code == 201
        # Charged: the reconciler completed it and the retry is its replay;
        # never charged: it was released and the retry ran the view.
        assert (settled.headers.get("Idempotent-Replayed") == "true") == (
            mode == "charge-then-disconnect"
        )
        payment = Payment.objects.get(order_id=order["order_id"])
        assert settled.json()["id"] == payment.pk
        charge = provider_client.find_charge(record.provider_key)
        assert charge is not None and charge.id == payment.provider_charge_id

    def test_an_answer_for_another_order_is_refused(self, alice: TokenClient) -> None:
        # A provider that answers with a charge made for another order (its
        # idempotency ids collided): the view refuses to record it as paid.
        owner = alice.user

        def collide(sender: Any, scope: Scope, **kwargs: Any) -> None:
            provider_client.create_charge(
                derive_provider_key(scope),
                10,
                "EUR",
                metadata={"owner_id": owner.pk, "order_id": "OTHER"},
            )

        signals.request_claimed.connect(collide)
        try:
            response = pay(alice, {"order_id": unique("ORD"), "amount": 10, "currency": "EUR"}, "k")
        finally:
            signals.request_claimed.disconnect(collide)

        assert response.status_code == 422
        assert response.json()["code"] == "provider_key_conflict"
        assert not Payment.objects.exists()


# -- the reconciler -----------------------------------------------------------------------


def stuck_record(owner_id: int, key: str, state: str = State.IN_PROGRESS) -> IdempotencyRecord:
    scope = Scope(f"user:{owner_id}", OPERATION, key)
    record = RecordFactory.create(
        tenant=scope.tenant,
        operation=OPERATION,
        key=key,
        state=state,
        lease_expires_at=timezone.now() - timedelta(seconds=1),
        response_status=None,
        response_headers=[],
        response_body=None,
    )
    record.provider_key = derive_provider_key(scope)
    record.save(update_fields=["provider_key"])
    return record


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls("testproject.urls")
class TestReconciler:
    def test_a_charge_becomes_the_payment_and_the_stored_201(self, alice: TokenClient) -> None:
        owner = alice.user
        order_id = unique("ORD")
        record = stuck_record(owner.pk, "k")
        charge = provider_client.create_charge(
            record.provider_key,
            777,
            "EUR",
            metadata={"owner_id": owner.pk, "order_id": order_id},
        )

        report = recover_stale_records()

        assert report.completed == 1
        payment = Payment.objects.get(owner=owner, order_id=order_id)
        assert (payment.amount, payment.currency, payment.provider_charge_id) == (
            777,
            "EUR",
            charge.id,
        )
        record.refresh_from_db()
        assert (record.state, record.response_status) == (State.COMPLETED, 201)
        headers = dict(record.response_headers)
        assert headers == {
            "Content-Type": "application/json",
            "Location": f"/v1/payments/{payment.pk}",
        }
        # What the client's retry gets: the answer the view would have given.
        view_answer = alice.get(f"/v1/payments/{payment.pk}")
        assert raw_body(record) == view_answer.content

    def test_a_payment_the_dead_request_committed_is_reused(self, alice: TokenClient) -> None:
        owner = alice.user
        order_id = unique("ORD")
        record = stuck_record(owner.pk, "k", State.UNCERTAIN)
        charge = provider_client.create_charge(
            record.provider_key, 5, "EUR", metadata={"owner_id": owner.pk, "order_id": order_id}
        )
        Payment.objects.create(
            owner=owner, order_id=order_id, amount=5, currency="EUR", provider_charge_id=charge.id
        )

        assert recover_stale_records().completed == 1
        assert Payment.objects.filter(order_id=order_id).count() == 1

    def test_no_charge_releases_the_record(self, alice: TokenClient) -> None:
        record = stuck_record(alice.user.pk, unique("k"))

        assert recover_stale_records().released == 1
        assert not IdempotencyRecord.objects.filter(pk=record.pk).exists()

    def test_an_order_paid_by_another_charge_fails_with_409(self, alice: TokenClient) -> None:
        owner = alice.user
        order_id = unique("ORD")
        record = stuck_record(owner.pk, "k")
        provider_client.create_charge(
            record.provider_key, 5, "EUR", metadata={"owner_id": owner.pk, "order_id": order_id}
        )
        Payment.objects.create(
            owner=owner, order_id=order_id, amount=5, currency="EUR", provider_charge_id="ch_other"
        )

        assert recover_stale_records().failed == 1
        record.refresh_from_db()
        assert (record.state, record.response_status) == (State.FAILED, 409)
        assert b"order_already_paid" in raw_body(record)

    def test_a_charge_of_another_tenant_is_left_for_an_operator(self, alice: TokenClient) -> None:
        owner = alice.user
        record = stuck_record(owner.pk, "k")
        provider_client.create_charge(
            record.provider_key,
            5,
            "EUR",
            metadata={"owner_id": owner.pk + 1000, "order_id": unique("ORD")},
        )

        report = recover_stale_records()

        assert report.retried == 1
        record.refresh_from_db()
        assert record.state == State.UNCERTAIN
        assert not Payment.objects.exists()


# -- the Celery app ------------------------------------------------------------------------


def test_testproject_beat_schedule_merges_the_packages() -> None:
    """The demo's settings merge the package's BEAT_SCHEDULE into CELERY_BEAT_SCHEDULE."""
    from django_idempotency.tasks import BEAT_SCHEDULE

    path = REPO_ROOT / "testproject" / "testproject" / "settings.py"
    spec = importlib.util.spec_from_file_location("testproject_settings_copy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    for name, entry in BEAT_SCHEDULE.items():
        assert module.CELERY_BEAT_SCHEDULE[name] == entry
    assert module.CELERY_BROKER_URL.startswith("redis://")
