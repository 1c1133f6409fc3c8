"""``ADVERTISE_RETENTION``: how long the outcome is kept, on the responses that store one.

``Idempotency-Key-Expires-In`` is the operation's retention on a first
execution (the completion just set ``expires_at`` to the database's time
plus it) and what is left of it on a replay (``expires_at`` less the
database's time of the lookup), and absent wherever nothing was stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from django.core.checks import run_checks
from django.db.models import F
from django.test import override_settings

from django_idempotency import signals
from django_idempotency._store.database_time import DatabaseLater
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import RETENTION_HEADER
from django_idempotency.scope import Scope
from tests.test_store_unavailable import unreachable_store  # noqa: F401  (a fixture)
from tests.utils import TokenClient, post

pytestmark = pytest.mark.django_db(transaction=True)
DAY = 24 * 60 * 60


@pytest.fixture
def advertised() -> Iterator[None]:
    with override_settings(IDEMPOTENCY={"ADVERTISE_RETENTION": True}):
        yield


@pytest.fixture
def alice(client_for: Callable[..., TokenClient]) -> TokenClient:
    return client_for()


def test_off_by_default(alice: TokenClient, new_key: Callable[[], str]) -> None:
    key = new_key()
    first = post(alice, "/api-view/charges", {"amount": 1}, key)
    replay = post(alice, "/api-view/charges", {"amount": 1}, key)

    assert RETENTION_HEADER not in first
    assert RETENTION_HEADER not in replay


def test_a_first_execution_carries_the_operations_retention(
    advertised: None, alice: TokenClient, new_key: Callable[[], str]
) -> None:
    default_ttl = post(alice, "/api-view/charges", {"amount": 1}, new_key())
    view_ttl = post(alice, "/api-view/fields", {"amount": 1, "card": {"last4": "4242"}}, new_key())

    assert default_ttl.status_code == view_ttl.status_code == 201
    assert default_ttl[RETENTION_HEADER] == str(DAY)
    assert view_ttl[RETENTION_HEADER] == "60"  # @idempotent(ttl=60)


def test_a_stored_refusal_carries_it_too(
    advertised: None, alice: TokenClient, new_key: Callable[[], str]
) -> None:
    refused = post(alice, "/api-view/charges", {"amount": 1, "forbidden": True}, new_key())

    assert refused.status_code == 403
    assert refused[RETENTION_HEADER] == str(DAY)


@pytest.mark.parametrize("code", [503, 429, 409])
def test_an_answer_that_is_not_stored_carries_none(
    advertised: None, alice: TokenClient, new_key: Callable[[], str], code: int
) -> None:
    released = post(alice, "/api-view/charges", {"amount": 1, "status": code}, new_key())

    assert released.status_code == code
    assert RETENTION_HEADER not in released


def test_a_refusal_carries_none(
    advertised: None, alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    post(alice, "/api-view/charges", {"amount": 1}, key)
    reused = post(alice, "/api-view/charges", {"amount": 2}, key)

    assert reused.status_code == 422
    assert RETENTION_HEADER not in reused


def test_a_replay_carries_what_is_left(
    advertised: None, alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    post(alice, "/api-view/charges", {"amount": 1}, key)
    # As if most of the retention had passed: 100 s left, on the database's clock.
    IdempotencyRecord.objects.filter(key=key).update(
        expires_at=DatabaseLater(timedelta(seconds=100))
    )

    replay = post(alice, "/api-view/charges", {"amount": 1}, key)

    assert replay["Idempotent-Replayed"] == "true"
    assert 95 <= int(replay[RETENTION_HEADER]) <= 100


def test_an_extended_retention_shows_on_replays(
    advertised: None, alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    post(alice, "/api-view/charges", {"amount": 1}, key)
    IdempotencyRecord.objects.filter(key=key).update(expires_at=F("expires_at") + timedelta(days=1))

    replay = post(alice, "/api-view/charges", {"amount": 1}, key)

    assert 2 * DAY - 10 <= int(replay[RETENTION_HEADER]) <= 2 * DAY


def test_the_optimistic_mode_carries_it(
    advertised: None, alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    first = post(alice, "/api-view/optimistic", {"amount": 1}, key)
    replay = post(alice, "/api-view/optimistic", {"amount": 1}, key)
    released = post(alice, "/api-view/optimistic", {"amount": 1, "status": 503}, new_key())

    assert first[RETENTION_HEADER] == str(DAY)
    assert 0 < int(replay[RETENTION_HEADER]) <= DAY
    assert RETENTION_HEADER not in released


def test_a_stored_outcome_without_a_request_marks_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # No sender does so today (tasks send no response_stored); one must not break.
    signals.notify(
        signals.response_stored, None, Scope("t", "op", "k"), state="COMPLETED", status=201
    )

    assert "raised" not in caplog.text


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_setting_that_is_not_a_boolean_is_reported(value: object) -> None:
    with override_settings(IDEMPOTENCY={"ADVERTISE_RETENTION": value}):
        ids = {message.id for message in run_checks(tags=["compatibility"])}

    assert "django_idempotency.E034" in ids


@pytest.mark.usefixtures("unreachable_store")
def test_an_unprotected_run_under_fail_open_carries_none(
    alice: TokenClient, new_key: Callable[[], str]
) -> None:
    with override_settings(
        IDEMPOTENCY={"DATABASE": "unreachable", "FAIL_OPEN": True, "ADVERTISE_RETENTION": True}
    ):
        response = post(alice, "/api-view/charges", {"amount": 1}, new_key())

    assert response.status_code == 201
    assert RETENTION_HEADER not in response
