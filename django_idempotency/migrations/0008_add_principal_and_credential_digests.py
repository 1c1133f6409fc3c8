"""Who sent a record's first request, and the credential it presented: keyed digests.

``principal_digest`` lets a retry that DRF's permission check refuses be
answered with its replay, only for the principal that sent the first
request; ``credential_digest`` lets a view that rotates or revokes the
caller's credential answer the holder of the old one for a short window
(docs/security.md). Both are nullable without a default: the previous
release's INSERT statements leave them NULL ("not known"), and no database
rewrites the table to add them. ``AddFieldWithoutBlocking`` bounds each
``ALTER TABLE``'s wait for the table's lock, so that claims never queue
for long behind it (``migration_operations.py``).
"""

from django.db import migrations, models

from django_idempotency.migration_operations import AddFieldWithoutBlocking


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0007_add_created_at_brin_index"),
    ]

    operations = [
        AddFieldWithoutBlocking(
            model_name="idempotencyrecord",
            name="principal_digest",
            field=models.CharField(
                blank=True, max_length=96, null=True, verbose_name="principal digest"
            ),
        ),
        AddFieldWithoutBlocking(
            model_name="idempotencyrecord",
            name="credential_digest",
            field=models.CharField(
                blank=True, max_length=96, null=True, verbose_name="credential digest"
            ),
        ),
    ]
