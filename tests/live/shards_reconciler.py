"""The reconciler of the sharded live test's "charge" operation (imported by its Celery worker).

It stands for asking the provider, which says the charge went through; the
body names the database the reconciler was handed the record from, so the
test sees each record settled where it lives.
"""

from __future__ import annotations

from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, register_reconciler

__all__ = [
    "charge_went_through",
]


@register_reconciler("charge")
def charge_went_through(record: IdempotencyRecord) -> Completed:
    return Completed(status=201, body={"reconciled": True, "database": record._state.db})
