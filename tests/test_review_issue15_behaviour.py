"""Review of issue 15's optimistic mode: signals, a second database, sealing, a lost session.

Each test asserts what docs/transactions.md "Optimistic mode" promises; a
failure is a finding.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db import connection, connections
from django.test import override_settings

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from tests.test_review_issue15_races import _concurrently, _one_winner_the_rest_replay, _send
from tests.testapp.models import Charge
from tests.utils import TokenClient, post, raw_body, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State


def test_signals_under_a_race_one_stored_none_claimed() -> None:
    by_name = {
        "claimed": signals.request_claimed,
        "stored": signals.response_stored,
        "released": signals.claim_released,
    }
    with signals_sent(by_name) as sent:
        call: Any = ("/api-view/optimistic", {"amount": 1, "hold": 0.3}, "k", {}, 0.0)
        responses = _concurrently([call] * 3)
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
    assert record.response_sealed and first.content not in raw_body(record)
    assert record.response_headers == []


def test_the_status_view_reads_an_optimistic_record(
    client_for: Callable[..., TokenClient],
) -> None:
    alice = client_for()
    first = post(alice, "/api-view/optimistic", {"amount": 3}, "k")
    assert first.status_code == 201
    where = {"key": "k", "operation": "POST api-view/optimistic"}
    answer = alice.get("/idempotency/status/", where)
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


def test_a_loser_that_gave_up_leaves_no_lock_timeout_on_its_connection() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the transaction-local lock_timeout is PostgreSQL's")
    winner: list[Any] = []
    body = {"amount": 1, "order": "A-1", "hold": 1.5}

    def run_the_winner() -> None:
        try:
            winner.append(_send("/api-view/optimistic", body, "k", {}))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run_the_winner)
    thread.start()
    time.sleep(0.4)
    with override_settings(IDEMPOTENCY={"IN_FLIGHT_WAIT": timedelta(milliseconds=200)}):
        loser = _send("/api-view/optimistic", body, "k", {})
    with connection.cursor() as cursor:  # the same connection, reused as a pool would
        cursor.execute("SHOW lock_timeout")
        after = cursor.fetchone()[0]
    thread.join(timeout=30)
    assert loser.status_code == 409 and winner[0].status_code == 201
    assert after == "0"


@contextlib.contextmanager
def _commit_kills_the_session() -> Iterator[None]:
    """A deferred constraint trigger on charges that terminates its own session at COMMIT."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION review15_die() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NULL; END $$"
        )
        cursor.execute(
            "CREATE CONSTRAINT TRIGGER review15_die AFTER INSERT ON testapp_charge "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION review15_die()"
        )
    try:
        yield
    finally:
        connections.close_all()
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS review15_die ON testapp_charge")
            cursor.execute("DROP FUNCTION IF EXISTS review15_die()")


def test_a_session_lost_at_commit_is_503_and_the_retry_is_right() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("a deferred trigger terminating its session")
    with _commit_kills_the_session():
        lost = _send("/api-view/optimistic", {"amount": 1}, "k", {})
    assert lost.status_code == 503, lost.content
    assert not Charge.objects.exists() and not IdempotencyRecord.objects.exists()
    retry = _send("/api-view/optimistic", {"amount": 1}, "k", {})
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 1
