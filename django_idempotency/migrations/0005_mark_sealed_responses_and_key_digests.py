"""Mark encrypted responses explicitly, and widen the fingerprint for versioned digests.

The ``response_sealed`` column says whether a record's response is
encrypted, written by the completion itself: a stored body is never taken
for ciphertext because of how it starts. Fingerprints are
``"<version>:<hex>"`` (at most 16 + 1 + 64 characters).
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0004_add_decrypted_view_permission"),
    ]

    operations = [
        migrations.AddField(
            model_name="idempotencyrecord",
            name="response_sealed",
            field=models.BooleanField(
                db_default=False, default=False, verbose_name="response encrypted"
            ),
        ),
        migrations.AlterField(
            model_name="idempotencyrecord",
            name="fingerprint",
            field=models.CharField(max_length=96, verbose_name="request fingerprint"),
        ),
    ]
