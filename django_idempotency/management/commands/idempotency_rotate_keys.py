from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency import store
from django_idempotency.conf import idempotency_settings
from django_idempotency.management.arguments import positive_int


class Command(BaseCommand):
    help = (
        "Re-encrypt stored responses with the newest of IDEMPOTENCY['ENCRYPTION_KEYS'] "
        "(the first), so that older keys can be removed from the list afterwards."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size", type=positive_int, default=500, help="records per batch"
        )

    def handle(self, *args: Any, batch_size: int, **options: Any) -> None:
        if not idempotency_settings.ENCRYPTION_KEYS:
            raise CommandError("IDEMPOTENCY['ENCRYPTION_KEYS'] is empty: nothing to rotate to.")
        after, total = 0, 0
        while True:
            last, rewritten = store.reseal_batch(
                after=after, limit=batch_size, using=idempotency_settings.DATABASE
            )
            total += rewritten
            if last == after:
                break
            after = last
        self.stdout.write(f"re-encrypted {total} stored response(s) with the newest key")
