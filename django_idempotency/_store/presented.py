"""The record a retry whose authentication failed may be answered with: by its credential.

A view that rotates or revokes the credential its caller authenticates with
(``credential_rotation``) keeps a keyed digest of the credential the first
request presented. Its retry, presenting that old credential, fails DRF's
authentication: there is no user, so no tenant, to look the record up by.
The credential is what identifies the caller instead: the records of the
operation and key whose first request presented it, finished, within
retention, and created within the view's window, found in SQL on the
database's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from django_idempotency._store.database_time import DatabaseLater, DatabaseNow
from django_idempotency._store.routing import record_databases
from django_idempotency.models import RESOLVED_STATES, IdempotencyRecord


def finished_for_credential(
    operation: str, key: str, credentials: Sequence[str], *, created_within: timedelta
) -> list[IdempotencyRecord]:
    """The finished records of ``operation`` and ``key`` whose first request presented a credential.

    ``credentials``: the credential's digests under every active secret. At
    most two records (more than one is ambiguous: the caller answers none),
    from every records database (without a tenant the routers cannot name
    one). Each carries ``read_at``, the database's time of the read.
    """
    found: list[IdempotencyRecord] = []
    for alias in record_databases():
        rows = (
            IdempotencyRecord.objects.using(alias)
            .filter(
                operation=operation,
                key=key,
                credential_digest__in=list(credentials),
                state__in=RESOLVED_STATES,
                tombstone=False,
                expires_at__gt=DatabaseNow(),
                created_at__gt=DatabaseLater(-created_within),
            )
            .annotate(database_now=DatabaseNow())[: 2 - len(found)]
        )
        for record in rows:
            record.read_at = record.database_now  # what retention is judged against
            found.append(record)
        if len(found) == 2:
            break
    return found
