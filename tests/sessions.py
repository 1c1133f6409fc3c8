"""Other database sessions a test needs: one holding a key, uncommitted."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import connection, connections
from django.utils import timezone


@contextlib.contextmanager
def key_held_by_an_open_transaction(operation: str, key: str = "k") -> Iterator[None]:
    """Another session inserted the anonymous tenant's record of ``key`` and has not committed."""
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        now = timezone.now()
        with other.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_idempotency_record (tenant, operation, "
                + connection.ops.quote_name("key")
                + ", fingerprint, state, lease_owner, lease_expires_at, fencing_token, "
                "provider_key, provider_operation_id, response_headers, created_at, updated_at, "
                "expires_at) VALUES (%s, %s, %s, '', 'CLAIMED', 'other', %s, 1, '', '', '[]', "
                "%s, %s, %s)",
                ["anonymous", operation, key, now, now, now, now],
            )
        yield
    finally:
        other.rollback()
        other.close()


@contextlib.contextmanager
def row_locked_by_an_open_transaction(record_id: int) -> Iterator[None]:
    """Another session locked the record's row and has not committed.

    As a worker does that was cut off from the database between two
    statements of its transaction (``begin_external()``'s UPDATE and its
    step's INSERT, recovery's SELECT ... FOR UPDATE and its UPDATE): the
    server keeps the lock until it notices the session is gone.
    """
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute(
                "SELECT id FROM django_idempotency_record WHERE id = %s FOR UPDATE", [record_id]
            )
        yield
    finally:
        other.rollback()
        other.close()
