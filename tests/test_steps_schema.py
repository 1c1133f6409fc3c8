"""A record's steps go with it, inside the database (migration 0006).

The store deletes records with one conditional DELETE and the purge in
batches, never through Django's collector: the steps must follow by the
database's own cascade (a foreign key ON DELETE CASCADE, a trigger on
SQLite), or they would outlive their record and block nothing but pile up.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.utils import timezone

from django_idempotency._store.conditional import delete_where
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from tests.factories import RecordFactory

pytestmark = pytest.mark.django_db(transaction=True)


def add_step(record: IdempotencyRecord, name: str) -> IdempotencyStep:
    now = timezone.now()
    return IdempotencyStep.objects.create(
        record=record, name=name, provider_key=f"v1:{name}", begun_at=now, updated_at=now
    )


def test_deleting_a_record_in_one_statement_deletes_its_steps_and_no_others() -> None:
    doomed, kept = RecordFactory.create(key="doomed"), RecordFactory.create(key="kept")
    add_step(doomed, "authorize"), add_step(doomed, "capture"), add_step(kept, "authorize")

    assert delete_where(IdempotencyRecord.objects.filter(pk=doomed.pk), using="default") == 1

    remaining = IdempotencyStep.objects.values_list("record_id", "name")
    assert list(remaining) == [(kept.pk, "authorize")]


def test_a_step_needs_its_record_where_the_database_enforces_references() -> None:
    # The cascade is a real constraint on PostgreSQL and MariaDB: a step of
    # a record that does not exist cannot be written (on SQLite the trigger
    # cascades deletes only).
    if connection.vendor == "sqlite":
        pytest.skip("SQLite cascades by a trigger; it enforces no reference")
    from django.db import IntegrityError

    orphan = IdempotencyRecord(pk=987_654_321)
    with pytest.raises(IntegrityError):
        add_step(orphan, "authorize")


def test_one_step_name_per_record() -> None:
    from django.db import IntegrityError, transaction

    record = RecordFactory.create()
    add_step(record, "authorize")
    with pytest.raises(IntegrityError), transaction.atomic():
        add_step(record, "authorize")
