"""``idempotent_task`` for Django's Tasks framework: an enqueued key runs once.

The names a task module needs, without Celery: ``django.tasks`` on Django
6.0 and later, the ``django-tasks`` backport on Django 5.2 (``pip install
"django-idempotency[tasks]"`` brings it with the database backend and its
worker, ``django-tasks-db``). Place the decorator under ``@task``:

```python
from django.tasks import task  # Django 5.2: from django_tasks import task

from django_idempotency.django_tasks import idempotent_task


@task()
@idempotent_task(key="order_id", lease=300)
def ship_order(order_id):
    shipment = Shipment.objects.create(order_id=order_id)
    return {"shipment": shipment.pk}
```

``ship_order.enqueue(order_id=7)`` twice runs the body once; the second run
returns the first one's result. The decorator is the same object as
``django_idempotency.idempotent_task`` and ``django_idempotency.tasks``'
(for Celery); see docs/tasks-framework.md for what the Tasks framework
leaves to you that Celery does (retries, redelivery, a scheduler).
"""

from __future__ import annotations

from django_idempotency._protection.task import idempotent_task, task_idempotency
from django_idempotency.exceptions import (
    TaskFailed,
    TaskInProgress,
    TaskKeyMissing,
    TaskKeyReused,
    TaskOutcomeUncertain,
)

__all__ = [
    "TaskFailed",
    "TaskInProgress",
    "TaskKeyMissing",
    "TaskKeyReused",
    "TaskOutcomeUncertain",
    "idempotent_task",
    "task_idempotency",
]
