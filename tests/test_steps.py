"""Several external calls in one operation: steps, their recovery, and RetryFrom.

``begin_external(step=...)`` commits each step's intent (its row, with a
provider key of its own) before its call; a failure after a step leaves
the record UNCERTAIN with every step it began, even where the intents
joined the view's transaction and rolled back with it (SQLite); a
reconciler sees the steps and may hand the operation back to the client's
retry from one step, which then skips the kept steps.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.db.models import F
from django.http import HttpRequest, JsonResponse
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import path
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from rest_framework.test import APIClient

from django_idempotency import _store as store
from django_idempotency import idempotent, recovery
from django_idempotency.context import IdempotencyContext, derive_provider_key
from django_idempotency.exceptions import StaleOwner
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from django_idempotency.recovery import (
    Completed,
    Failed,
    Release,
    RetryFrom,
    recover_stale_records,
)
from django_idempotency.scope import Scope
from django_idempotency.testing import expire_leases
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.guarantees,
    pytest.mark.not_under(
        "repeatable-read",
        reason="begin_external() is refused above READ COMMITTED on PostgreSQL "
        "(IsolationNotSupported; tests/test_isolation.py)",
        databases=("postgres",),
    ),
    pytest.mark.not_under(
        "atomic-requests",
        reason="a non-exempt @api_view claims inside the request transaction (W002): an "
        "exception rolls the intent back with it (docs/guarantees.md)",
    ),
]
URL = "/api-view/steps"
OPERATION = "POST api-view/steps"
State = IdempotencyRecord.State
AUTHORIZE_THEN_CAPTURE = [
    {"name": "authorize", "provider_id": "au_1"},
    {"name": "capture"},
]


def steered(api: APIClient, key: str, **steps: Any) -> Any:
    """POST the same input (``{"amount": 1}``), steered by the X-Steps header."""
    return post(api, URL, {"amount": 1}, key, HTTP_X_STEPS=json.dumps(steps))


def step_key(key: str, name: str) -> str:
    return derive_provider_key(Scope("anonymous", OPERATION, key), step=name)


def stored_steps(record: IdempotencyRecord) -> list[tuple[str, str, str]]:
    steps = IdempotencyStep.objects.filter(record=record).order_by("begun_at", "pk")
    return list(steps.values_list("name", "provider_key", "provider_operation_id"))


@pytest.fixture
def reconcile() -> Iterator[Callable[[Callable[[IdempotencyRecord], Any]], list[Any]]]:
    """Register the steps view's reconciler; what it saw of each record's steps."""
    seen: list[Any] = []

    def register(decide: Callable[[IdempotencyRecord], Any]) -> list[Any]:
        @recovery.register_reconciler(OPERATION)
        def reconciler(record: IdempotencyRecord) -> Any:
            seen.append(
                [(s.name, s.provider_key, s.provider_operation_id) for s in record.steps.all()]
            )
            return decide(record)

        return seen

    yield register
    recovery._reconcilers.pop(OPERATION, None)


# -- the view's side ----------------------------------------------------------------------


def test_each_step_commits_its_row_with_a_key_of_its_own(api: APIClient) -> None:
    steps = [
        {"name": "authorize", "provider_id": "au_1"},
        {"name": "capture", "provider_id": "ca_1"},
    ]
    body = post(api, URL, {"amount": 1, "steps": steps}, "k").json()

    record = IdempotencyRecord.objects.get()
    assert record.state == State.COMPLETED
    assert stored_steps(record) == [
        ("authorize", step_key("k", "authorize"), "au_1"),
        ("capture", step_key("k", "capture"), "ca_1"),
    ]
    assert body["keys"] == {
        "authorize": step_key("k", "authorize"),
        "capture": step_key("k", "capture"),
    }
    # The record's own columns are for the one call without a step.
    assert (record.provider_key, record.provider_operation_id) == ("", "")


def test_step_keys_are_keyed_digests_per_step_and_scope() -> None:
    scope = Scope("user:1", OPERATION, "k")
    keys = {
        derive_provider_key(scope),
        derive_provider_key(scope, step="authorize"),
        derive_provider_key(scope, step="capture"),
        derive_provider_key(Scope("user:2", OPERATION, "k"), step="authorize"),
    }
    assert len(keys) == 4
    assert all(len(key) <= 64 and ":" in key for key in keys)
    assert derive_provider_key(scope, step="authorize") == derive_provider_key(
        scope, step="authorize"
    )


@pytest.mark.parametrize("then", ["raise", 502])
def test_a_failure_after_a_step_leaves_every_begun_step_with_the_uncertain_record(
    api: APIClient, then: Any
) -> None:
    """On SQLite the intents rolled back with the view: mark_uncertain writes them again."""
    api.raise_request_exception = False
    response = post(api, URL, {"amount": 1, "steps": AUTHORIZE_THEN_CAPTURE, "then": then}, "k")

    assert response.status_code == (500 if then == "raise" else then)
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.lease_owner, record.provider_key) == (State.UNCERTAIN, "", "")
    assert stored_steps(record) == [
        ("authorize", step_key("k", "authorize"), "au_1"),
        ("capture", step_key("k", "capture"), ""),
    ]
    assert Charge.objects.count() == 0  # the view's own write rolled back


def statements(captured: CaptureQueriesContext) -> list[str]:
    """The SQL statements run (transaction control left out), by their verb."""
    verbs = [query["sql"].split()[0].upper() for query in captured.captured_queries]
    return [verb for verb in verbs if verb in ("SELECT", "INSERT", "UPDATE", "DELETE")]


def held_by_a_context(key: str = "k") -> tuple[IdempotencyRecord, IdempotencyContext]:
    """A CLAIMED record and the context of its owner, outside any request."""
    record = IdempotencyRecord.objects.create(
        tenant="anonymous",
        operation=OPERATION,
        key=key,
        fingerprint="v1:" + "0" * 64,
        state=State.CLAIMED,
        lease_owner="test",
        lease_expires_at=timezone.now() + timedelta(minutes=5),
        created_at=timezone.now(),
        updated_at=timezone.now(),
        expires_at=timezone.now() + timedelta(days=1),
    )
    held = store.Claim(
        record.pk, record.fencing_token, Scope("anonymous", OPERATION, key), "default"
    )
    return record, IdempotencyContext(held)


def test_begin_external_with_a_step_costs_two_statements_and_set_provider_operation_two() -> None:
    """A fresh claim holds no steps: no SELECT; the fenced UPDATE, then the INSERT."""
    record, context = held_by_a_context()
    with CaptureQueriesContext(connection) as begun:
        context.begin_external(step="authorize")
    with CaptureQueriesContext(connection) as recorded:
        context.set_provider_operation("au_1", step="authorize")
    with CaptureQueriesContext(connection) as again:
        context.begin_external(step="authorize")  # the stored row: its key kept

    assert statements(begun) == ["UPDATE", "INSERT"]
    assert statements(recorded) == ["UPDATE", "UPDATE"]
    assert statements(again) == ["UPDATE", "UPDATE"]
    assert stored_steps(record) == [("authorize", step_key("k", "authorize"), "au_1")]
    assert IdempotencyRecord.objects.get().state == State.IN_PROGRESS


def test_a_taken_over_record_reads_its_steps_once_and_only_when_asked() -> None:
    record, context = held_by_a_context()
    context.begin_external(step="authorize")
    IdempotencyStep.objects.update(provider_key="v0:rotated-secret-key")
    IdempotencyRecord.objects.update(fencing_token=F("fencing_token") + 1)
    held = store.Claim(record.pk, record.fencing_token + 1, context.scope, "default")
    taken = IdempotencyContext(held)

    with CaptureQueriesContext(connection) as constructed:
        pass
    assert constructed.captured_queries == []
    with CaptureQueriesContext(connection) as asked:
        known = taken.step("authorize")
        assert taken.step("capture") is None
    assert len(asked.captured_queries) == 1
    assert known is not None and known.provider_key == "v0:rotated-secret-key"
    # Begun again: the stored key, never derived again.
    assert taken.begin_external(step="authorize") == "v0:rotated-secret-key"


def test_a_stale_owner_writes_no_step() -> None:
    _, context = held_by_a_context()
    IdempotencyRecord.objects.update(fencing_token=F("fencing_token") + 1)
    with pytest.raises(StaleOwner):
        context.begin_external(step="authorize")
    assert not IdempotencyStep.objects.exists()


def test_step_names_and_the_order_of_calls_are_checked() -> None:
    _, context = held_by_a_context()
    with pytest.raises(ValueError, match="begin_external"):
        context.set_provider_operation("au_1", step="authorize")
    # A NUL is refused by PostgreSQL's text columns (a DataError mid-view);
    # control characters would garble the admin and the logs.
    for bad in ("", "x" * 65, "auth\x00orize", "capture\n", "\x7f"):
        with pytest.raises(ValueError, match="step"):
            context.begin_external(step=bad)
    assert not IdempotencyStep.objects.exists()


# -- recovery: the reconciler sees the steps; RetryFrom ---------------------------------------


def crashed_between_the_steps(api: APIClient) -> IdempotencyRecord:
    """Authorized (its id recorded), capture begun, then the view failed: UNCERTAIN."""
    api.raise_request_exception = False
    steered(api, "k", steps=AUTHORIZE_THEN_CAPTURE, then="raise")
    expire_leases()
    return IdempotencyRecord.objects.get()


def test_the_reconciler_sees_every_step_in_begin_order(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    seen = reconcile(lambda record: Completed(status=201, body={"ok": True}))
    crashed_between_the_steps(api)

    assert recover_stale_records().completed == 1
    assert seen == [
        [
            ("authorize", step_key("k", "authorize"), "au_1"),
            ("capture", step_key("k", "capture"), ""),
        ]
    ]


def test_retry_from_a_step_keeps_the_earlier_steps_and_the_retry_skips_them(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    reconcile(lambda record: RetryFrom("capture"))
    record = crashed_between_the_steps(api)

    report = recover_stale_records()

    assert (report.handed_back, report.released, report.handled) == (1, 0, 1)
    record.refresh_from_db()
    assert (record.state, record.lease_owner) == (State.CLAIMED, "")
    # The wait is bounded by the record's retention: recovery leaves it alone till then.
    assert record.lease_expires_at == record.expires_at
    assert stored_steps(record) == [("authorize", step_key("k", "authorize"), "au_1")]
    assert recover_stale_records().handled == 0

    steps = [
        {"name": "authorize", "provider_id": "au_2"},
        {"name": "capture", "provider_id": "ca_1"},
    ]
    retry = steered(api, "k", steps=steps)

    assert retry.status_code == 201
    assert retry.json()["skipped"] == ["authorize"]
    assert retry.json()["keys"]["capture"] == step_key("k", "capture")
    record.refresh_from_db()
    assert record.state == State.COMPLETED
    assert stored_steps(record) == [
        ("authorize", step_key("k", "authorize"), "au_1"),  # never re-sent
        ("capture", step_key("k", "capture"), "ca_1"),
    ]
    assert Charge.objects.count() == 1


def test_retry_from_records_the_provider_ids_the_reconciler_found(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    """Killed after the provider answered, before set_provider_operation()."""
    api.raise_request_exception = False
    steps = [{"name": "authorize"}]
    steered(api, "k", steps=steps, then="raise")
    expire_leases()
    reconcile(lambda record: RetryFrom("capture", provider_operation_ids={"authorize": "au_9"}))

    assert recover_stale_records().handed_back == 1

    record = IdempotencyRecord.objects.get()
    assert stored_steps(record) == [("authorize", step_key("k", "authorize"), "au_9")]
    retry = steered(api, "k", steps=[*steps, {"name": "capture"}])
    assert retry.json()["skipped"] == ["authorize"]


def test_retry_from_with_ids_for_a_forgotten_step_is_a_reconciler_error(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    reconcile(lambda record: RetryFrom("authorize", provider_operation_ids={"authorize": "x"}))
    record = crashed_between_the_steps(api)

    report = recover_stale_records()

    assert (report.retried, report.handed_back) == (1, 0)
    record.refresh_from_db()
    assert record.state == State.UNCERTAIN
    assert len(stored_steps(record)) == 2


def test_a_handed_back_record_is_refused_to_another_input(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    reconcile(lambda record: RetryFrom("capture"))
    crashed_between_the_steps(api)
    recover_stale_records()

    other = post(api, URL, {"amount": 2, "steps": AUTHORIZE_THEN_CAPTURE}, "k")

    assert other.status_code == 422
    assert other.json()["code"] == "idempotency_key_reused"
    assert IdempotencyRecord.objects.get().state == State.CLAIMED
    assert len(IdempotencyStep.objects.all()) == 1


def test_a_failed_retry_of_a_handed_back_record_keeps_it_and_its_steps(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    """The owner's release never deletes a record with steps: they called providers."""
    reconcile(lambda record: RetryFrom("capture"))
    crashed_between_the_steps(api)
    recover_stale_records()

    # The retry skips authorize, then answers 503 before beginning capture: a
    # "release" answer, which deletes a plain claim.
    retry = steered(api, "k", steps=[{"name": "authorize"}], then=503)

    assert retry.status_code == 503
    record = IdempotencyRecord.objects.get()
    assert record.state == State.CLAIMED
    assert stored_steps(record) == [("authorize", step_key("k", "authorize"), "au_1")]


def test_a_claimed_record_with_steps_goes_to_the_reconciler_not_to_release(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    """Handed back and never retried within its retention: the reconciler settles it."""
    decisions: list[Any] = [RetryFrom("capture"), RetryFrom("capture"), Failed(status=402)]
    seen = reconcile(lambda record: decisions.pop(0))
    crashed_between_the_steps(api)
    recover_stale_records()
    IdempotencyRecord.objects.update(
        expires_at=timezone.now() - timedelta(seconds=1),
        lease_expires_at=timezone.now() - timedelta(seconds=1),
    )

    # Past its retention a RetryFrom is a Retry: left UNCERTAIN, asked again later.
    assert recover_stale_records().retried == 1
    assert IdempotencyRecord.objects.get().state == State.UNCERTAIN
    expire_leases()
    assert recover_stale_records().failed == 1
    assert len(seen) == 3
    assert IdempotencyRecord.objects.get().state == State.FAILED


def test_release_by_a_reconciler_deletes_the_steps_with_the_record(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    reconcile(lambda record: Release())
    crashed_between_the_steps(api)

    assert recover_stale_records().released == 1
    assert not IdempotencyRecord.objects.exists()
    assert not IdempotencyStep.objects.exists()


# -- item 7: the provider's id on a settled record ------------------------------------------


@pytest.mark.parametrize("outcome", [Completed, Failed])
def test_a_reconcilers_provider_operation_id_is_stored_on_the_record(
    api: APIClient, reconcile: Callable[..., list[Any]], outcome: type[Any]
) -> None:
    reconcile(
        lambda record: outcome(
            status=201 if outcome is Completed else 402, provider_operation_id="ca_7"
        )
    )
    crashed_between_the_steps(api)

    recover_stale_records()

    record = IdempotencyRecord.objects.get()
    assert record.is_resolved
    assert record.provider_operation_id == "ca_7"


def test_without_a_provider_operation_id_the_column_is_left_as_it_is(
    api: APIClient, reconcile: Callable[..., list[Any]]
) -> None:
    reconcile(lambda record: Completed(status=201))
    with CaptureQueriesContext(connection) as settled:
        crashed_between_the_steps(api)
        recover_stale_records()
    assert IdempotencyRecord.objects.get().provider_operation_id == ""
    assert not any("provider_operation_id\" = ''" in q["sql"] for q in settled.captured_queries)


def test_only_the_default_release_keeps_a_record_with_steps() -> None:
    """The owner's (and recovery's) release of a CLAIMED record; an operator's deletes."""
    record, context = held_by_a_context()
    context.begin_external(step="authorize")
    IdempotencyRecord.objects.update(state=State.CLAIMED)
    held = store.Claim(record.pk, record.fencing_token, context.scope, "default")

    assert store.release(held) is False
    assert IdempotencyStep.objects.count() == 1
    assert store.release(held, states=tuple(State.values)) is True
    assert not IdempotencyRecord.objects.exists() and not IdempotencyStep.objects.exists()


# Steps in an ``async def`` view (``abegin_external(step=...)``).
#
# Two steps, the first's provider id recorded, then the view fails: the record
# is UNCERTAIN with both steps, as for a sync view; a clean run completes with
# both steps and their ids.


@csrf_exempt
@idempotent(operation="async-steps")
async def async_two_steps(request: HttpRequest) -> JsonResponse:
    data = json.loads(request.body)
    context = request.idempotency  # type: ignore[attr-defined]
    known = await context.astep("authorize")
    if known is None or not known.provider_operation_id:
        await context.abegin_external(step="authorize")
        await context.aset_provider_operation("au_1", step="authorize")
    await context.abegin_external(step="capture")
    if data.get("fail"):
        raise RuntimeError("the capture's connection dropped")
    await context.aset_provider_operation("ca_1", step="capture")
    return JsonResponse({"steps": [s.name for s in context.steps]}, status=201)


urlpatterns = [path("async-steps", async_two_steps)]


def send(body: dict[str, object], key: str) -> object:
    client = Client(raise_request_exception=False)
    return client.post(
        "/async-steps", json.dumps(body), content_type="application/json", HTTP_IDEMPOTENCY_KEY=key
    )


def steps() -> list[tuple[str, str]]:
    return list(
        IdempotencyStep.objects.order_by("begun_at", "pk").values_list(
            "name", "provider_operation_id"
        )
    )


@override_settings(ROOT_URLCONF=__name__)
def test_an_async_view_completes_with_its_steps() -> None:
    response = send({"amount": 1}, "a-1")

    assert response.status_code == 201, response.content  # type: ignore[attr-defined]
    assert IdempotencyRecord.objects.get().state == State.COMPLETED
    assert steps() == [("authorize", "au_1"), ("capture", "ca_1")]


@override_settings(ROOT_URLCONF=__name__)
def test_an_async_view_failing_between_steps_leaves_both_steps_uncertain() -> None:
    response = send({"amount": 1, "fail": True}, "a-2")

    assert response.status_code == 500  # type: ignore[attr-defined]
    record = IdempotencyRecord.objects.get()
    assert record.state == State.UNCERTAIN
    assert steps() == [("authorize", "au_1"), ("capture", "")]


# A handed-back record (``RetryFrom``) after a retry that gave up.
#
# The client's retry of a handed-back record takes it over, then answers a
# "release" status (503) before beginning any step. The owner's release keeps
# the record (its kept steps called providers) and hands it back again (no
# lease owner, lease until ``expires_at``), as it was before the failed retry
# took it. Left CLAIMED under the failed retry's own lease, the client's next
# retry, which the 503 told to come back, would be refused 409 for the whole
# LEASE, and recovery, not the client, would get it next.


@pytest.fixture
def retry_from_capture() -> Iterator[None]:
    @recovery.register_reconciler(OPERATION)
    def reconciler(record: IdempotencyRecord) -> Any:
        return RetryFrom("capture")

    yield
    recovery._reconcilers.pop(OPERATION, None)


@pytest.mark.usefixtures("retry_from_capture")
def test_a_retry_that_gave_up_hands_the_record_back_again(api: APIClient) -> None:
    api.raise_request_exception = False
    authorize = {"name": "authorize", "provider_id": "au_1"}
    steered(api, "k", steps=[authorize, {"name": "capture"}], then="raise")
    expire_leases()
    assert recover_stale_records().handed_back == 1

    gave_up = steered(api, "k", steps=[{"name": "authorize"}], then=503)
    assert gave_up.status_code == 503

    record = IdempotencyRecord.objects.get()
    again = steered(api, "k", steps=[authorize, {"name": "capture", "provider_id": "ca_1"}])

    assert again.status_code == 201, (again.content, record.state, record.lease_owner)
    assert again.json()["skipped"] == ["authorize"]
    assert Charge.objects.count() == 1


@pytest.mark.postgres
@pytest.mark.usefixtures("retry_from_capture")
def test_retries_of_a_handed_back_record_at_once_capture_once() -> None:
    """Eight retries of the same input race for the handed-back record: one runs it."""
    api = APIClient(raise_request_exception=False)
    authorize = {"name": "authorize", "provider_id": "au_1"}
    steered(api, "k", steps=[authorize, {"name": "capture"}], then="raise")
    expire_leases()
    assert recover_stale_records().handed_back == 1
    count = 8
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def retry(index: int) -> None:
        try:
            barrier.wait()
            client = APIClient(raise_request_exception=False)
            results[index] = steered(
                client, "k", steps=[authorize, {"name": "capture", "provider_id": "ca_1"}]
            )
        finally:
            connections.close_all()

    threads = [threading.Thread(target=retry, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    ran = [r for r in results if r.status_code == 201 and "Idempotent-Replayed" not in r]
    others = sorted(r.status_code for r in results if r not in ran)
    assert len(ran) == 1, [r.status_code for r in results]
    assert set(others) <= {201, 409}, others
    assert Charge.objects.count() == 1
    assert IdempotencyStep.objects.filter(name="capture").count() == 1
    assert IdempotencyRecord.objects.get().state == State.COMPLETED


@pytest.mark.usefixtures("retry_from_capture")
def test_a_handed_back_record_whose_retention_an_operator_extended_is_still_handed_back(
    api: APIClient,
) -> None:
    """The admin's "Extend retention…" on a record waiting for the client's retry.

    ``claims.handed_back`` recognises a handed-back record by its lease
    ending at (or after) ``expires_at``; extending the retention moves
    ``expires_at`` past the lease, the record is no longer "handed back", and
    the client's retry is refused 409 until the old retention's end.
    """
    api.raise_request_exception = False
    authorize = {"name": "authorize", "provider_id": "au_1"}
    steered(api, "k", steps=[authorize, {"name": "capture"}], then="raise")
    expire_leases()
    assert recover_stale_records().handed_back == 1
    record = IdempotencyRecord.objects.get()
    store.extend_retention(
        [record.pk], until=record.expires_at + timedelta(days=3), using="default"
    )

    retry = steered(api, "k", steps=[authorize, {"name": "capture", "provider_id": "ca_1"}])

    assert retry.status_code == 201, retry.content
    assert retry.json()["skipped"] == ["authorize"]


def test_step_names_differing_only_in_case_are_two_steps(api: APIClient) -> None:
    """Step names are case-sensitive (each has its own provider key), on every vendor.

    On MySQL/MariaDB a case-insensitive collation of ``name`` would make the
    unique (record, name) constraint refuse the second step.
    """
    steps = [{"name": "capture", "provider_id": "ca_1"}, {"name": "Capture", "provider_id": "ca_2"}]
    response = steered(api, "case", steps=steps)

    assert response.status_code == 201, response.content
    assert sorted(IdempotencyStep.objects.values_list("name", flat=True)) == ["Capture", "capture"]
