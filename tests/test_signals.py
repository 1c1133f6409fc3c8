"""A signal for each outcome, so that projects can count them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from tests.utils import SentSignals, post, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)

ALL = {
    "request_claimed": signals.request_claimed,
    "response_stored": signals.response_stored,
    "response_replayed": signals.response_replayed,
    "request_in_flight": signals.request_in_flight,
    "key_reused": signals.key_reused,
    "claim_released": signals.claim_released,
    "store_unavailable": signals.store_unavailable,
}


@pytest.fixture
def sent() -> Iterator[SentSignals]:
    with signals_sent(ALL) as log:
        yield log


def names(log: SentSignals) -> list[str]:
    return [name for name, _ in log]


def test_each_outcome_sends_its_signal(api: APIClient, sent: SentSignals) -> None:
    url = "/api-view/charges"
    post(api, url, {"amount": 1}, "k")
    assert names(sent) == ["request_claimed", "response_stored"]
    assert sent[1][1]["state"] == "COMPLETED" and sent[1][1]["status"] == 201

    sent.clear()
    post(api, url, {"amount": 1}, "k")
    post(api, url, {"amount": 2}, "k")
    assert names(sent) == ["response_replayed", "key_reused"]

    sent.clear()
    IdempotencyRecord.objects.update(state=IdempotencyRecord.State.CLAIMED)
    post(api, url, {"amount": 1}, "k")
    assert names(sent) == ["request_in_flight"]
    assert sent[0][1]["state"] == "CLAIMED"

    sent.clear()
    post(api, url, {"amount": 1, "status": 503}, "other")
    assert names(sent) == ["request_claimed", "claim_released"]
    assert sent[1][1]["reason"] == 503
    scope = sent[1][1]["scope"]
    assert (scope.tenant, scope.operation, scope.key) == (
        "anonymous",
        "POST api-view/charges",
        "other",
    )


def test_a_failing_receiver_is_logged_and_never_fails_the_request(
    api: APIClient, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        raise RuntimeError("metrics backend down")

    for signal in ALL.values():
        signal.connect(broken)
    try:
        first = post(api, "/api-view/charges", {"amount": 1}, "k")
        retry = post(api, "/api-view/charges", {"amount": 1}, "k")
    finally:
        for signal in ALL.values():
            signal.disconnect(broken)

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().state == IdempotencyRecord.State.COMPLETED
    assert "metrics backend down" in caplog.text


def test_a_request_announces_its_outcome_once_when_answered(
    api: APIClient, sent: SentSignals
) -> None:
    """The release and the answer are announced together, after the view's last write.

    A view that fails after its claim: ``claim_released`` comes once, after
    ``request_claimed`` (the one signal sent before the view), and no
    receiver hears of the release while the view is still running.
    """
    api.raise_request_exception = False
    during_view: list[str] = []

    def note_during_view(sender: Any, **kwargs: Any) -> None:
        during_view.extend(names(sent))

    signals.request_claimed.connect(note_during_view, weak=False)
    try:
        response = post(api, "/api-view/charges", {"amount": 1, "raise": True}, "boom")
    finally:
        signals.request_claimed.disconnect(note_during_view)

    assert response.status_code == 500
    assert during_view == ["request_claimed"]
    assert names(sent) == ["request_claimed", "claim_released"]
    assert sent[1][1]["reason"] == "exception"


def test_a_receiver_connected_after_requests_nobody_heard_hears_the_next_one(
    api: APIClient,
) -> None:
    """With no receiver, no metrics backend and no tracing SDK, a request's outcome is not
    even built; whether anything listens is asked at every request, not once."""
    url = "/api-view/charges"
    post(api, url, {"amount": 1}, "late")
    post(api, url, {"amount": 1}, "late")  # a replay nobody hears of

    with signals_sent({"response_replayed": signals.response_replayed}) as log:
        post(api, url, {"amount": 1}, "late")
    post(api, url, {"amount": 1}, "late")  # disconnected again: unheard

    assert names(log) == ["response_replayed"]
    assert log[0][1]["status"] == 201
