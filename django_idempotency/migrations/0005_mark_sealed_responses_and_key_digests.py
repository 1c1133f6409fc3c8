"""Mark encrypted responses explicitly, and widen the fingerprint for versioned digests.

Until now an encrypted response was recognised by its body starting with
``b"fernet:"``, so a plaintext body that happened to start so was taken for
ciphertext. From here on the ``response_sealed`` column says it, written by
the completion itself. Existing rows get it by the only evidence they have,
tested strictly: a row is marked sealed when

- its stored headers are empty (sealing always moved them into the token),
- its body starts with ``b"fernet:"``,
- and what follows is a well-formed Fernet token: URL-safe base64 that
  decodes to version byte 0x80, an 8-byte timestamp, a 16-byte IV, whole
  16-byte AES blocks (at least one) and a 32-byte HMAC.

No key is needed for this test, so the migration runs wherever the keys
are. A plaintext body has to spell all of that, with no stored header (not
even its Content-Type), to be taken for ciphertext; ``manage.py
idempotency_rotate_keys`` would then report it as unreadable, by primary
key, rather than hide it.

Fingerprints become ``"<version>:<hex>"`` (at most 16 + 1 + 64 characters).
Stored bare SHA-256 fingerprints stay as they are: they are compared as such.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from django.db import migrations, models
from django.db.migrations.exceptions import IrreversibleError

_PREFIX = b"fernet:"
_URLSAFE_BASE64 = re.compile(rb"[A-Za-z0-9_-]+={0,2}")
#: Version, timestamp, IV and HMAC around the ciphertext blocks.
_FRAME = 1 + 8 + 16 + 32
_BLOCK = 16
_BATCH = 500


def looks_sealed(headers: Any, body: Any) -> bool:
    """Whether a row written before ``response_sealed`` holds an encrypted response."""
    if headers or body is None:
        return False
    raw = bytes(body)
    if not raw.startswith(_PREFIX):
        return False
    token = raw[len(_PREFIX) :]
    if not _URLSAFE_BASE64.fullmatch(token):
        return False
    try:
        decoded = base64.urlsafe_b64decode(token)
    except (binascii.Error, ValueError):
        return False
    blocks = len(decoded) - _FRAME
    return decoded[:1] == b"\x80" and blocks >= _BLOCK and blocks % _BLOCK == 0


def mark_sealed_rows(apps: Any, schema_editor: Any) -> None:
    record = apps.get_model("django_idempotency", "IdempotencyRecord")
    records = record.objects.using(schema_editor.connection.alias)
    after = 0
    while True:
        rows = list(
            records.filter(pk__gt=after, response_body__isnull=False)
            .order_by("pk")
            .values_list("pk", "response_headers", "response_body")[:_BATCH]
        )
        if not rows:
            return
        sealed = [pk for pk, headers, body in rows if looks_sealed(headers, body)]
        if sealed:
            records.filter(pk__in=sealed).update(response_sealed=True)
        after = rows[-1][0]


def refuse_to_shorten_versioned_fingerprints(apps: Any, schema_editor: Any) -> None:
    """Migrating back: refuse before any change if records of this release exist.

    Their ``"<version>:<hex>"`` fingerprints do not fit the old 64
    characters, and the earlier release could not compare them anyway. The
    refusal comes first, so that MariaDB, which cannot roll DDL back, is not
    left half way.
    """
    from django.db.models.functions import Length

    record = apps.get_model("django_idempotency", "IdempotencyRecord")
    records = record.objects.using(schema_editor.connection.alias)
    newer = records.annotate(length=Length("fingerprint")).filter(length__gt=64).count()
    if newer:
        raise IrreversibleError(
            f"{newer} idempotency record(s) carry fingerprints of this release, which the "
            "earlier release can neither store nor compare. Purge them first (they are "
            "recognisable by a ':' in the fingerprint), then migrate back."
        )


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
        migrations.RunPython(mark_sealed_rows, migrations.RunPython.noop, elidable=True),
        # Last, so that migrating back runs it first.
        migrations.RunPython(migrations.RunPython.noop, refuse_to_shorten_versioned_fingerprints),
    ]
