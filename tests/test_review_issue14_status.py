"""Review of issue 14: the operation status view against tombstones and handed-back records.

The status view must tell a client what the protected request itself would
do with a retry: a response the replay refuses (past retention, kept as a
tombstone) is not shown either, and a record handed back to the client's
retry (``RetryFrom``) does not tell the client to wait for it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_idempotency._store.database_time import DatabaseLater
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from tests.factories import RecordFactory
from tests.utils import TokenClient, post

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
STATUS_URL = "/idempotency/status/"


@pytest.fixture
def alice(client_for: Callable[..., TokenClient]) -> TokenClient:
    return client_for()


def tenant_of(client: TokenClient) -> str:
    return f"user:{client.user.pk}"


def test_with_tombstone_ttl_a_record_past_retention_shows_no_response(
    alice: TokenClient, settings: Any
) -> None:
    """Past ``expires_at``, before the purge made it a tombstone.

    The protected request refuses a retry as ``idempotency_key_expired`` (its
    response is "gone, or due to be"), yet the status view still answers
    ``expired: false`` with the stored body: it judges ``past_retention``,
    which with TOMBSTONE_TTL is true only once the tombstone's time is over.
    """
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "TOMBSTONE_TTL": timedelta(days=7),
    }
    first = post(alice, "/api-view/charges", {"amount": 5}, "late")
    assert first.status_code == 201, first.content
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(-timedelta(hours=1)))

    retry = post(alice, "/api-view/charges", {"amount": 5}, "late")
    answer = alice.get(STATUS_URL, {"key": "late"}).json()

    assert retry.json()["code"] == "idempotency_key_expired"
    assert answer["expired"] is True, answer
    assert answer["response"] is None, answer


def test_a_record_handed_back_to_the_clients_retry_does_not_tell_the_client_to_wait(
    alice: TokenClient,
) -> None:
    """A reconciler's ``RetryFrom`` waits for the client's retry with the same key.

    docs/status.md tells a client that sees CLAIMED "it is running: wait, and
    ask again". A client following the status protocol (ask instead of a blind
    retry) then never retries, and the record waits out its whole retention
    before recovery leaves it UNCERTAIN for an operator. The answer should be
    the one of a record released for retry: 404 ``idempotency_key_unknown``
    ("retry it with the same key"), or anything else that says "retry".
    """
    expires_at = timezone.now() + timedelta(hours=20)
    record = RecordFactory.create(
        tenant=tenant_of(alice),
        key="handed-back",
        state=State.CLAIMED,
        lease_owner="",
        lease_expires_at=expires_at,
        expires_at=expires_at,
        response_status=None,
        response_headers=[],
        response_body=None,
        fencing_token=2,
    )
    IdempotencyStep.objects.create(
        record=record,
        name="authorize",
        provider_key="v1:" + "a" * 60,
        provider_operation_id="auth_1",
        begun_at=timezone.now(),
        updated_at=timezone.now(),
    )

    answer = alice.get(STATUS_URL, {"key": "handed-back"})

    assert answer.status_code == 404, answer.json()
    assert answer.json()["code"] == "idempotency_key_unknown"
