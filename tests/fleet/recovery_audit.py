"""Counts what recovery settles, per record, on every fleet host's Celery worker.

Imported by the worker (``CELERY_IMPORTS`` in ``fleet_settings``): it wraps
the demo's ``POST v1/payments`` reconciler so that every call appends a
line to ``FLEET_AUDIT_LOG`` (one file shared by all hosts; each line is
one short ``O_APPEND`` write), and every settlement that *committed* (the
reconciler's transaction stores the outcome; ``on_commit`` fires only if
it did) appends another. Three beats at once must commit one settlement
per record, however often they ask.
"""

from __future__ import annotations

import json
import os
import socket

from django.db import transaction
from payments import reconcilers

from django_idempotency import recovery
from django_idempotency.models import IdempotencyRecord

AUDIT_LOG_ENV = "FLEET_AUDIT_LOG"


def _write(event: str, record: IdempotencyRecord, outcome: str) -> None:
    line = json.dumps(
        {
            "event": event,
            "record": record.pk,
            "key": record.key,
            "token": record.fencing_token,
            "outcome": outcome,
            "host": socket.gethostname(),
        }
    )
    fd = os.open(os.environ[AUDIT_LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def audited_settle_payment(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
    outcome = reconcilers.settle_payment(record)
    name = type(outcome).__name__
    _write("asked", record, name)
    if name in ("Completed", "Failed"):
        database = record._state.db or "default"
        transaction.on_commit(lambda: _write("settled", record, name), using=database)
    return outcome


if os.environ.get(AUDIT_LOG_ENV):
    # The registry refuses a second function for an operation; the audit
    # replaces the demo's in place, in this test-only worker.
    recovery._reconcilers[reconcilers.OPERATION] = audited_settle_payment
