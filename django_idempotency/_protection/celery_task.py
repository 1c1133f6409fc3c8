"""What ``idempotent_task`` adds when Celery runs the task.

The run loop (``task``) is the same for every framework; Celery brings
three things of its own: a bound task's ``self.request`` (where the body
finds its claim as ``self.request.idempotency``), the Celery message id a
task may be keyed on (``message_id``), and time limits and broker
visibility timeouts that must agree with the lease (logged here at the
first run of each task, judged by system checks W020 and W021 too).

Celery is never imported here: a function that needs it looks for it in
``sys.modules``, where it is whenever a Celery worker runs the task, so
that a task run by Django's Tasks framework, or a project without Celery,
pays nothing for it.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta
from typing import Any

logger = logging.getLogger("django_idempotency")

#: Tasks whose timeouts were found not to agree with their lease, warned about once.
_warned_timeouts: set[str] = set()

#: Brokers that hand an unacknowledged message to another worker after a
#: timeout, by URL scheme, and that timeout's default (kombu's) in seconds.
_VISIBILITY_TIMEOUT_DEFAULTS = {
    "redis": 3600.0,
    "rediss": 3600.0,
    "sentinel": 3600.0,
    "sqs": 1800.0,
}


def message_id(*args: Any, **kwargs: Any) -> str:
    """The id of the Celery message being run: ``@idempotent_task(key=message_id)``.

    For a task whose arguments carry no id of their own. A redelivery of the
    message (a worker died, ``acks_late``) has the same id and runs once; a
    second publish of the same arguments is a new message with a new id, and
    runs again: this stops redeliveries, not a producer that publishes twice.
    A Celery retry (``self.retry()``, ``autoretry_for``) keeps the id.

    Args:
        *args: The task's arguments (ignored).
        **kwargs: The task's keyword arguments (ignored).

    Returns:
        ``current_task.request.id``.

    Raises:
        RuntimeError: Called outside a running Celery task (the function was
            called directly, not through Celery).
    """
    from celery import current_task

    task_id = getattr(getattr(current_task, "request", None), "id", None) if current_task else None
    if not task_id:
        raise RuntimeError(
            "idempotent_task(key=message_id) needs a Celery message: run the task through "
            "Celery (delay(), apply_async(), apply()), not as a plain function call."
        )
    return str(task_id)


def bound_request(args: Any) -> Any:
    """The request of a bound Celery task (its first argument), else ``None``."""
    if not args or sys.modules.get("celery") is None:
        return None
    from celery import Task as CeleryTask

    return args[0].request if isinstance(args[0], CeleryTask) else None


def broker_visibility_timeout(app: Any) -> float | None:
    """Seconds after which ``app``'s broker delivers an unacknowledged message again.

    Redis (and Sentinel) and SQS hand a message nobody acknowledged within
    ``broker_transport_options["visibility_timeout"]`` (kombu's default: an
    hour on Redis, 30 minutes on SQS) to another worker, whether or not its
    first worker still runs it. ``None`` for a broker that does not
    (RabbitMQ redelivers only when the consumer's connection is lost).
    """
    url = app.conf.broker_url or ""
    first = (url[0] if url else "") if isinstance(url, (list, tuple)) else str(url)
    scheme = first.split("://", 1)[0].split("+")[-1].lower()
    if scheme not in _VISIBILITY_TIMEOUT_DEFAULTS:
        return None
    options = app.conf.broker_transport_options or {}
    return float(options.get("visibility_timeout") or _VISIBILITY_TIMEOUT_DEFAULTS[scheme])


def warn_about_timeouts(lease: timedelta) -> None:
    """Log once per task when Celery or its broker may outlast the lease (checks W020, W021).

    Here too, not only in the system check: a worker imports task modules
    that ``manage.py check`` may never see. Silent outside a Celery task.
    """
    if sys.modules.get("celery") is None:
        return
    from celery import current_task

    if not current_task or str(current_task.name) in _warned_timeouts:
        return
    name = str(current_task.name)
    _warned_timeouts.add(name)
    limits = getattr(current_task.request, "timelimit", None) or (None, None)
    hard = limits[0] or current_task.time_limit or current_task.app.conf.task_time_limit
    if hard is not None and timedelta(seconds=float(hard)) > lease:
        logger.warning(
            "Task %s may run for %ss (its time limit), longer than its idempotency lease "
            "(%ss): a redelivery after the lease takes a running body over. Give "
            "idempotent_task(lease=...) at least the time limit.",
            name,
            hard,
            lease.total_seconds(),
        )
    visibility = broker_visibility_timeout(current_task.app)
    longest = max(lease.total_seconds(), float(hard or 0))
    if visibility is not None and visibility < longest:
        logger.warning(
            "Task %s may run for %ss (its lease or time limit), but the broker delivers an "
            "unacknowledged message again after %ss (visibility_timeout): a second worker "
            "gets the message while the first still runs it. Raise visibility_timeout.",
            name,
            longest,
            visibility,
        )
