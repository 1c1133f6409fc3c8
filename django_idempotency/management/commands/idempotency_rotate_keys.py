from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency import _store as store
from django_idempotency._store.routing import records_database_named
from django_idempotency.conf import idempotency_settings
from django_idempotency.management.arguments import add_database_argument, positive_int
from django_idempotency.management.terminal import printable


class Command(BaseCommand):
    help = (
        "Encrypt every stored response with the newest of IDEMPOTENCY['ENCRYPTION_KEYS'] "
        "(the first): re-encrypt those encrypted with an older key, so that it can be "
        "removed from the list afterwards, and encrypt those stored in plaintext before "
        "encryption was turned on. Records no key decrypts are listed, and the command "
        "then exits with status 1."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size", type=positive_int, default=500, help="records per batch"
        )
        add_database_argument(parser)

    def handle(self, *args: Any, batch_size: int, database: str | None, **options: Any) -> None:
        if not idempotency_settings.ENCRYPTION_KEYS:
            raise CommandError("IDEMPOTENCY['ENCRYPTION_KEYS'] is empty: nothing to rotate to.")
        rotated, encrypted, unreadable = 0, 0, 0
        aliases = records_database_named(database)
        for alias in aliases:
            where = f" in {alias!r}" if len(aliases) > 1 else ""
            after = 0
            while True:
                batch = store.reseal_batch(after=after, limit=batch_size, using=alias)
                rotated += batch.rotated
                encrypted += batch.encrypted
                for pk, scope in batch.unreadable:
                    unreadable += 1
                    shown = " / ".join(map(printable, (scope.tenant, scope.operation, scope.key)))
                    self.stderr.write(
                        f"record {pk}{where} ({shown}): none of ENCRYPTION_KEYS decrypts its "
                        "response; left as it is"
                    )
                if batch.last == after:
                    break
                after = batch.last
        self.stdout.write(f"rotated {rotated}, encrypted {encrypted}, unreadable {unreadable}")
        if unreadable:
            raise CommandError(
                f"{unreadable} stored response(s) could not be decrypted with any of "
                "ENCRYPTION_KEYS (listed above): put the key they were encrypted with back "
                "into the list and run the command again, or let them expire."
            )
