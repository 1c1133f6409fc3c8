"""adrf's async DRF views through Django's ASGI handler (AsyncClient): the behaviour table.

Each request runs in a ``ThreadSensitiveContext`` of its own, as Django's
``ASGIHandler`` runs every request it serves (the AsyncClient opens none):
its sync work, the claim among it, gets a thread and a database connection
of its own, so two requests can really be in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core.exceptions import SynchronousOnlyOperation
from django.core.handlers.asgi import ASGIHandler
from django.db import connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created
from django.http import HttpResponse
from django.test import AsyncClient
from django.utils import timezone
from rest_framework.test import APIClient

from django_idempotency import recovery
from django_idempotency.models import IdempotencyRecord
from django_idempotency.testing import (
    SimulatedCrash,
    expire_leases,
    simulate_crash_after_begin_external,
)
from tests.factories import TokenFactory
from tests.testapp import adrf_views
from tests.testapp.models import Charge

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State

#: Every kind of adrf view, each protected; their body steers them (adrf_views.charge).
STEERED = {
    "mixin-apiview": "/adrf/mixin",
    "decorated-method": "/adrf/decorated",
    "api-view": "/adrf/function",
    "decorated-viewset-action": "/adrf/decorated-viewset/",
    "decorated-extra-action": "/adrf/decorated-viewset/refund/",
}
#: adrf's generic view and ModelViewSet with the mixin: their serializer reads the body.
SERIALIZED = {
    "mixin-generic": "/adrf/generic",
    "mixin-modelviewset": "/adrf/viewset/",
}
EVERY_KIND = {**STEERED, **SERIALIZED}


def one_writer_at_a_time() -> bool:
    """SQLite: a transaction holds the database's one write lock until it ends."""
    return bool(connection.vendor == "sqlite")


async def send(
    url: str,
    body: dict[str, Any],
    key: str | None,
    *,
    client: AsyncClient | None = None,
    headers: dict[str, str] | None = None,
) -> HttpResponse:
    """POST ``body`` as JSON in a request context of its own, as Django's ASGIHandler would."""
    headers = dict(headers or {})
    if key is not None:
        headers["Idempotency-Key"] = key
    async with ThreadSensitiveContext():
        try:
            response = await (client or AsyncClient()).post(
                url, json.dumps(body), content_type="application/json", headers=headers
            )
        finally:
            # The request's thread ends with its context: its connection with it.
            await sync_to_async(connections.close_all)()
    assert isinstance(response, HttpResponse), response
    return response


# Database access from the test itself runs in asgiref's sync thread; its
# connection is closed each time, or PostgreSQL refuses to drop the test
# database at the end while that thread still holds a session.
def in_a_thread(function: Callable[[], Any]) -> Any:
    def run() -> Any:
        try:
            return function()
        finally:
            connections.close_all()

    return sync_to_async(run)()


async def charges() -> int:
    return int(await in_a_thread(Charge.objects.count))


async def records() -> list[dict[str, Any]]:
    fields = ("key", "state", "fencing_token", "response_status")
    return list(await in_a_thread(lambda: list(IdempotencyRecord.objects.values(*fields))))


def refusal_code(response: HttpResponse) -> Any:
    return json.loads(response.content)["code"]


def assert_replay_of(replay: HttpResponse, original: HttpResponse) -> None:
    assert replay["Idempotent-Replayed"] == "true"
    assert (replay.status_code, replay.content) == (original.status_code, original.content)
    for header in ("Content-Type", "Location", "Idempotency-Key"):
        assert replay.get(header) == original.get(header), header


@dataclass(frozen=True)
class Statement:
    thread: int
    sql: str

    @property
    def kind(self) -> str:
        """``INSERT django_idempotency_record``, ``BEGIN``: the statement without its values."""
        match = re.match(r'\s*(\w+)(?:.*?\b(?:INTO|FROM)\s+["`]?(\w+))?', self.sql, re.S)
        assert match is not None, self.sql
        verb = match.group(1).upper()
        if verb == "UPDATE":
            table = re.match(r'\s*UPDATE\s+["`]?(\w+)', self.sql, re.I)
            return f"UPDATE {table.group(1) if table else ''}"
        return f"{verb} {match.group(2) or ''}".strip()


@contextmanager
def statements_recorded() -> Iterator[list[Statement]]:
    """Every statement sent meanwhile, with the thread that sent it, on any connection.

    Each request's thread opens a connection of its own (``send``); the
    test thread's connection, open already, is recorded too (the sync path).
    """
    log: list[Statement] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        log.append(Statement(threading.get_ident(), sql))
        return execute(sql, params, many, context)

    def wrap(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
        if record not in connection.execute_wrappers:  # the test thread's, reconnecting
            connection.execute_wrappers.append(record)

    connection_created.connect(wrap)
    connection.execute_wrappers.append(record)
    try:
        yield log
    finally:
        connection.execute_wrappers.remove(record)
        connection_created.disconnect(wrap)


# --- The behaviour table, on every kind of view ------------------------------


@pytest.mark.parametrize("url", EVERY_KIND.values(), ids=EVERY_KIND.keys())
async def test_first_execution_replay_and_refusals(url: str) -> None:
    body = {"amount": 7, "note": "table"}
    first = await send(url, body, "k")
    retry = await send(url, body, "k")
    reused = await send(url, {**body, "amount": 8}, "k")
    missing = await send(url, body, None)
    invalid = await send(url, body, "two words")

    assert first.status_code == 201 and first["Idempotency-Key"] == "k"
    assert "Idempotent-Replayed" not in first
    assert_replay_of(retry, first)
    assert (reused.status_code, refusal_code(reused)) == (422, "idempotency_key_reused")
    assert (missing.status_code, refusal_code(missing)) == (400, "idempotency_key_missing")
    assert (invalid.status_code, refusal_code(invalid)) == (400, "idempotency_key_invalid")
    assert await charges() == 1
    assert [(r["key"], r["state"]) for r in await records()] == [("k", State.COMPLETED)]


@pytest.mark.parametrize("url", STEERED.values(), ids=STEERED.keys())
@pytest.mark.parametrize("status", [500, 503, 409, 429])
async def test_a_retryable_answer_releases_the_claim_and_rolls_the_writes_back(
    url: str, status: int
) -> None:
    first = await send(url, {"amount": 1, "status": status}, "k")
    retry = await send(url, {"amount": 1, "status": status}, "k")

    assert first.status_code == retry.status_code == status
    assert "Idempotent-Replayed" not in retry
    assert await charges() == 0 and await records() == []


@pytest.mark.parametrize("url", STEERED.values(), ids=STEERED.keys())
async def test_a_raising_view_releases_the_claim_and_the_retry_runs(url: str) -> None:
    client = AsyncClient(raise_request_exception=False)
    failed = await send(url, {"amount": 1}, "k", client=client, headers={"X-Raise": "1"})

    assert failed.status_code == 500
    assert await charges() == 0 and await records() == []
    retry = await send(url, {"amount": 1}, "k")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert await charges() == 1


@pytest.mark.parametrize("url", STEERED.values(), ids=STEERED.keys())
async def test_another_4xx_is_stored_with_the_views_writes_and_replayed(url: str) -> None:
    first = await send(url, {"amount": 1, "status": 404}, "k")
    retry = await send(url, {"amount": 1, "status": 404}, "k")

    assert_replay_of(retry, first)
    assert await charges() == 1
    assert [r["state"] for r in await records()] == [State.FAILED]


@pytest.mark.parametrize("url", STEERED.values(), ids=STEERED.keys())
async def test_refused_input_is_not_stored_and_the_corrected_body_runs(url: str) -> None:
    refused = await send(url, {"amount": 1, "invalid": True}, "k")
    corrected = await send(url, {"amount": 1}, "k")

    assert refused.status_code == 400
    assert json.loads(refused.content) == {"amount": ["This amount is not accepted."]}
    assert corrected.status_code == 201 and "Idempotent-Replayed" not in corrected


@pytest.mark.parametrize("url", SERIALIZED.values(), ids=SERIALIZED.keys())
async def test_a_serializers_validation_error_is_not_stored(url: str) -> None:
    refused = await send(url, {"amount": "not a number"}, "k")
    corrected = await send(url, {"amount": 1}, "k")

    assert refused.status_code == 400 and "amount" in json.loads(refused.content)
    assert corrected.status_code == 201
    assert await charges() == 1


async def test_safe_methods_are_never_protected() -> None:
    async with ThreadSensitiveContext():
        response = await AsyncClient().get("/adrf/mixin", headers={"Idempotency-Key": "k"})
        await sync_to_async(connections.close_all)()

    assert response.status_code == 200 and "Idempotency-Key" not in response
    assert await records() == []


# --- Concurrent duplicates ---------------------------------------------------


@pytest.mark.parametrize("url", STEERED.values(), ids=STEERED.keys())
async def test_a_concurrent_duplicate_never_runs_the_view_a_second_time(url: str) -> None:
    """Two real requests in flight at once: the first holds its claim, in its view.

    PostgreSQL and MariaDB answer the duplicate 409 at once. SQLite has one
    writer at a time: the first request's transaction holds it, so the
    duplicate's claim waits for its commit and answers with its replay.
    """
    hold = adrf_views.holds[url] = adrf_views.Hold()
    body = {"amount": 1, "hold": url}
    with statements_recorded() as sent:
        first = asyncio.ensure_future(send(url, body, "k"))
        await asyncio.wait_for(hold.entered.wait(), timeout=30)
        first_threads = {statement.thread for statement in sent}
        duplicate = asyncio.ensure_future(send(url, body, "k"))
        if not one_writer_at_a_time():
            refused = await asyncio.wait_for(duplicate, timeout=30)
            hold.released.set()
            original = await asyncio.wait_for(first, timeout=30)

            assert (refused.status_code, refusal_code(refused)) == (
                409,
                "idempotency_request_in_progress",
            )
            assert int(refused["Retry-After"]) >= 1
        else:
            # Released once the duplicate's claim was sent (it waits on the writer).
            async def duplicate_claiming() -> None:
                while not {statement.thread for statement in sent} - first_threads:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(duplicate_claiming(), timeout=30)
            hold.released.set()
            original, replay = await asyncio.wait_for(asyncio.gather(first, duplicate), 30)

            assert_replay_of(replay, original)
    del adrf_views.holds[url]

    assert original.status_code == 201
    assert await charges() == 1


# --- Permissions, refused before any claim -----------------------------------

REFUSING = {
    "mixin": "/adrf/authenticated-mixin",
    "decorated": "/adrf/authenticated-decorated",
}


@pytest.mark.parametrize("url", REFUSING.values(), ids=REFUSING.keys())
async def test_a_request_an_async_permission_refuses_claims_nothing(url: str) -> None:
    with statements_recorded() as sent:
        refused = await send(url, {"amount": 1}, "k")

    assert refused.status_code == 401
    assert not [s for s in sent if "django_idempotency" in s.sql]
    assert await records() == [] and await charges() == 0


@pytest.mark.parametrize("url", REFUSING.values(), ids=REFUSING.keys())
async def test_a_permitted_caller_is_protected_under_its_own_tenant(url: str) -> None:
    token = await in_a_thread(TokenFactory.create)
    authorization = {"Authorization": f"Token {token.key}"}

    first = await send(url, {"amount": 1}, "k", headers=authorization)
    retry = await send(url, {"amount": 1}, "k", headers=authorization)

    assert first.status_code == 201
    assert_replay_of(retry, first)
    tenants = await in_a_thread(lambda: list(IdempotencyRecord.objects.values_list("tenant")))
    assert tenants == [(f"user:{token.user.pk}",)]


@pytest.mark.parametrize(
    "url", ["/adrf/first-charge-mixin", "/adrf/first-charge-decorated"], ids=["mixin", "decorated"]
)
async def test_a_retry_its_own_first_run_makes_a_permission_refuse_gets_the_replay(
    url: str,
) -> None:
    """docs/security.md's narrow path, looked up in adrf's initial(), off the event loop."""
    token = await in_a_thread(TokenFactory.create)
    authorization = {"Authorization": f"Token {token.key}"}

    first = await send(url, {"amount": 1}, "k", headers=authorization)
    retry = await send(url, {"amount": 1}, "k", headers=authorization)
    another = await send(url, {"amount": 1}, "another-key", headers=authorization)

    assert first.status_code == 201
    assert_replay_of(retry, first)
    assert another.status_code == 403
    assert await charges() == 1


# --- Crashes -----------------------------------------------------------------


@pytest.mark.parametrize("url", STEERED.values(), ids=STEERED.keys())
async def test_a_crashed_requests_claim_is_taken_over_once_its_lease_ran_out(url: str) -> None:
    with pytest.raises(SimulatedCrash):
        await send(url, {"amount": 1}, "k", headers={"X-Crash": "1"})

    assert [r["state"] for r in await records()] == [State.CLAIMED]
    assert await charges() == 0  # its writes died with it
    held = await send(url, {"amount": 1}, "k")
    assert (held.status_code, refusal_code(held)) == (409, "idempotency_request_in_progress")

    assert await in_a_thread(expire_leases) == 1
    taken_over = await send(url, {"amount": 1}, "k")

    assert taken_over.status_code == 201 and "Idempotent-Replayed" not in taken_over
    assert await charges() == 1
    assert [(r["state"], r["fencing_token"]) for r in await records()] == [(State.COMPLETED, 2)]


async def disconnect_mid_view(url: str, body: dict[str, Any], key: str) -> list[Mapping[str, Any]]:
    """POST through Django's own ASGI handler; the client goes away while the view is held.

    Django cancels the view's task (``asyncio.CancelledError`` at its
    ``await``), as under uvicorn when the connection drops. What the
    handler sent (nothing, or Django's answer to nobody) is returned.
    """
    hold = adrf_views.holds[url] = adrf_views.Hold()
    payload = json.dumps({**body, "hold": url}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": url,
        "raw_path": url.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"idempotency-key", key.encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await hold.entered.wait()  # the view wrote, and waits for a release that never comes
        return {"type": "http.disconnect"}

    sent: list[Mapping[str, Any]] = []

    async def send_message(message: Mapping[str, Any]) -> None:
        sent.append(message)

    try:
        await asyncio.wait_for(ASGIHandler()(scope, receive, send_message), timeout=30)
    finally:
        del adrf_views.holds[url]
    return sent


@pytest.mark.parametrize("url", STEERED.values(), ids=STEERED.keys())
async def test_a_client_gone_mid_view_rolls_its_writes_back_and_frees_the_key(url: str) -> None:
    """No record is left held for a lease by a request nobody waits for: its retry runs."""
    await disconnect_mid_view(url, {"amount": 1}, "k")

    assert await charges() == 0
    assert await records() == []
    retry = await send(url, {"amount": 1}, "k")
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert await charges() == 1


@pytest.mark.postgres
async def test_a_client_gone_after_the_external_call_began_leaves_the_record_uncertain() -> None:
    """The provider may have been called: the record is the reconciler's, never released."""
    await disconnect_mid_view("/adrf/mixin", {"amount": 1, "external": True}, "k")

    record = await in_a_thread(lambda: IdempotencyRecord.objects.get())
    assert record.state == State.UNCERTAIN and record.provider_key
    assert await charges() == 0
    same = {"amount": 1, "external": True, "hold": "/adrf/mixin"}
    retry = await send("/adrf/mixin", same, "k")
    assert (retry.status_code, refusal_code(retry)) == (503, "idempotency_outcome_uncertain")


@pytest.fixture
def reconciled() -> Iterator[list[str]]:
    seen: list[str] = []

    @recovery.register_reconciler("POST adrf/mixin")
    def settle(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        seen.append(record.provider_key)
        return recovery.Completed(status=201, body={"reconciled": True})

    yield seen
    del recovery._reconcilers["POST adrf/mixin"]


@pytest.mark.postgres
async def test_a_crash_after_begin_external_is_settled_by_recovery(
    reconciled: list[str],
) -> None:
    """The intent committed from an async view (``abegin_external``), then the worker "died"."""
    with simulate_crash_after_begin_external(), pytest.raises(SimulatedCrash):
        await send("/adrf/mixin", {"amount": 1, "external": True}, "k")

    record = await in_a_thread(lambda: IdempotencyRecord.objects.get())
    assert record.state == State.IN_PROGRESS and record.provider_key
    assert await charges() == 0
    assert (await send("/adrf/mixin", {"amount": 1, "external": True}, "k")).status_code == 409

    assert await in_a_thread(expire_leases) == 1
    report = await in_a_thread(recovery.recover_stale_records)
    replay = await send("/adrf/mixin", {"amount": 1, "external": True}, "k")

    assert report.completed == 1 and reconciled == [record.provider_key]
    assert replay.status_code == 201 and json.loads(replay.content) == {"reconciled": True}
    assert replay["Idempotent-Replayed"] == "true"


# --- Where the queries run, and how many -------------------------------------


def test_djangos_guard_against_queries_on_the_event_loop_is_on() -> None:
    """What the next test relies on: a query on the loop's thread raises, never runs."""
    assert "DJANGO_ALLOW_ASYNC_UNSAFE" not in os.environ

    async def query_on_the_loop() -> None:
        IdempotencyRecord.objects.count()

    with pytest.raises(SynchronousOnlyOperation):
        asyncio.run(query_on_the_loop())


@pytest.mark.parametrize("url", EVERY_KIND.values(), ids=EVERY_KIND.keys())
async def test_no_query_runs_on_the_event_loop_and_each_request_keeps_one_connection(
    url: str,
) -> None:
    loop_thread = threading.get_ident()
    requests = [
        ({"amount": 1}, "k"),  # first execution
        ({"amount": 1}, "k"),  # replay
        ({"amount": 2}, "k"),  # 422
        ({"amount": 1}, None),  # 400
    ]
    per_request: list[set[int]] = []
    for body, key in requests:
        with statements_recorded() as sent:
            await send(url, body, key)
        per_request.append({statement.thread for statement in sent})

    assert all(loop_thread not in threads for threads in per_request)
    # The claim, the view's writes and the completion: one thread, one connection.
    assert [len(threads) for threads in per_request[:3]] == [1, 1, 1]


@pytest.mark.parametrize(
    ("arrange", "body", "status"),
    [
        (None, {"amount": 1}, 201),  # first execution
        ("first", {"amount": 1}, 201),  # replay
        ("first", {"amount": 2}, 422),  # another body, same key
        ("in flight", {"amount": 1}, 409),  # the first still running
    ],
    ids=["first-execution", "replay", "mismatch", "in-flight"],
)
async def test_each_answer_costs_the_statements_the_sync_mixin_view_sends(
    arrange: str | None, body: dict[str, int], status: int
) -> None:
    """adrf's ListCreateAPIView against DRF's, each with the mixin and one serializer."""

    def sync_statements() -> tuple[int, list[str]]:
        # Connected first: a new connection's own set-up (MariaDB's SET) is
        # no part of a request, and the async requests' is not recorded.
        connection.ensure_connection()
        api = APIClient()
        if arrange is not None:
            api.post("/mixin/charges", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="k")
        if arrange == "in flight":
            IdempotencyRecord.objects.update(state=State.CLAIMED)
        with statements_recorded() as sent:
            response = api.post("/mixin/charges", body, format="json", HTTP_IDEMPOTENCY_KEY="k")
        IdempotencyRecord.objects.all().delete()
        Charge.objects.all().delete()
        return response.status_code, [statement.kind for statement in sent]

    sync_status, sync_kinds = await in_a_thread(sync_statements)
    if arrange is not None:
        await send("/adrf/generic", {"amount": 1}, "k")
    if arrange == "in flight":
        await in_a_thread(lambda: IdempotencyRecord.objects.update(state=State.CLAIMED))
    with statements_recorded() as sent:
        response = await send("/adrf/generic", body, "k")

    assert sync_status == response.status_code == status
    assert _past_connection_set_up([statement.kind for statement in sent]) == sync_kinds


def _past_connection_set_up(kinds: list[str]) -> list[str]:
    """The request's statements, without the set-up of the connection it opened.

    Under ASGI each request runs in a thread of its own, with a connection
    of its own: on MySQL/MariaDB Django opens it with statements of its own
    (Django 6.0 reads the server's settings and SETs the session's), before
    the request's first.
    """
    while kinds and kinds[0] in ("SELECT", "SET"):
        kinds = kinds[1:]
    return kinds


async def test_a_record_past_its_expiry_is_a_new_operation() -> None:
    await send("/adrf/mixin", {"amount": 1}, "k")
    expired = timezone.now() - timedelta(seconds=1)
    await in_a_thread(lambda: IdempotencyRecord.objects.update(expires_at=expired))

    again = await send("/adrf/mixin", {"amount": 1}, "k")

    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert await charges() == 2
