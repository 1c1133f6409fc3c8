"""A BRIN index on ``created_at``, built without blocking claims (PostgreSQL only).

The admin's overview and the health command count the records created per
hour; on a table of ten million records that is a scan of the whole table
without an index. A B-tree on ``created_at`` would answer it, but every
claim would pay for one more B-tree entry. A BRIN index keeps one summary
(the smallest and largest ``created_at``) per 128 pages of the table: claims
append records in ``created_at`` order, so the summaries stay narrow and
the index costs next to nothing to maintain (``autosummarize``: autovacuum
summarises each new range as it fills, not only at the next VACUUM).

BRIN exists only on PostgreSQL, so MySQL, MariaDB and SQLite get no index
here (their counts scan the table), and the index is not in the model's
``Meta.indexes`` (``migration_operations.py`` says why).

Not atomic: ``CREATE INDEX CONCURRENTLY`` cannot run inside a transaction.
If the build fails, migrate again: the invalid index it left is dropped and
built again (docs/upgrading.md).
"""

from django.contrib.postgres.indexes import BrinIndex
from django.db import migrations

from django_idempotency.migration_operations import AddIndexWithoutBlocking


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("django_idempotency", "0006_add_steps_and_tombstones"),
    ]

    operations = [
        AddIndexWithoutBlocking(
            model_name="idempotencyrecord",
            index=BrinIndex(
                fields=["created_at"], name="idempotency_created_brin", autosummarize=True
            ),
            vendors=["postgresql"],
        ),
    ]
