from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_idempotency import purge
from django_idempotency._observability import recording
from django_idempotency.conf import idempotency_settings
from django_idempotency.management.arguments import (
    add_database_argument,
    non_negative_float,
    positive_float,
    positive_int,
)


class Command(BaseCommand):
    help = (
        "Delete COMPLETED and FAILED idempotency records past their expiry, in "
        "batches (with TOMBSTONE_TTL: make them tombstones first). The same work "
        "as the purge_expired_records Celery task, for cron."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=positive_int, default=100, help="rows per DELETE")
        parser.add_argument(
            "--max-batches", type=positive_int, default=None, help="stop after this many batches"
        )
        parser.add_argument(
            "--batch-seconds",
            type=positive_float,
            default=0.1,
            help="halve the next batch after one that took longer than this",
        )
        parser.add_argument(
            "--pause-factor",
            type=non_negative_float,
            default=2.0,
            help="pause this many times as long as each batch took (0: no pause)",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted, delete nothing"
        )
        add_database_argument(parser)

    def handle(
        self,
        *args: Any,
        batch_size: int,
        max_batches: int | None,
        batch_seconds: float,
        pause_factor: float,
        dry_run: bool,
        database: str | None,
        **options: Any,
    ) -> None:
        if dry_run:
            count = purge.expired_count(database=database)
            tombstones = purge.tombstone_count(database=database)
            if max_batches is not None:
                count = min(count, batch_size * max_batches)
                tombstones = min(tombstones, batch_size * max_batches - count)
            made = f", {tombstones} made tombstones" if idempotency_settings.TOMBSTONE_TTL else ""
            self.stdout.write(f"{count} expired record(s) would be deleted{made}.")
            return
        # Cron runs it again and again: its counts go on in one file of the
        # Prometheus directory, not in a new one per run.
        recording.reuse_files_across_runs("idempotency_purge")
        report = purge.purge_expired_records(
            batch_size=batch_size,
            max_batches=max_batches,
            batch_seconds=batch_seconds,
            pause_factor=pause_factor,
            database=database,
        )
        made = (
            f" and made {report.tombstoned} tombstone(s)"
            if idempotency_settings.TOMBSTONE_TTL
            else ""
        )
        self.stdout.write(
            f"deleted {report.deleted} record(s){made} in {report.batches} batch(es); "
            f"longest batch {report.longest_batch * 1000:.1f} ms"
        )
