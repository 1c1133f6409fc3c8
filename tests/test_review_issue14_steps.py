"""Review of issue 14: a handed-back record (``RetryFrom``) after a retry that gave up.

The client's retry of a handed-back record takes it over, then answers a
"release" status (503) before beginning any step. The owner's release keeps
the record (its kept steps called providers), but leaves it CLAIMED under
the failed retry's own lease: the client's next retry, which the 503 told
to come back, is refused 409 for the whole LEASE, and recovery, not the
client, gets it next (asking the reconciler again). The record should go
back to being handed back (no lease owner, lease until ``expires_at``), as
it was before the failed retry took it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from rest_framework.test import APIClient

from django_idempotency import _store as store
from django_idempotency import recovery
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from django_idempotency.recovery import RetryFrom, recover_stale_records
from django_idempotency.testing import expire_leases
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.not_under(
        "repeatable-read", reason="IsolationNotSupported", databases=("postgres",)
    ),
    pytest.mark.not_under("atomic-requests", reason="W002: the intent rolls back with the view"),
]
URL = "/api-view/steps"
OPERATION = "POST api-view/steps"
State = IdempotencyRecord.State


def steered(api: APIClient, key: str, **steps: Any) -> Any:
    return post(api, URL, {"amount": 1}, key, HTTP_X_STEPS=json.dumps(steps))


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
