"""Upgrades and rollbacks: a rolling deploy's old workers sealing responses after
migration 0005, and migrating back from it."""

from __future__ import annotations

from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db import connection
from django.db.migrations.exceptions import IrreversibleError
from django.db.migrations.executor import MigrationExecutor
from rest_framework.test import APIClient

from django_idempotency.models import IdempotencyRecord
from tests.utils import post

URL = "/api-view/charges"
KEY = Fernet.generate_key().decode()


@pytest.mark.django_db(transaction=True)
def test_a_response_sealed_by_a_previous_release_worker_after_the_migration_replays_decrypted(
    api: APIClient, settings: Any
) -> None:
    # A rolling deploy: ``migrate`` (0005) runs while workers of the previous
    # release still serve. They seal as before (empty headers, the token in
    # the body) but know nothing of ``response_sealed``, whose db_default is
    # False. The row is what the first request below leaves, minus the flag.
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [KEY]}
    first = post(api, URL, {"amount": 5}, "rolling")
    assert first.status_code == 201
    IdempotencyRecord.objects.update(response_sealed=False)

    retry = post(api, URL, {"amount": 5}, "rolling")

    assert retry.status_code == 201
    assert not retry.content.startswith(b"fernet:")
    assert retry.json() == first.json()


@pytest.mark.django_db(transaction=True)
def test_migrating_back_to_0004_with_records_of_this_release_is_refused_before_any_change(
    api: APIClient,
) -> None:
    # A release rolled back: `migrate django_idempotency 0004` with records
    # written by this release in the table (fingerprints of 70+ characters).
    assert post(api, URL, {"amount": 5}, "rollback").status_code == 201
    before = [("django_idempotency", "0004_add_decrypted_view_permission")]
    executor = MigrationExecutor(connection)
    try:
        with pytest.raises(IrreversibleError, match="Purge them first"):
            executor.migrate(before)
        # 0005 changed nothing: the record is still there, fingerprint whole.
        # (0006, reversed before it, dropped the steps and the tombstone
        # column, which this model still has: read the one column.)
        stored = IdempotencyRecord.objects.filter(key="rollback").values_list("fingerprint")
        assert ":" in stored.get()[0]
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes("django_idempotency"))
