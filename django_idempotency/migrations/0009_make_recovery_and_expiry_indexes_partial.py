"""The recovery and expiry indexes made partial, built without blocking claims.

The completion's UPDATE changes ``state``, so PostgreSQL never makes it a HOT
update: it adds an entry to every index whose condition the new row
version meets. (state, lease_expires_at) and (expires_at) took one from
the claim and one more from the completion, though recovery looks only at
unresolved records and the purge only at resolved ones. Partial, each takes
one per first execution: ``idempotency_unresolved_lease`` the claim's (an
unresolved row), ``idempotency_resolved_expiry`` the completion's (a
resolved one); benchmarks/wal_per_request.py and docs/performance.md give
the figures. Every scan that uses them states the condition in its own
WHERE, so that the planner can prove the index applies.

MySQL and MariaDB have no partial indexes (Django would build these
without their condition, one more entry on every claim): they keep
``django_idempotency_recovery`` and ``django_idempotency_expiry``, which
this migration removes from the model state only. InnoDB writes a
secondary index entry only when the row's indexed columns change, so
those cost MySQL one entry each per first execution already. SQLite gets
the partial indexes too.

Not atomic: ``CREATE INDEX CONCURRENTLY`` cannot run inside a transaction.
The new indexes are built before the old ones are dropped, so recovery
and the purge always have one. If a build fails, migrate again: the
invalid index it left is dropped and built again (docs/upgrading.md).
"""

from django.db import migrations, models

from django_idempotency.migration_operations import (
    AddIndexWithoutBlocking,
    RemoveIndexWithoutBlocking,
)

#: The databases with partial indexes.
PARTIAL = ["postgresql", "sqlite"]

UNRESOLVED_LEASE = models.Index(
    condition=models.Q(("state__in", ["CLAIMED", "IN_PROGRESS", "UNCERTAIN"])),
    fields=["lease_expires_at"],
    name="idempotency_unresolved_lease",
)
RESOLVED_EXPIRY = models.Index(
    condition=models.Q(("state__in", ["COMPLETED", "FAILED"])),
    fields=["expires_at"],
    name="idempotency_resolved_expiry",
)
RECOVERY = models.Index(fields=["state", "lease_expires_at"], name="django_idempotency_recovery")
EXPIRY = models.Index(fields=["expires_at"], name="django_idempotency_expiry")


def add(index: models.Index) -> migrations.SeparateDatabaseAndState:
    """``index`` in the model state; in the database where partial indexes exist."""
    return migrations.SeparateDatabaseAndState(
        state_operations=[migrations.AddIndex(model_name="idempotencyrecord", index=index)],
        database_operations=[
            AddIndexWithoutBlocking(model_name="idempotencyrecord", index=index, vendors=PARTIAL)
        ],
    )


def remove(index: models.Index) -> migrations.SeparateDatabaseAndState:
    """``index`` out of the model state; out of the database where its partial twin is."""
    return migrations.SeparateDatabaseAndState(
        state_operations=[
            migrations.RemoveIndex(model_name="idempotencyrecord", name=str(index.name))
        ],
        database_operations=[
            RemoveIndexWithoutBlocking(model_name="idempotencyrecord", index=index, vendors=PARTIAL)
        ],
    )


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_idempotency", "0008_add_principal_and_credential_digests"),
    ]

    operations = [
        add(UNRESOLVED_LEASE),
        add(RESOLVED_EXPIRY),
        remove(RECOVERY),
        remove(EXPIRY),
    ]
