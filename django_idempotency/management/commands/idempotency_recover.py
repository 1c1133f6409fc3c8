from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_idempotency import recovery
from django_idempotency._observability import recording
from django_idempotency._store.clock import to_the_second
from django_idempotency._store.routing import record_databases
from django_idempotency.management.arguments import add_database_argument, positive_int
from django_idempotency.management.terminal import printable


class Command(BaseCommand):
    help = (
        "Settle idempotency records whose owner's lease ran out: release CLAIMED "
        "ones, ask the reconcilers about IN_PROGRESS and UNCERTAIN ones. The same "
        "work as the recover_stale_records Celery task, for cron."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=positive_int, default=100, help="records per run")
        parser.add_argument(
            "--dry-run", action="store_true", help="list what would be handled, change nothing"
        )
        add_database_argument(parser)

    def handle(
        self, *args: Any, batch_size: int, dry_run: bool, database: str | None, **options: Any
    ) -> None:
        if dry_run:
            stale = recovery.stale_records(limit=batch_size, database=database)
            # Ids repeat from one database to the next: name it when there are several.
            several = database is None and len(record_databases()) > 1
            for record in stale:
                reconciler = recovery.reconciler_for(record.operation)
                # A CLAIMED record with steps was handed back (RetryFrom):
                # its kept steps called providers, so it is reconciled.
                action = (
                    "release"
                    if record.state == "CLAIMED" and not record.steps.exists()
                    else "reconcile"
                    if reconciler
                    else "no reconciler"
                )
                where = f"{record._state.db}\t" if several else ""
                self.stdout.write(
                    f"{where}{record.pk}\t{record.state}\t{printable(record.operation)}\t"
                    f"{printable(record.key)}\t{action}"
                )
            self.stdout.write(f"{len(stale)} stale record(s) would be handled (dry run).")
            # Why an unresolved record is not listed: somebody holds it, for now.
            leased, first_end = recovery.leased_records(database=database)
            if first_end is None:
                self.stdout.write(f"{leased} unresolved record(s) skipped: no lease still runs.")
            else:
                self.stdout.write(
                    f"{leased} unresolved record(s) skipped: their lease still runs (held by "
                    "their owner, or postponed by recovery); the first one ends at "
                    f"{to_the_second(first_end)}."
                )
            return
        # Cron runs it again and again: its counts go on in one file of the
        # Prometheus directory, not in a new one per run.
        recording.reuse_files_across_runs("idempotency_recover")
        report = recovery.recover_stale_records(batch_size=batch_size, database=database)
        self.stdout.write(
            f"released {report.released}, handed back {report.handed_back}, completed "
            f"{report.completed}, failed "
            f"{report.failed}, retry later {report.retried}, no reconciler "
            f"{report.unreconciled}, taken over meanwhile {report.stale}"
        )
