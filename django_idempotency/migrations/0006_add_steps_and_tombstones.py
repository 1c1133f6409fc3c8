"""Steps of multi-step operations, and tombstones of expired records.

``django_idempotency_step`` holds one row per ``begin_external(step=...)``.
Its rows go with their record inside the database: the store deletes
records with one conditional ``DELETE`` (``store/conditional.py``) and the
purge in batches, never through Django's collector, so the cascade must be
the database's. Django 5.2 and 6.0 cannot declare ``ON DELETE CASCADE``,
so the model's reference has no constraint and this migration adds one:

- PostgreSQL, MySQL and MariaDB: a foreign key ``ON DELETE CASCADE``.
- SQLite, whose ``ALTER TABLE`` cannot add a foreign key: an ``AFTER
  DELETE`` trigger on the records table. A later migration that makes
  Django rebuild that table on SQLite (it does for most field changes)
  drops the trigger and must create it again;
  ``tests/test_steps_schema.py`` fails if it is missing.

``tombstone`` marks a resolved record whose response the purge dropped,
with a database default so that a release without the column in its
INSERT statements (a rolling upgrade) still writes valid rows.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
from django.db import migrations, models

_STEPS = "django_idempotency_step"
_RECORDS = "django_idempotency_record"
_CONSTRAINT = "django_idempotency_step_record_cascade"
_TRIGGER = "django_idempotency_step_cascade"


def add_cascade(apps: Any, schema_editor: Any) -> None:
    quote = schema_editor.quote_name
    if schema_editor.connection.vendor == "sqlite":
        schema_editor.execute(
            f"CREATE TRIGGER {quote(_TRIGGER)} AFTER DELETE ON {quote(_RECORDS)} "
            f"FOR EACH ROW BEGIN DELETE FROM {quote(_STEPS)} WHERE record_id = OLD.id; END"
        )
        return
    schema_editor.execute(
        f"ALTER TABLE {quote(_STEPS)} ADD CONSTRAINT {quote(_CONSTRAINT)} "
        f"FOREIGN KEY ({quote('record_id')}) REFERENCES {quote(_RECORDS)} ({quote('id')}) "
        "ON DELETE CASCADE"
    )


def binary_step_names_on_mysql(apps: Any, schema_editor: Any) -> None:
    """Compare step names byte for byte on MySQL/MariaDB, as 0001 does the scope.

    Their default collations ignore case, accents and trailing spaces:
    ``"capture"`` and ``"Capture"`` (two steps, two provider keys) would
    collide on the unique (record, name) constraint, and the lookup of one
    would find the other. PostgreSQL and SQLite compare exactly already.
    """
    if schema_editor.connection.vendor != "mysql":
        return
    collation = (
        "utf8mb4_nopad_bin"
        if getattr(schema_editor.connection, "mysql_is_mariadb", False)
        else "utf8mb4_0900_bin"
    )
    quote = schema_editor.quote_name
    schema_editor.execute(
        f"ALTER TABLE {quote(_STEPS)} MODIFY {quote('name')} VARCHAR(64) "
        f"CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
    )


def drop_cascade(apps: Any, schema_editor: Any) -> None:
    quote = schema_editor.quote_name
    vendor = schema_editor.connection.vendor
    if vendor == "sqlite":
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {quote(_TRIGGER)}")
    elif vendor == "mysql":
        schema_editor.execute(f"ALTER TABLE {quote(_STEPS)} DROP FOREIGN KEY {quote(_CONSTRAINT)}")
    else:
        schema_editor.execute(f"ALTER TABLE {quote(_STEPS)} DROP CONSTRAINT {quote(_CONSTRAINT)}")


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0005_mark_sealed_responses_and_key_digests"),
    ]

    operations = [
        migrations.AddField(
            model_name="idempotencyrecord",
            name="tombstone",
            field=models.BooleanField(db_default=False, default=False, verbose_name="tombstone"),
        ),
        migrations.CreateModel(
            name="IdempotencyStep",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=64, verbose_name="step")),
                ("provider_key", models.CharField(max_length=64, verbose_name="provider key")),
                (
                    "provider_operation_id",
                    models.CharField(
                        blank=True, max_length=255, verbose_name="provider operation id"
                    ),
                ),
                ("begun_at", models.DateTimeField(verbose_name="begun at")),
                ("updated_at", models.DateTimeField(verbose_name="updated at")),
                (
                    "record",
                    models.ForeignKey(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="steps",
                        to="django_idempotency.idempotencyrecord",
                        verbose_name="record",
                    ),
                ),
            ],
            options={
                "verbose_name": "idempotency step",
                "verbose_name_plural": "idempotency steps",
                "db_table": "django_idempotency_step",
                "indexes": [
                    models.Index(
                        condition=models.Q(("provider_operation_id", ""), _negated=True),
                        fields=["provider_operation_id"],
                        name="idempotency_step_provider_op",
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("record", "name"), name="django_idempotency_unique_step"
                    )
                ],
            },
        ),
        # After the AddField: on SQLite it rebuilds the records table, which
        # would drop a trigger created before it. Not atomic: MySQL and
        # MariaDB cannot run DDL inside a transaction.
        migrations.RunPython(add_cascade, drop_cascade, atomic=False, elidable=False),
        migrations.RunPython(
            binary_step_names_on_mysql, migrations.RunPython.noop, atomic=False, elidable=False
        ),
    ]
