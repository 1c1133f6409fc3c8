"""``idempotent_task``: a redelivered Celery message runs its side effect once.

Consumer-side deduplication, the task counterpart of ``protection`` (whose
request flow it shares through ``store.claim_or_take_over``). The public
path is ``django_idempotency.tasks.idempotent_task``.

Message brokers deliver at least once: with ``acks_late`` a worker that dies
mid-task gets its message redelivered, and producers retry too. The key
comes from the message itself (an event id), not from the delivery.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

from django.db import transaction

from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.exceptions import StaleOwner, TaskInProgress, TaskKeyReused
from django_idempotency.fingerprint import fingerprint
from django_idempotency.responses import StoredResponse, Verdict

__all__ = [
    "TASK_TENANT",
    "idempotent_task",
]

logger = logging.getLogger("django_idempotency")
Task = TypeVar("Task", bound=Callable[..., Any])

#: The tenant of task records: tasks act for the system, not for a client.
TASK_TENANT = "task"


def _key_of(key: str | Callable[..., Any], func: Callable[..., Any], args: Any, kwargs: Any) -> str:
    # Imported here, not above: this module is imported from settings files
    # (through tasks.py), before the app registry is ready.
    from django_idempotency.models import KEY_MAX_LENGTH

    if callable(key):
        value = str(key(*args, **kwargs))
    else:
        value = str(inspect.signature(func).bind(*args, **kwargs).arguments[key])
    if len(value) > KEY_MAX_LENGTH or value.startswith("sha256:"):
        # Message ids are not ours to limit: a long one is kept by its digest
        # (and one that looks like a digest is digested too, never confused).
        return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return value


def _arguments(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    bound = inspect.signature(func).bind(*args, **kwargs)
    # charge(e, 5) and charge(e, 5, fail=False) are the same call.
    bound.apply_defaults()
    # A bound task's first argument is the Task itself, not input.
    return {name: value for name, value in bound.arguments.items() if name != "self"}


def idempotent_task(
    key: str | Callable[..., Any],
    *,
    operation: str | None = None,
    ttl: timedelta | float | None = None,
    lease: timedelta | float | None = None,
) -> Callable[[Task], Task]:
    """Run the decorated task body once per key; duplicates return its result.

    The body's database writes and the stored result commit in one
    transaction; the result must be JSON-serialisable, and every run returns
    it as JSON gives it back (the first run too). Place it under Celery's
    decorator:

    ```python
    @shared_task(bind=True, acks_late=True, autoretry_for=(TaskInProgress,))
    @idempotent_task(key="event_id")
    def ship_order(self, event_id, order_id): ...
    ```

    Args:
        key: The name of the argument holding the message's id, or a
            callable taking the task's arguments and returning it. An id
            longer than 255 characters is stored by its SHA-256 digest.
        operation: The records' operation name; ``None``:
            ``"task <module>.<qualname>"``.
        ttl: How long the result is kept for duplicates, in seconds or as a
            ``timedelta``; ``None``: ``IDEMPOTENCY["TTL"]``.
        lease: How long a run holds the key, in seconds or as a
            ``timedelta``; ``None``: ``IDEMPOTENCY["LEASE"]``. It must outlast
            the body: a duplicate arriving after it takes the task over.
            Give it your task's time limit.

    With ``IDEMPOTENCY["DATABASE"] = None`` the routers pick the record's
    database once per run: ``db_for_write(IdempotencyRecord, tenant="task",
    operation=..., request=None, task=<the function>, arguments={name:
    value})``. The body runs in a transaction on that database: write its
    rows there (``.using()``, picking the alias from the arguments as the
    router does).

    Returns:
        The decorator.

    Raises:
        TaskInProgress: (from the task) Another worker runs the same key
            right now, or took it over.
        TaskKeyReused: (from the task) The key was used with other arguments.
    """

    def decorate(func: Task) -> Task:
        name = operation or f"task {func.__module__}.{func.__qualname__}"

        @functools.wraps(func)
        def run_once(*args: Any, **kwargs: Any) -> Any:
            from django_idempotency import store
            from django_idempotency.databases import database_for
            from django_idempotency.scope import Scope

            conf = idempotency_settings
            scope = Scope(TASK_TENANT, name, _key_of(key, func, args, kwargs))
            arguments = _arguments(func, args, kwargs)
            digest = fingerprint(arguments)
            # Asked once per run; a router may route by the task's arguments.
            database = database_for(scope, task=func, arguments=arguments)
            retention = as_timedelta(ttl) if ttl is not None else conf.TTL
            held_for = as_timedelta(lease) if lease is not None else conf.LEASE
            attempt = store.claim_or_take_over(
                scope, digest, ttl=retention, lease=held_for, using=database
            )
            held, record = attempt.held, attempt.record
            if held is None:
                if record is not None and not digest.matches(record.fingerprint):
                    raise TaskKeyReused(f"{scope} was used with other arguments")
                if record is not None and record.is_resolved:
                    logger.info("Duplicate message for %s: returning the stored result", scope)
                    _, stored_body = store.unseal(
                        record.response_headers,
                        record.response_body,
                        sealed=record.response_sealed,
                    )
                    return json.loads(stored_body or b"null")
                raise TaskInProgress(f"{scope} is being handled by another worker")
            try:
                with transaction.atomic(using=database):
                    result = func(*args, **kwargs)
                    body = json.dumps(result).encode("utf-8")
                    stored = StoredResponse(200, [["Content-Type", "application/json"]], body)
                    store.complete(held, Verdict.COMPLETED, stored, ttl=retention)
            except StaleOwner:
                raise TaskInProgress(f"{scope} was taken over by another worker") from None
            except BaseException:
                # Nothing committed: a redelivery (or a Celery retry) runs it again.
                store.release(held)
                raise
            return json.loads(body)

        return cast(Task, run_once)

    return decorate
