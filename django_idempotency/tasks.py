"""Celery tasks for recovery and the purge, a ready beat schedule, and
``idempotent_task`` for deduplicating Celery tasks.

Merge the schedule into yours, in settings (this module imports no models,
so it can be imported before Django is set up):

```python
from django_idempotency.tasks import BEAT_SCHEDULE
CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE, ...}
```
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from django.core.exceptions import ImproperlyConfigured

try:
    from celery import shared_task
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImproperlyConfigured(
        'django_idempotency.tasks needs Celery: pip install "django-idempotency[celery]"'
    ) from exc

from django_idempotency._protection.celery_task import message_id
from django_idempotency._protection.task import idempotent_task, task_idempotency
from django_idempotency.exceptions import (
    TaskFailed,
    TaskInProgress,
    TaskKeyMissing,
    TaskKeyReused,
    TaskOutcomeUncertain,
)

__all__ = [
    "BEAT_SCHEDULE",
    "TaskFailed",
    "TaskInProgress",
    "TaskKeyMissing",
    "TaskKeyReused",
    "TaskOutcomeUncertain",
    "idempotent_task",
    "message_id",
    "observe_records",
    "purge_expired_records",
    "recover_stale_records",
    "task_idempotency",
]


@shared_task(name="django_idempotency.tasks.recover_stale_records", ignore_result=False)
def recover_stale_records(batch_size: int = 100, database: str | None = None) -> dict[str, int]:
    """Settle up to ``batch_size`` records whose owner's lease ran out.

    Celery task ``django_idempotency.tasks.recover_stale_records``: runs
    ``django_idempotency.recovery.recover_stale_records()``.

    Args:
        batch_size: At most this many records from each records database
            in this run.
        database: Only this records database; ``None``: every one.

    Returns:
        The ``RecoveryReport`` counts as a dict: ``released``, ``completed``,
        ``failed``, ``retried``, ``unreconciled``, ``stale``.
    """
    from django_idempotency import recovery

    return asdict(recovery.recover_stale_records(batch_size=batch_size, database=database))


@shared_task(name="django_idempotency.tasks.purge_expired_records", ignore_result=False)
def purge_expired_records(
    batch_size: int = 100,
    max_batches: int = 10_000,
    batch_seconds: float = 0.1,
    pause_factor: float = 2.0,
    database: str | None = None,
) -> dict[str, Any]:
    """Delete resolved records past retention, at most ``max_batches`` batches a run.

    Celery task ``django_idempotency.tasks.purge_expired_records``: runs
    ``django_idempotency.purge.purge_expired_records()``. With the defaults a
    run deletes at most 1,000,000 records, in about a minute on a small
    server (docs/performance.md).

    Args:
        batch_size: Rows per DELETE, at most.
        max_batches: Batches per run, at most.
        batch_seconds: A batch that took longer halves the next one.
        pause_factor: After each batch, pause this many times as long as
            the batch took.
        database: Only this records database; ``None``: every one.

    Returns:
        The ``PurgeReport`` as a dict: ``deleted``, ``batches``,
        ``longest_batch`` (seconds), ``tombstoned`` (``TOMBSTONE_TTL``).
    """
    from django_idempotency import purge

    report = purge.purge_expired_records(
        batch_size=batch_size,
        max_batches=max_batches,
        batch_seconds=batch_seconds,
        pause_factor=pause_factor,
        database=database,
    )
    return asdict(report)


@shared_task(name="django_idempotency.tasks.observe_records", ignore_result=False)
def observe_records(database: str | None = None) -> dict[str, dict[str, Any]]:
    """Take the census of each records database and set the metrics' gauges.

    Celery task ``django_idempotency.tasks.observe_records``: one process
    (the worker that runs it) reads the counts, so the gauges are read from
    the database once a minute, not once per web worker; see
    docs/observability.md for where the values go. Without Celery, call
    ``django_idempotency.census.observe_records`` instead.

    Args:
        database: Only this records database; ``None``: every one.

    Returns:
        Per database: ``counts`` per state, ``estimated`` (the states whose
        count is an estimate), ``oldest_unresolved_age`` (seconds or None),
        ``purge_backlog`` and ``unreconciled_operations``.
    """
    from django_idempotency import census

    return census.observe_records(database)


BEAT_SCHEDULE: dict[str, dict[str, Any]] = {
    "django-idempotency-recover-stale-records": {
        "task": "django_idempotency.tasks.recover_stale_records",
        "schedule": 60.0,
    },
    "django-idempotency-purge-expired-records": {
        "task": "django_idempotency.tasks.purge_expired_records",
        "schedule": 600.0,
    },
    "django-idempotency-observe-records": {
        "task": "django_idempotency.tasks.observe_records",
        "schedule": 60.0,
    },
}
"""Celery beat entries to merge into ``CELERY_BEAT_SCHEDULE``.

Recovery every minute (a record is stuck at most LEASE plus a minute);
purge every ten minutes, bounded per run so it never hogs a worker; the
metrics' gauges every minute (a few indexed queries per records database).
"""
