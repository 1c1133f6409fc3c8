"""``@idempotent(outcome=...)``: which answers are stored, released or left UNCERTAIN.

The standard policy is the behaviour table (tests/test_behaviour.py); a key
read from elsewhere than the Idempotency-Key header defaults to the webhook
policy (only 2xx stored). Views: ``tests/testapp/keyed_views.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.http import HttpResponse
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from django_idempotency.outcomes import Verdict, by_status, standard, webhook
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [pytest.mark.django_db(transaction=True)]

State = IdempotencyRecord.State


def deliver(api: APIClient, body: dict[str, Any]) -> Any:
    return api.post("/keyed/body-field", body, format="json")


def event(**extra: Any) -> dict[str, Any]:
    return {"data": {"object": {"id": "evt_1"}}, "amount": 5, **extra}


# -- the webhook policy, the default for keys from elsewhere -------------------------------


@pytest.mark.parametrize("status", [400, 401, 404, 410, 422, 500, 503])
def test_a_webhook_answer_other_than_2xx_is_not_stored(api: APIClient, status: int) -> None:
    """The sender redelivers it, and the redelivery must run again."""
    first = deliver(api, event(status=status))
    redelivery = deliver(api, event())

    assert first.status_code == status
    assert redelivery.status_code == 201
    assert "Idempotent-Replayed" not in redelivery
    # The failed run's writes rolled back: only the redelivery's remain.
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


@pytest.mark.parametrize("status", [200, 201, 202, 204])
def test_a_webhook_2xx_is_stored_and_replayed(api: APIClient, status: int) -> None:
    first = deliver(api, event(status=status))
    redelivery = deliver(api, event(status=status))

    assert redelivery["Idempotent-Replayed"] == "true"
    assert redelivery.status_code == first.status_code == status
    assert Charge.objects.count() == 1


def test_an_explicit_policy_wins_over_the_webhook_default(api: APIClient) -> None:
    """``by_status({})`` is the standard policy: a 404 is stored even for a body key."""
    body = {"id": "evt_2", "amount": 5, "status": 404}
    api.post("/keyed/body-field-standard", body, format="json")
    again = api.post("/keyed/body-field-standard", body, format="json")

    assert again["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().state == State.FAILED


# -- by_status ---------------------------------------------------------------------------


def test_an_uncertain_verdict_leaves_the_record_uncertain(api: APIClient) -> None:
    with signals_sent() as sent:
        first = post(api, "/policy/by-status", {"amount": 5, "status": 504}, "k-1")
    retry = post(api, "/policy/by-status", {"amount": 5, "status": 504}, "k-1")

    assert first.status_code == 504
    assert retry.status_code == 503
    assert retry.json()["code"] == "idempotency_outcome_uncertain"
    record = IdempotencyRecord.objects.get()
    assert record.state == State.UNCERTAIN
    assert record.provider_key  # what the view could have sent, for the reconciler
    assert record.lease_owner == ""
    assert Charge.objects.count() == 0  # the view's writes rolled back
    assert sent == ["record_uncertain"]


def test_a_released_status_runs_again(api: APIClient) -> None:
    post(api, "/policy/by-status", {"amount": 5, "status": 418}, "k-1")
    retry = post(api, "/policy/by-status", {"amount": 5}, "k-1")

    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1


def test_a_range_stores_3xx_as_failed_and_other_statuses_follow_the_standard_table(
    api: APIClient,
) -> None:
    post(api, "/policy/by-status", {"amount": 5, "status": 302}, "k-1")
    post(api, "/policy/by-status", {"amount": 5, "status": 503}, "k-2")

    assert IdempotencyRecord.objects.get().state == State.FAILED  # k-2 was released


def test_by_status_prefers_an_exact_status_to_a_range() -> None:
    policy = by_status({range(400, 500): Verdict.RELEASE, 404: Verdict.FAILED})

    assert policy(HttpResponse(status=404)) is Verdict.FAILED
    assert policy(HttpResponse(status=400)) is Verdict.RELEASE
    assert policy(HttpResponse(status=200)) is Verdict.COMPLETED


def test_by_status_refuses_what_is_not_a_verdict() -> None:
    with pytest.raises(TypeError):
        by_status({404: "FAILED"})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("status", "standard_verdict", "webhook_verdict"),
    [
        (200, Verdict.COMPLETED, Verdict.COMPLETED),
        (302, Verdict.COMPLETED, Verdict.RELEASE),
        (404, Verdict.FAILED, Verdict.RELEASE),
        (429, Verdict.RELEASE, Verdict.RELEASE),
        (500, Verdict.RELEASE, Verdict.RELEASE),
    ],
)
def test_the_ready_policies(
    status: int, standard_verdict: Verdict, webhook_verdict: Verdict
) -> None:
    response = HttpResponse(status=status)
    assert standard(response) is standard_verdict
    assert webhook(response) is webhook_verdict


class signals_sent:
    """The names of the record signals sent meanwhile."""

    NAMES = ("record_uncertain", "claim_released", "response_stored")

    def __enter__(self) -> list[str]:
        self.sent: list[str] = []
        self.receivers = []
        for name in self.NAMES:

            def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
                self.sent.append(name)

            getattr(signals, name).connect(receiver, weak=False)
            self.receivers.append((name, receiver))
        return self.sent

    def __exit__(self, *exc_info: object) -> None:
        for name, receiver in self.receivers:
            getattr(signals, name).disconnect(receiver)


# -- the project's default policy: IDEMPOTENCY["OUTCOME"] -----------------------------------


def test_the_outcome_setting_is_the_default_policy_of_views_keyed_by_the_header(
    api: APIClient, settings: Any
) -> None:
    """Set once for the project, as ``outcome=`` is per view: no 4xx stored, here."""
    settings.IDEMPOTENCY = {"OUTCOME": by_status({range(400, 500): Verdict.RELEASE})}
    first = post(api, "/api-view/charges", {"amount": 5, "status": 404}, "k-1")
    retry = post(api, "/api-view/charges", {"amount": 5}, "k-1")

    assert first.status_code == 404
    assert (retry.status_code, "Idempotent-Replayed" in retry) == (201, False)
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


def test_the_outcome_setting_takes_a_dotted_path(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"OUTCOME": "django_idempotency.outcomes.webhook"}
    post(api, "/api-view/charges", {"amount": 5, "status": 404}, "k-1")

    assert not IdempotencyRecord.objects.exists()  # webhook: only 2xx is stored


def test_a_views_own_outcome_wins_over_the_setting(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"OUTCOME": "django_idempotency.outcomes.webhook"}
    with signals_sent():
        post(api, "/policy/by-status", {"amount": 5, "status": 504}, "k-1")

    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN


def test_views_with_a_key_from_elsewhere_keep_the_webhook_policy(
    api: APIClient, settings: Any
) -> None:
    """A sender redelivers what it did not see succeed: the setting does not store its 4xx."""
    settings.IDEMPOTENCY = {"OUTCOME": "django_idempotency.outcomes.standard"}
    deliver(api, event(status=404))

    assert not IdempotencyRecord.objects.exists()
