"""The optimistic mode's concurrent duplicates, each on its own connection.

The promise (SPEC "Contract additions", docs/transactions.md "Optimistic
mode"): concurrent duplicates may each run the view body; exactly one
commits; every other one rolls back and answers with the winner's replay
(or 422; 409 only when it gave up waiting: its record's INSERT waited
IN_FLIGHT_WAIT on a record not committed yet): never the domain error it met, never an outage.
Each test asserts that promise; a failure is a finding.
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
from django.db import connection, connections, transaction
from django.db.models import F
from django.test import Client, override_settings

from django_idempotency import signals
from django_idempotency.models import IdempotencyRecord
from tests.sessions import key_held_by_an_open_transaction
from tests.testapp.models import Charge, Order
from tests.utils import TokenClient, post, raw_body, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State


def _send(url: str, body: dict[str, Any], key: str, headers: dict[str, str]) -> Any:
    client = Client(raise_request_exception=False)
    return client.post(
        url, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=key, headers=headers
    )


def _concurrently(
    calls: list[tuple[str, dict[str, Any], str, dict[str, str], float]],
) -> list[Any]:
    """(url, body, key, headers, delay): each from its own thread and connection."""
    responses: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def send(index: int) -> None:
        url, body, key, headers, delay = calls[index]
        try:
            barrier.wait()
            time.sleep(delay)
            responses[index] = _send(url, body, key, headers)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return responses


def _described(responses: list[Any]) -> list[tuple[int, bytes, str]]:
    return [(r.status_code, r.content, r.get("Idempotent-Replayed", "")) for r in responses]


def _one_winner_the_rest_replay(
    responses: list[Any], *, charges: int = 1, may_give_up: bool = False
) -> None:
    """One first execution; the others replay it (or, ``may_give_up``, 409 after giving up)."""
    described = _described(responses)
    answered = [r for r in responses if r.status_code == 201]
    gave_up = [r for r in responses if r.status_code != 201]
    if may_give_up:
        assert len(answered) >= 2, described  # the winner, and at least one replay
        for response in gave_up:
            assert response.status_code == 409, described
            assert response.json()["code"] == "idempotency_request_in_progress", described
    else:
        assert not gave_up, described
    firsts = [r for r in answered if "Idempotent-Replayed" not in r]
    assert len(firsts) == 1, described
    assert all(r.content == firsts[0].content for r in answered), described
    assert Charge.objects.count() == charges


@pytest.fixture(
    params=[
        "read committed",
        "repeatable read",
        "serializable",
    ]
)
def isolation(request: Any) -> Iterator[str]:
    """Every connection opened meanwhile runs at this level (its OPTIONS changed in place)."""
    level = str(request.param)
    vendor = connection.vendor
    if vendor == "sqlite":
        if level != "read committed":
            pytest.skip("SQLite has one level")
        yield level
        return
    options = connection.settings_dict.setdefault("OPTIONS", {})
    before = dict(options)
    if vendor == "postgresql":
        from psycopg import IsolationLevel

        options["isolation_level"] = IsolationLevel[level.upper().replace(" ", "_")]
    else:
        options["isolation_level"] = level
    connections.close_all()
    try:
        # The level took: read back from the server, in a transaction (psycopg
        # names the level in its BEGIN).
        with transaction.atomic(), connection.cursor() as cursor:
            if vendor == "postgresql":
                cursor.execute("SHOW transaction_isolation")
            else:
                cursor.execute("SELECT @@tx_isolation")
            assert cursor.fetchone()[0].replace("-", " ").lower() == level
        yield level
    finally:
        options.clear()
        options.update(before)
        connections.close_all()


# -- isolation levels: the existing race shapes, above READ COMMITTED ----------------


def test_losers_at_the_records_insert_replay_under_every_isolation(isolation: str) -> None:
    body = {"amount": 1, "hold": 0.3}
    url = "/api-view/optimistic"
    responses = _concurrently([(url, body, "race", {}, 0.0)] * 4)
    _one_winner_the_rest_replay(responses)
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


def test_losers_on_a_business_key_replay_under_every_isolation(isolation: str) -> None:
    body = {"amount": 1, "order": "A-1", "hold": 0.3}
    url = "/api-view/optimistic"
    responses = _concurrently([(url, body, "race", {}, 0.0)] * 4)
    _one_winner_the_rest_replay(responses)
    assert Order.objects.count() == 1


def test_get_or_create_losers_replay_under_every_isolation(isolation: str) -> None:
    """``get_or_create`` on the business key: the loser's get() may not see the winner's row."""
    body = {"amount": 1, "order": "A-1", "hold": 0.3}
    responses = _concurrently([("/optimistic-duplicates/get-or-create", body, "race", {}, 0.0)] * 3)
    _one_winner_the_rest_replay(responses)
    assert Order.objects.count() == 1


def test_an_expired_record_replaced_by_concurrent_duplicates(isolation: str) -> None:
    """Two or more requests replacing one expired record: one runs to the end, the rest replay."""
    url = "/api-view/optimistic"
    assert _send(url, {"amount": 1}, "k", {}).status_code == 201
    IdempotencyRecord.objects.update(expires_at=F("created_at") - timedelta(days=1))
    responses = _concurrently([(url, {"amount": 1, "hold": 0.3}, "k", {}, 0.0)] * 3)
    # On MariaDB under SERIALIZABLE the duplicates' lookups share locks on
    # the key's gap and deadlock again and again while the winner runs; on
    # a loaded machine (CI: two test passes on two cores) one may run out of
    # its attempts and answer 409, as SPEC allows a duplicate that gave up
    # waiting. Never a second charge, never another body.
    serializable_mariadb = isolation == "serializable" and connection.vendor == "mysql"
    _one_winner_the_rest_replay(responses, charges=2, may_give_up=serializable_mariadb)
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


# -- losers that fail in other ways -----------------------------------------------------


@pytest.mark.parametrize("in_flight", ["conflict", "wait"])
def test_deadlocked_duplicates_answer_the_winners_replay(in_flight: str) -> None:
    """Two duplicates write two business rows in opposite orders: the deadlock's victim replays.

    docs/transactions.md lists a deadlock among the failures a loser
    answers with the winner's replay; 409 only when it gave up waiting before
    the winner committed, which is not what happened here. With
    IN_FLIGHT "wait" a duplicate is promised a wait for the outcome, too.
    """
    body = {"amount": 1, "ref": "R", "hold": 0.5}
    url = "/optimistic-duplicates/two-rows"
    with override_settings(IDEMPOTENCY={"IN_FLIGHT": in_flight}):
        responses = _concurrently(
            [(url, body, "race", {"X-First": "a"}, 0.0), (url, body, "race", {"X-First": "b"}, 0.0)]
        )
    _one_winner_the_rest_replay(responses)
    assert Order.objects.count() == 2


def test_a_loser_judged_uncertain_by_its_policy_replays_the_winner() -> None:
    """The loser's view meets the winner's order and answers 504, which its policy calls uncertain.

    Its writes rolled back, the winner committed: the loser must answer the
    winner's replay, not its own 504, and the record must stay the winner's.
    """
    body = {"amount": 1, "order": "A-1", "hold": 0.5}
    url = "/optimistic-duplicates/uncertain"
    responses = _concurrently([(url, body, "race", {}, 0.0), (url, body, "race", {}, 0.1)])
    _one_winner_the_rest_replay(responses)
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


def test_a_loser_raising_its_own_exception_replays_the_winner() -> None:
    body = {"amount": 1, "order": "A-1", "hold": 0.3}
    responses = _concurrently([("/optimistic-duplicates/own-error", body, "race", {}, 0.0)] * 3)
    _one_winner_the_rest_replay(responses)


def test_async_view_duplicates_replay_the_winner() -> None:
    body = {"amount": 1, "order": "A-1"}
    responses = _concurrently([("/optimistic-duplicates/async", body, "race", {}, 0.0)] * 3)
    _one_winner_the_rest_replay(responses)


def test_a_deploy_switching_modes_commits_once() -> None:
    """The same operation served by a default-mode and an optimistic-mode process at once."""
    body = {"amount": 1, "hold": 0.5}
    responses = _concurrently(
        [
            ("/optimistic-duplicates/shared-default", body, "race", {}, 0.0),
            ("/optimistic-duplicates/shared-optimistic", body, "race", {}, 0.1),
            ("/optimistic-duplicates/shared-optimistic", body, "race", {}, 0.0),
        ]
    )
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {201, 409}, _described(responses)
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


# -- lock waits of requests that are not duplicates ------------------------------------


@pytest.mark.parametrize("mode", ["default", "optimistic"])
def test_a_different_key_waiting_on_a_hot_account_row_is_served(mode: str) -> None:
    """Neither mode sets a lock_timeout on the view's statements: the second transfer waits, runs.

    (Until the optimistic lookup ran in autocommit, its transaction-local
    lock_timeout, IN_FLIGHT_WAIT, cut every lock wait of the view's
    transaction: the second transfer was told 409 to retry.)
    """
    suffix = "-default" if mode == "default" else ""
    responses = _hot_account_transfers(f"/optimistic-duplicates/lock-account{suffix}")
    assert [r.status_code for r in responses] == [201, 201], _described(responses)
    assert Order.objects.get(number="acct").amount == 3


def _hot_account_transfers(url: str) -> list[Any]:
    """Two transfers (different keys) on one account row; the second waits for the first's lock.

    The first holds the row for 0.6 s, three times IN_FLIGHT_WAIT.
    """
    if connection.vendor != "postgresql":
        pytest.skip("IN_FLIGHT_WAIT bounds waits with a lock_timeout on PostgreSQL")
    Order.objects.create(number="acct", amount=0)
    wait = timedelta(milliseconds=200)
    with override_settings(IDEMPOTENCY={"IN_FLIGHT": "conflict", "IN_FLIGHT_WAIT": wait}):
        return _concurrently(
            [
                (url, {"account": "acct", "amount": 1, "hold": 0.6}, "first", {}, 0.0),
                (url, {"account": "acct", "amount": 2, "hold": 0.0}, "second", {}, 0.2),
            ]
        )


def test_an_uncertain_deadlock_victim_does_not_take_the_key_from_the_winner() -> None:
    """The victim of a deadlock answers 504, which its policy calls uncertain, at once.

    Its writes rolled back, nothing of it remains. The other duplicate goes
    on and must be the one that commits (exactly one commits); instead the
    victim's ``leave_uncertain_afresh`` claims the key first, and the
    winner's INSERT then loses to a record whose work never happened.
    """
    body = {"amount": 1, "ref": "R", "hold": 0.5, "hold_after": 0.5}
    url = "/optimistic-duplicates/two-rows-uncertain"
    responses = _concurrently(
        [(url, body, "race", {"X-First": "a"}, 0.0), (url, body, "race", {"X-First": "b"}, 0.0)]
    )
    assert Charge.objects.count() == 1, _described(responses)
    assert IdempotencyRecord.objects.get().state == State.COMPLETED
    assert 201 in [r.status_code for r in responses], _described(responses)


# The optimistic mode's signals, a second database, sealing, a lost session.
#
# Each test asserts what docs/transactions.md "Optimistic mode" promises; a
# failure is a finding.


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
    responses = _concurrently([("/optimistic-duplicates/second-alias", body, "k", {}, 0)] * 3)
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
    lost = _send(
        "/optimistic-duplicates/loses-connection", {"amount": 1, "terminate": True}, "k", {}
    )
    connections.close_all()
    assert lost.status_code == 503, lost.content
    assert not Charge.objects.exists() and not IdempotencyRecord.objects.exists()
    retry = _send("/optimistic-duplicates/loses-connection", {"amount": 1}, "k", {})
    assert retry.status_code == 201 and Charge.objects.count() == 1


def test_a_loser_that_gave_up_leaves_no_lock_timeout_on_its_connection() -> None:
    """It gave up at its record's INSERT, on a duplicate's record that never committed."""
    if connection.vendor != "postgresql":
        pytest.skip("the statement's lock_timeout is PostgreSQL's")
    body = {"amount": 1}
    with (
        override_settings(IDEMPOTENCY={"IN_FLIGHT_WAIT": timedelta(milliseconds=200)}),
        key_held_by_an_open_transaction("POST api-view/optimistic"),
    ):
        loser = _send("/api-view/optimistic", body, "k", {})
        with connection.cursor() as cursor:  # the same connection, reused as a pool would
            cursor.execute("SHOW lock_timeout")
            after = cursor.fetchone()[0]
    assert loser.status_code == 409, loser.content
    assert after == "0"


# -- a duplicate committing between the lookup and the transaction ----------------------


def test_a_duplicate_committing_right_after_the_lookup_is_replayed(isolation: str) -> None:
    """The lookup, in autocommit, found nothing; a duplicate then ran and committed.

    This request's view runs all the same, its record's INSERT finds the
    key taken, everything it wrote rolls back, and it answers with the
    winner's replay: one charge, one record.
    """
    url, body = "/api-view/optimistic", {"amount": 1}
    winner: list[Any] = []

    def run_the_duplicate() -> None:
        try:
            winner.append(_send(url, body, "race", {}))
        finally:
            connections.close_all()

    def after_the_lookup(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        result = execute(sql, params, many, context)
        if not winner and sql.startswith("SELECT") and "django_idempotency_record" in sql:
            thread = threading.Thread(target=run_the_duplicate)  # its own connection
            thread.start()
            thread.join(timeout=60)
        return result

    with connection.execute_wrapper(after_the_lookup):
        late = _send(url, body, "race", {})
    assert winner and winner[0].status_code == 201, _described(winner)
    assert "Idempotent-Replayed" not in winner[0]
    assert late.status_code == 201 and late["Idempotent-Replayed"] == "true", _described([late])
    assert late.content == winner[0].content
    assert Charge.objects.count() == 1
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


@contextlib.contextmanager
def _commit_kills_the_session() -> Iterator[None]:
    """A deferred constraint trigger on charges that terminates its own session at COMMIT."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION die_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$ "
            "BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NULL; END $$"
        )
        cursor.execute(
            "CREATE CONSTRAINT TRIGGER die_at_commit AFTER INSERT ON testapp_charge "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION die_at_commit()"
        )
    try:
        yield
    finally:
        connections.close_all()
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS die_at_commit ON testapp_charge")
            cursor.execute("DROP FUNCTION IF EXISTS die_at_commit()")


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
