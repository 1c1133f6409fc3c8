"""The demo project's payments API, on the test suite's settings and database.

Needs ``"payments"`` in ``tests/settings.py``'s INSTALLED_APPS; the URLs are
the test project's (``testproject.urls``). The last test runs the demo
script end to end against a real gunicorn.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.apps import apps

if not apps.is_installed("payments"):
    pytest.skip(
        'the demo project\'s app is not installed: add "payments" to INSTALLED_APPS '
        "in tests/settings.py",
        allow_module_level=True,
    )

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.http.response import HttpResponseBase
from payments.demo_data import ADMIN_PASSWORD, ADMIN_USERNAME, DEMO_TOKENS
from payments.models import Payment, Refund
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.factories import TokenFactory, UserFactory

REPO_ROOT = Path(__file__).resolve().parent.parent
State = IdempotencyRecord.State

api = [pytest.mark.django_db, pytest.mark.urls("testproject.urls")]


class Tenant(APIClient):
    """An API client authenticated with a real DRF token."""

    def __init__(self, username: str) -> None:
        super().__init__()
        self.user = UserFactory.create(username=username)
        token = TokenFactory.create(user=self.user)
        self.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
        self.tenant = f"user:{self.user.pk}"

    def pay(self, body: dict[str, Any], key: str | None) -> Any:
        return self._post("/v1/payments", body, key)

    def refund(self, payment_id: int, body: dict[str, Any], key: str | None) -> Any:
        return self._post(f"/v1/payments/{payment_id}/refunds", body, key)

    def _post(self, path: str, body: dict[str, Any], key: str | None) -> Any:
        headers = {"Idempotency-Key": key} if key is not None else {}
        return self.post(path, body, format="json", headers=headers)


@pytest.fixture
def alice(db: None) -> Tenant:
    return Tenant("alice")


@pytest.fixture
def bob(db: None) -> Tenant:
    return Tenant("bob")


ORDER = {"order_id": "ORD-1", "amount": 2500, "currency": "EUR"}


def replayed(response: HttpResponseBase) -> bool:
    return response.headers.get("Idempotent-Replayed") == "true"


def record(key: str) -> IdempotencyRecord:
    return IdempotencyRecord.objects.get(key=key)


class TestCreatePayment:
    pytestmark = api

    def test_created_with_location(self, alice: Tenant) -> None:
        response = alice.pay(ORDER, "k-1")

        assert response.status_code == 201
        payment = Payment.objects.get()
        assert response.json() == {
            "id": payment.pk,
            "order_id": "ORD-1",
            "amount": 2500,
            "currency": "EUR",
            "status": "succeeded",
            "created_at": response.json()["created_at"],
        }
        assert response["Location"] == f"/v1/payments/{payment.pk}"
        assert response["Idempotency-Key"] == "k-1"
        assert not replayed(response)
        assert payment.owner == alice.user
        stored = record("k-1")
        assert (stored.state, stored.tenant, stored.operation) == (
            State.COMPLETED,
            alice.tenant,
            "POST v1/payments",
        )

    def test_retry_is_an_identical_replay(self, alice: Tenant) -> None:
        first = alice.pay(ORDER, "k-1")
        retry = alice.pay(ORDER, "k-1")

        assert retry.status_code == 201
        assert replayed(retry)
        assert retry.content == first.content
        assert retry["Content-Type"] == first["Content-Type"]
        assert retry["Location"] == first["Location"]
        assert retry["Idempotency-Key"] == "k-1"
        assert Payment.objects.count() == 1

    def test_key_order_and_number_spelling_do_not_matter(self, alice: Tenant) -> None:
        first = alice.pay(ORDER, "k-1")
        retry = alice.post(
            "/v1/payments",
            b'{ "currency": "EUR", "amount": 2500.0, "order_id": "ORD-1" }',
            content_type="application/json",
            headers={"Idempotency-Key": "k-1"},
        )

        assert replayed(retry)
        assert retry.content == first.content

    def test_same_key_with_another_amount_is_refused(self, alice: Tenant) -> None:
        alice.pay(ORDER, "k-1")
        response = alice.pay({**ORDER, "amount": 9900}, "k-1")

        assert response.status_code == 422
        assert response.json()["code"] == "idempotency_key_reused"
        assert not replayed(response)
        assert list(Payment.objects.values_list("amount", flat=True)) == [2500]

    def test_tenants_do_not_share_keys(self, alice: Tenant, bob: Tenant) -> None:
        from_alice = alice.pay(ORDER, "shared")
        from_bob = bob.pay(ORDER, "shared")

        assert from_alice.status_code == from_bob.status_code == 201
        assert not replayed(from_alice)
        assert not replayed(from_bob)
        assert from_alice.json()["id"] != from_bob.json()["id"]
        assert Payment.objects.get(pk=from_bob.json()["id"]).owner == bob.user
        assert sorted(IdempotencyRecord.objects.values_list("tenant", flat=True)) == sorted(
            [alice.tenant, bob.tenant]
        )

    def test_domain_guard_with_a_new_key(self, alice: Tenant) -> None:
        alice.pay(ORDER, "k-1")
        response = alice.pay(ORDER, "k-2")

        assert response.status_code == 409
        assert response.json() == {
            "detail": "Order 'ORD-1' has already been paid.",
            "code": "order_already_paid",
        }
        assert not replayed(response)
        assert Payment.objects.count() == 1
        # 409 is retryable for django-idempotency: the claim was released.
        assert not IdempotencyRecord.objects.filter(key="k-2").exists()

    def test_invalid_input_is_not_stored_so_the_corrected_body_runs(self, alice: Tenant) -> None:
        body = {"order_id": "ORD-1", "amount": 0, "currency": "EURO"}
        first = alice.pay(body, "k-1")
        retry = alice.pay(body, "k-1")

        assert first.status_code == retry.status_code == 400
        assert set(first.json()) == {"amount", "currency"}
        assert not replayed(retry)
        assert not IdempotencyRecord.objects.filter(key="k-1").exists()

        corrected = alice.pay(ORDER, "k-1")

        assert corrected.status_code == 201
        assert record("k-1").state == State.COMPLETED
        assert Payment.objects.count() == 1

    def test_key_is_required(self, alice: Tenant) -> None:
        response = alice.pay(ORDER, None)

        assert response.status_code == 400
        assert response.json()["code"] == "idempotency_key_missing"
        assert not Payment.objects.exists()

    def test_anonymous_is_refused_before_any_claim(self, db: None) -> None:
        response = APIClient().post(
            "/v1/payments", ORDER, format="json", headers={"Idempotency-Key": "k-1"}
        )

        assert response.status_code == 401
        assert not IdempotencyRecord.objects.exists()


class TestReadPayments:
    pytestmark = api

    def test_owner_reads_own_payment(self, alice: Tenant) -> None:
        created = alice.pay(ORDER, "k-1")

        response = alice.get(created["Location"])

        assert response.status_code == 200
        assert response.content == created.content

    def test_another_tenants_payment_is_not_found(self, alice: Tenant, bob: Tenant) -> None:
        payment_id = bob.pay(ORDER, "k-1").json()["id"]

        assert alice.get(f"/v1/payments/{payment_id}").status_code == 404
        assert alice.get("/v1/payments").json() == []
        assert alice.get("/v1/payments?order_id=ORD-1").json() == []

    def test_list_by_order(self, alice: Tenant) -> None:
        alice.pay(ORDER, "k-1")
        alice.pay({**ORDER, "order_id": "ORD-2"}, "k-2")

        response = alice.get("/v1/payments?order_id=ORD-2")

        assert [p["order_id"] for p in response.json()] == ["ORD-2"]
        assert len(alice.get("/v1/payments").json()) == 2


class TestRefunds:
    pytestmark = api

    @pytest.fixture
    def payment_id(self, alice: Tenant) -> int:
        payment_id: int = alice.pay(ORDER, "pay").json()["id"]
        return payment_id

    def test_refund_runs_once_per_key(self, alice: Tenant, payment_id: int) -> None:
        first = alice.refund(payment_id, {"amount": 1000}, "r-1")
        retry = alice.refund(payment_id, {"amount": 1000}, "r-1")

        assert first.status_code == 201
        assert first.json()["payment"] == payment_id
        assert first.json()["amount"] == 1000
        assert replayed(retry)
        assert retry.content == first.content
        assert Refund.objects.count() == 1
        assert Payment.objects.get().status == Payment.Status.PARTIALLY_REFUNDED
        assert record("r-1").operation == "POST v1/payments/<int:pk>/refunds"

    def test_full_refund(self, alice: Tenant, payment_id: int) -> None:
        alice.refund(payment_id, {"amount": 1000}, "r-1")
        response = alice.refund(payment_id, {"amount": 1500}, "r-2")

        assert response.status_code == 201
        assert Payment.objects.get().status == Payment.Status.REFUNDED

    def test_refund_over_the_payment_is_a_stored_failure(
        self, alice: Tenant, payment_id: int
    ) -> None:
        alice.refund(payment_id, {"amount": 1000}, "r-1")
        first = alice.refund(payment_id, {"amount": 2000}, "r-2")

        assert first.status_code == 400
        assert "amount" in first.json()
        stored = record("r-2")
        assert (stored.state, stored.response_status) == (State.FAILED, 400)

        retry = alice.refund(payment_id, {"amount": 2000}, "r-2")
        assert retry.status_code == 400
        assert replayed(retry)
        assert retry.content == first.content
        assert Refund.objects.count() == 1

    def test_failed_refund_stays_failed_for_its_key(self, alice: Tenant, payment_id: int) -> None:
        # The stored 400 is the outcome of key r-2: even once the request
        # would fit, the same key replays it; a new key runs anew.
        alice.refund(payment_id, {"amount": 3000}, "r-2")
        assert replayed(alice.refund(payment_id, {"amount": 3000}, "r-2"))
        assert alice.refund(payment_id, {"amount": 2500}, "r-3").status_code == 201

    def test_same_key_on_another_payment_is_refused(self, alice: Tenant, payment_id: int) -> None:
        other = alice.pay({**ORDER, "order_id": "ORD-2"}, "pay-2").json()["id"]
        alice.refund(payment_id, {"amount": 100}, "r-1")

        # Same operation, same key: the URL argument is part of the input.
        response = alice.refund(other, {"amount": 100}, "r-1")

        assert response.status_code == 422
        assert response.json()["code"] == "idempotency_key_reused"

    def test_another_tenants_payment_cannot_be_refunded(self, bob: Tenant, payment_id: int) -> None:
        response = bob.refund(payment_id, {"amount": 100}, "r-1")

        assert response.status_code == 404
        assert not Refund.objects.exists()


class TestOperationStatus:
    """The demo mounts django_idempotency.urls: a client that lost an answer asks for it."""

    pytestmark = api

    def test_a_lost_answer_is_found_by_its_key_and_only_by_its_tenant(
        self, alice: Tenant, bob: Tenant
    ) -> None:
        first = alice.pay(ORDER, "k-lost")

        found = alice.get("/idempotency/status/", {"key": "k-lost"})
        for_bob = bob.get("/idempotency/status/", {"key": "k-lost"})
        never_sent = alice.get("/idempotency/status/", {"key": "k-never-sent"})

        assert found.status_code == 200
        assert found.json()["operation"] == "POST v1/payments"
        assert found.json()["state"] == "COMPLETED"
        assert found.json()["response"]["status"] == 201
        assert found.json()["response"]["body"] == first.json()
        assert found.json()["response"]["headers"]["Location"] == first["Location"]
        assert for_bob.status_code == never_sent.status_code == 404
        assert for_bob.content == never_sent.content


class TestTwoStepPayment:
    """Authorize, then capture: two steps of one operation (payments/two_step.py)."""

    pytestmark = api

    def pay(self, tenant: Tenant, body: dict[str, Any], key: str) -> Any:
        return tenant._post("/v1/payments/two-step", body, key)

    def test_each_step_calls_the_provider_once_and_is_recorded(self, alice: Tenant) -> None:
        from payments import provider_client

        first = self.pay(alice, ORDER, "two-1")
        again = self.pay(alice, ORDER, "two-1")

        assert first.status_code == 201 and again.status_code == 201 and replayed(again)
        held = record("two-1")
        steps = list(held.steps.order_by("begun_at", "pk"))
        assert [step.name for step in steps] == ["authorize", "capture"]
        entries = [provider_client.find_charge(step.provider_key) for step in steps]
        assert [(e.metadata["step"], e.attempts) for e in entries if e] == [
            ("authorize", 1),
            ("capture", 1),
        ]
        assert [step.provider_operation_id for step in steps] == [e.id for e in entries if e]
        payment = Payment.objects.get(order_id=ORDER["order_id"])
        assert payment.provider_charge_id == steps[1].provider_operation_id

    @pytest.mark.django_db(transaction=True)
    def test_killed_after_beginning_the_authorization_is_released_and_retried(
        self, alice: Tenant
    ) -> None:
        """The other points are the live crash tests' (tests/live/test_two_step_crashes.py)."""
        from django.db import connection

        if connection.vendor == "sqlite":
            pytest.skip("the simulated crash needs PostgreSQL or MariaDB (docs/testing.md)")
        from django_idempotency._protection.crash import SimulatedCrash
        from django_idempotency.recovery import recover_stale_records
        from django_idempotency.testing import expire_leases, simulate_crash_after_begin_external

        with simulate_crash_after_begin_external(), pytest.raises(SimulatedCrash):
            self.pay(alice, ORDER, "two-2")
        assert [s.name for s in record("two-2").steps.all()] == ["authorize"]
        expire_leases()

        report = recover_stale_records()

        assert report.released == 1  # never authorized: nothing to keep
        assert self.pay(alice, ORDER, "two-2").status_code == 201
        assert Payment.objects.filter(order_id=ORDER["order_id"]).count() == 1


class TestNinjaRefunds:
    """The refunds again through the demo's Django Ninja API (payments/ninja_api.py)."""

    pytestmark = api

    @pytest.fixture
    def payment_id(self, alice: Tenant) -> int:
        payment = Payment.objects.create(owner=alice.user, order_id="ORD-1", amount=2500)
        return payment.pk

    def refund(self, tenant: Tenant, payment_id: int, body: dict[str, Any], key: str | None) -> Any:
        headers = {"Idempotency-Key": key} if key is not None else {}
        path = f"/ninja/v1/payments/{payment_id}/refunds"
        return tenant.post(path, body, format="json", headers=headers)

    def test_a_refund_runs_once_per_key_in_the_users_tenant(
        self, alice: Tenant, payment_id: int
    ) -> None:
        first = self.refund(alice, payment_id, {"amount": 1000}, "r-1")
        retry = self.refund(alice, payment_id, {"amount": 1000}, "r-1")

        assert first.status_code == 201
        assert first.json() == {
            "id": Refund.objects.get().pk,
            "payment_id": payment_id,
            "amount": 1000,
        }
        assert replayed(retry) and retry.content == first.content
        assert Refund.objects.count() == 1
        stored = record("r-1")
        # The same tenant as through the DRF API: the token's user.
        assert stored.tenant == alice.tenant
        assert stored.operation == "POST ninja/v1/payments/<int:payment_id>/refunds"

    def test_a_refund_over_the_payment_is_a_stored_failure(
        self, alice: Tenant, payment_id: int
    ) -> None:
        first = self.refund(alice, payment_id, {"amount": 9000}, "r-1")
        retry = self.refund(alice, payment_id, {"amount": 9000}, "r-1")

        assert first.status_code == 400 and "2500 left" in first.json()["detail"]
        assert replayed(retry) and retry.content == first.content
        assert record("r-1").state == State.FAILED

    def test_refusals_and_authentication(self, alice: Tenant, payment_id: int) -> None:
        missing = self.refund(alice, payment_id, {"amount": 100}, None)
        self.refund(alice, payment_id, {"amount": 100}, "r-1")
        reused = self.refund(alice, payment_id, {"amount": 200}, "r-1")
        anonymous = APIClient().post(
            f"/ninja/v1/payments/{payment_id}/refunds",
            {"amount": 100},
            format="json",
            headers={"Idempotency-Key": "r-2"},
        )

        assert (missing.status_code, missing.json()["code"]) == (400, "idempotency_key_missing")
        assert (reused.status_code, reused.json()["code"]) == (422, "idempotency_key_reused")
        assert anonymous.status_code == 401
        assert Refund.objects.count() == 1

    def test_the_schema_documents_the_key_and_the_refusals(self, db: None) -> None:
        schema = APIClient().get("/ninja/v1/openapi.json").json()
        operation = schema["paths"]["/ninja/v1/payments/{payment_id}/refunds"]["post"]

        assert "Idempotency-Key" in [parameter["name"] for parameter in operation["parameters"]]
        assert {"409", "422"} <= set(operation["responses"])


@pytest.mark.django_db
def test_seed_demo_is_idempotent() -> None:
    call_command("seed_demo", stdout=io.StringIO())
    call_command("seed_demo", stdout=io.StringIO())

    users = get_user_model().objects
    assert users.count() == 3
    for username, key in DEMO_TOKENS.items():
        assert Token.objects.get(user__username=username).key == key
    admin = users.get(username=ADMIN_USERNAME)
    assert admin.is_superuser and admin.is_staff
    assert admin.check_password(ADMIN_PASSWORD)


@pytest.mark.django_db
def test_payments_migrations_are_complete() -> None:
    call_command("makemigrations", "payments", "--check", "--dry-run", stdout=io.StringIO())


@pytest.mark.live
def test_demo_script_end_to_end(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "testproject/demo.py", "--database-file", str(tmp_path / "demo.sqlite3")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "All " in result.stdout and "expectations held" in result.stdout
