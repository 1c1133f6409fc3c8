"""Retention: deleting resolved records once ``expires_at`` has passed."""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.utils import timezone

from django_idempotency import store
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import RESOLVED_STATES, IdempotencyRecord


@dataclass
class PurgeReport:
    deleted: int = 0
    batches: int = 0
    #: The longest single DELETE, in seconds: what live traffic felt.
    longest_batch: float = 0.0


def expired_count() -> int:
    """How many records a purge would delete now (for ``--dry-run``)."""
    return (
        IdempotencyRecord.objects.using(idempotency_settings.DATABASE)
        .filter(state__in=RESOLVED_STATES, expires_at__lte=timezone.now())
        .count()
    )


def purge_expired_records(*, batch_size: int = 1000, max_batches: int | None = None) -> PurgeReport:
    """Delete COMPLETED and FAILED records past ``expires_at``, in short batches.

    Small batches keep each DELETE (and the locks it holds) short, so live
    claims are not kept waiting. Unresolved records are never deleted here.
    """
    report = PurgeReport()
    database = idempotency_settings.DATABASE
    while max_batches is None or report.batches < max_batches:
        started = time.monotonic()
        deleted = store.purge_expired_batch(limit=batch_size, using=database)
        if not deleted:
            break
        report.batches += 1
        report.deleted += deleted
        report.longest_batch = max(report.longest_batch, time.monotonic() - started)
        if deleted < batch_size:
            break
    return report
