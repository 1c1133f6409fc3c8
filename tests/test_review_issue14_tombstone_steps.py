"""Review of issue 14: the steps of a record the purge turns into a tombstone, then deletes.

A tombstone keeps the scope and the fingerprint; its steps go with it when
the purge deletes it (ON DELETE CASCADE, a trigger on SQLite), on every
vendor, through the one-statement PostgreSQL purge and the other vendors'.
And a handed-back or UNCERTAIN record past ``expires_at`` is never made a
tombstone: only resolved records are.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from django_idempotency import purge
from django_idempotency._store.database_time import DatabaseLater
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from tests.factories import RecordFactory

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
TTL = timedelta(days=7)


def with_step(record: IdempotencyRecord, name: str = "authorize") -> None:
    IdempotencyStep.objects.create(
        record=record,
        name=name,
        provider_key="v1:" + "b" * 60,
        provider_operation_id="au_1",
        begun_at=timezone.now(),
        updated_at=timezone.now(),
    )


def test_a_tombstones_steps_go_with_it(settings: Any) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "TOMBSTONE_TTL": TTL}
    record = RecordFactory.create()
    with_step(record)
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(-timedelta(hours=1)))

    assert purge.purge_expired_records(pause_factor=0).tombstoned == 1
    assert IdempotencyRecord.objects.get().tombstone
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(-timedelta(seconds=1)))
    assert purge.purge_expired_records(pause_factor=0).deleted == 1

    assert not IdempotencyRecord.objects.exists()
    assert not IdempotencyStep.objects.exists()


@pytest.mark.parametrize("state", [State.CLAIMED, State.UNCERTAIN, State.IN_PROGRESS])
def test_an_unresolved_record_with_steps_past_expires_at_is_never_buried(
    settings: Any, state: str
) -> None:
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "TOMBSTONE_TTL": TTL}
    record = RecordFactory.create(
        state=state,
        lease_owner="",
        response_status=None,
        response_headers=[],
        response_body=None,
    )
    with_step(record)
    IdempotencyRecord.objects.update(
        expires_at=DatabaseLater(-TTL - timedelta(hours=1)),
        lease_expires_at=DatabaseLater(-TTL - timedelta(hours=1)),
    )

    report = purge.purge_expired_records(pause_factor=0)

    assert (report.deleted, report.tombstoned) == (0, 0)
    assert IdempotencyStep.objects.count() == 1
