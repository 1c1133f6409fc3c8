"""Review of issue 15's optimistic mode: signals, a second database, sealing, a lost session.

Each test asserts what docs/transactions.md "Optimistic mode" promises; a
failure is a finding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator


import pytest
from cryptography.fernet import Fernet
from django.db import connection, connections
from django.test import override_settings

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from tests.test_review_issue15_races import _concurrently, _one_winner_the_rest_replay, _send
from tests.testapp.models import Charge
from tests.utils import TokenClient, post, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State


def test_signals_under_a_race_one_stored_none_claimed() -> None:
    by_name = {
        "claimed": signals.request_claimed,
        "stored": signals.response_stored,
        "released": signals.claim_released,
    }
    with signals_sent(by_name) as sent:
        responses = _concurrently([("/api-view/optimistic", {"amount": 1, "hold": 0.3}, "k", {}, 0)] * 3)
    _one_winner_the_rest_replay(responses)
    names = sorted(name for name, _ in sent)
    assert names.count("stored") == 1, sent
    assert "claimed" not in names, sent
    # The losers replayed: nothing of theirs is "released, the retry runs".
    assert "released" not in names, sent


@pytest.fixture
def atomic_second_alias() -> Iterator[None]:
    second = connections["shard_a"].settings_dict
    before = second.get("ATOMIC_REQUESTS", False)
    second["ATOMIC_REQUESTS"] = True
    try:
        yield
    finally:
        second["ATOMIC_REQUESTS"] = before


@pytest.mark.django_db(databases=["default", "shard_a"], transaction=True)
@pytest.mark.usefixtures("atomic_second_alias")
def test_losers_writes_on_a_second_atomic_alias_roll_back() -> None:
    body = {"amount": 1, "hold": 0.3}
    responses = _concurrently([("/review15/second-alias", body, "k", {}, 0)] * 3)
    _one_winner_the_rest_replay(responses)
    assert Charge.objects.using("shard_a").count() == 1


def test_an_encrypted_finished_record_replays() -> None:
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}):
        first = _send("/api-view/optimistic", {"amount": 1}, "k", {})
        record = IdempotencyRecord.objects.get()
        again = _send("/api-view/optimistic", {"amount": 1}, "k", {})
    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert record.response_sealed and first.content not in bytes(record.response_body)
    assert record.response_headers == []


def test_the_status_view_reads_an_optimistic_record(
    client_for: Callable[..., TokenClient],
) -> None:
    alice = client_for()
    first = post(alice, "/api-view/optimistic", {"amount": 3}, "k")
    assert first.status_code == 201
    answer = alice.get("/idempotency/status/", {"key": "k", "operation": "POST api-view/optimistic"})
    assert answer.status_code == 200, answer.content
    assert answer.json()["state"] == "COMPLETED"
    assert answer.json()["response"]["status"] == 201


def test_a_session_lost_mid_view_is_503_and_leaves_nothing() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("pg_terminate_backend")
    lost = _send("/review15/loses-connection", {"amount": 1, "terminate": True}, "k", {})
    connections.close_all()
    assert lost.status_code == 503, lost.content
    assert not Charge.objects.exists() and not IdempotencyRecord.objects.exists()
    retry = _send("/review15/loses-connection", {"amount": 1}, "k", {})
    assert retry.status_code == 201 and Charge.objects.count() == 1


