"""``idempotent_task``: a task run twice for one key runs its side effect once.

Consumer-side deduplication, the task counterpart of ``protection`` (whose
request flow it shares through ``store.claim_or_take_over``). One run loop
for every framework that calls the decorated function: Celery
(``celery_task`` says what it adds: a bound task's request, the message id,
its timeouts) and Django's Tasks framework (``django_task``: the context a
``takes_context`` task is called with). The public paths are
``django_idempotency.idempotent_task``, ``django_idempotency.tasks`` (Celery)
and ``django_idempotency.django_tasks``; none of them needs Celery to import.

Message brokers deliver at least once: with ``acks_late`` a worker that dies
mid-task gets its message redelivered, and producers retry too; a Tasks
framework task is enqueued again by whoever wants it run. The key comes
from the task's arguments (an event id), or from the Celery message id
(``message_id``) when the arguments carry none.

The running body reaches its claim as views do: ``self.request.idempotency``
in a bound Celery task, ``task_idempotency()`` anywhere in the body. A body
that fails after ``begin_external()`` leaves the record UNCERTAIN for the
reconciler of the task's operation; no later run of the key runs it again.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, transaction

from django_idempotency._names import check_operation_spec
from django_idempotency._observability import labels
from django_idempotency._observability.tracing import describe_current_span
from django_idempotency._protection import celery_task, django_task
from django_idempotency._protection.crash import SimulatedCrash
from django_idempotency._store.errors import is_contention
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.exceptions import (
    StaleOwner,
    TaskFailed,
    TaskInProgress,
    TaskKeyMissing,
    TaskKeyReused,
    TaskOutcomeUncertain,
)
from django_idempotency.fingerprint import fingerprint
from django_idempotency.responses import StoredResponse, Verdict

if TYPE_CHECKING:
    from django_idempotency import _store as store
    from django_idempotency.context import IdempotencyContext
    from django_idempotency.models import IdempotencyRecord
    from django_idempotency.scope import Scope


logger = logging.getLogger("django_idempotency")
Task = TypeVar("Task", bound=Callable[..., Any])

#: The tenant of task records: tasks act for the system, not for a client.
TASK_TENANT = "task"


#: The claim of the body running in this thread (or coroutine): set only
#: while an ``idempotent_task`` body runs.
_running: ContextVar[IdempotencyContext | None] = ContextVar("idempotent_task", default=None)

#: The lease of every ``idempotent_task`` decorated so far, by function
#: (``None``: ``IDEMPOTENCY["LEASE"]``), for the visibility-timeout check.
_leases: dict[Callable[..., Any], timedelta | None] = {}


def task_idempotency() -> IdempotencyContext:
    """The ``IdempotencyContext`` of the ``idempotent_task`` body running now.

    What ``request.idempotency`` is to a view, for a task: call it anywhere
    in the body (or in a function the body calls), bound task or not. A
    bound task may also use ``self.request.idempotency``, the same object.

    ```python
    @shared_task(acks_late=True, reject_on_worker_lost=True)
    @idempotent_task(key="payout_id")
    def send_payout(payout_id, amount):
        claim = task_idempotency()
        provider_key = claim.begin_external()
        transfer = provider.transfer(amount, idempotency_key=provider_key)
        claim.set_provider_operation(transfer.id)
        return {"transfer": transfer.id}
    ```

    Returns:
        The running body's claim: ``begin_external()``,
        ``set_provider_operation()``, ``renew_lease()``, ``fencing_token``,
        ``provider_key``.

    Raises:
        RuntimeError: No ``idempotent_task`` body is running in this thread
            (outside the body, or in a thread it started: pass the context
            along instead).
    """
    context = _running.get()
    if context is None:
        raise RuntimeError(
            "task_idempotency() is only available while the body of an idempotent_task runs."
        )
    return context


def idempotent_task_leases() -> dict[Callable[..., Any], timedelta | None]:
    """Every ``idempotent_task`` decorated so far and its ``lease=`` (``None``: the setting's).

    Keyed by the function ``idempotent_task`` returned (``idempotent_body``
    finds it from a task's ``run``), for the system check comparing leases
    with the broker's visibility timeout.
    """
    return dict(_leases)


def idempotent_body(run: Callable[..., Any]) -> Callable[..., Any] | None:
    """The ``idempotent_task`` function a Celery task's ``run`` is or wraps, else ``None``.

    ``task.run`` is rarely that function itself: a bound task's is a method
    of it, and ``autoretry_for`` (the layout the docs show) replaces it with
    Celery's own wrapper, which keeps the one it wraps as ``__wrapped__``, as
    any ``functools.wraps`` decorator between the two does. The chain is
    followed down to the first function ``idempotent_task`` made (that one
    wraps the body too: going further would lose it).
    """
    seen: set[int] = set()
    candidate: Any = run
    while candidate is not None and id(candidate) not in seen:
        seen.add(id(candidate))
        candidate = getattr(candidate, "__func__", candidate)
        try:
            if candidate in _leases:
                return cast(Callable[..., Any], candidate)
        except TypeError:  # an unhashable callable is no function of ours
            pass
        candidate = getattr(candidate, "__wrapped__", None)
    return None


def _key_of(key: str | Callable[..., Any], func: Callable[..., Any], args: Any, kwargs: Any) -> str:
    # Imported here, not above: this module is imported from settings files
    # (through tasks.py), before the app registry is ready.
    from django_idempotency.models import KEY_MAX_LENGTH

    # A callable is called as the function is: a bound task's self, a context, included.
    found = key(*args, **kwargs) if callable(key) else _argument_named(key, func, args, kwargs)
    if found is None or (isinstance(found, str) and not found):
        # Messages without an id are no duplicates of one another: kept under
        # "None" (or ""), each would get the first one's result.
        if callable(key):
            source = f"its key callable {getattr(key, '__qualname__', key)!r} returned {found!r}"
        else:
            source = f"its key argument {key!r} is {found!r}"
        raise TaskKeyMissing(
            f"{func.__module__}.{func.__qualname__} was called with no key ({source}): "
            "nothing ran. Send the message's id."
        )
    value = str(found)
    if len(value) > KEY_MAX_LENGTH or value.startswith("sha256:"):
        # Message ids are not ours to limit: a long one is kept by its digest
        # (and one that looks like a digest is digested too, never confused).
        return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return value


def _argument_named(name: str, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """The value of the argument ``name`` in this call, its default applied; None if absent.

    Passed under ``**kwargs`` too, for a body that takes its fields that way.
    """
    signature = inspect.signature(func)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    if name in signature.parameters:
        return bound.arguments.get(name)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return bound.arguments.get(parameter.name, {}).get(name)
    return None


def _check_key_names_an_argument(key: str | Callable[..., Any], func: Callable[..., Any]) -> None:
    """Refuse, at import, a key naming no argument: every message would fail on it."""
    if callable(key):
        return
    if not isinstance(key, str):
        raise ImproperlyConfigured(
            f"idempotent_task(key={key!r}) must name an argument (a string) or be a callable."
        )
    parameters = inspect.signature(func).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if key not in parameters and not takes_any:
        raise ImproperlyConfigured(
            f"idempotent_task(key={key!r}) on {func.__qualname__}: the function has no "
            f"argument of that name (it takes {', '.join(parameters) or 'none'}). Name the "
            "argument holding the message's id, or give a callable."
        )


def _arguments(func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    bound = inspect.signature(func).bind(*args, **kwargs)
    # charge(e, 5) and charge(e, 5, fail=False) are the same call.
    bound.apply_defaults()
    # A bound task's first argument is the Task itself, a takes_context
    # task's the TaskContext: the worker's, not input.
    return {
        name: value
        for name, value in bound.arguments.items()
        if name != "self" and not django_task.is_task_context(value)
    }


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
    decorator, or under the ``@task`` of Django's Tasks framework:

    ```python
    @shared_task(bind=True, acks_late=True, autoretry_for=(TaskInProgress,))
    @idempotent_task(key="event_id")
    def ship_order(self, event_id, order_id): ...


    @task(takes_context=True)  # django.tasks, or the django-tasks backport
    @idempotent_task(key="event_id")
    def ship_parcel(context, event_id, order_id): ...
    ```

    A bound Celery task's ``self`` and a Tasks framework ``context`` are not
    part of the arguments compared between runs. The body must be a plain
    function (``async def`` is refused: its writes could not commit with
    the stored result).

    The body reaches its claim through ``self.request.idempotency`` (bound
    Celery tasks) or ``task_idempotency()``: an ``IdempotencyContext``, as
    ``request.idempotency`` in a view. Around a call to a provider,
    ``begin_external()`` commits the intent first; if the body then raises
    (or its worker dies), the record is left UNCERTAIN for the reconciler
    registered for the task's operation (``register_reconciler("task
    <module>.<qualname>")``), and no delivery of the message runs the body
    again; the reconciler's ``Completed`` body becomes the result
    duplicates get.

    Args:
        key: The name of the argument holding the message's id (its
            default applied when it is left out), or a callable taking the
            task's arguments and returning it (``message_id``: the Celery
            message's id). An id longer than 255 characters is stored by
            its SHA-256 digest.
        operation: The records' operation name, 1 to 255 printable
            characters; ``None``: ``"task <module>.<qualname>"``.
        ttl: How long the result is kept for duplicates, in seconds or as a
            ``timedelta``; ``None``: ``IDEMPOTENCY["TTL"]``.
        lease: How long a run holds the key, in seconds or as a
            ``timedelta``; ``None``: ``IDEMPOTENCY["LEASE"]``. It must outlast
            the body: a duplicate arriving after it takes the task over.
            Give it your task's time limit (a longer time limit is logged
            as a warning), and keep the broker's visibility timeout longer
            (system check W020).

    With ``IDEMPOTENCY["DATABASE"] = None`` the routers pick the record's
    database once per run: ``db_for_write(IdempotencyRecord, tenant="task",
    operation=..., request=None, task=<the function>, arguments={name:
    value})``. The body runs in a transaction on that database: write its
    rows there (``.using()``, picking the alias from the arguments as the
    router does).

    Returns:
        The decorator.

    Raises:
        ImproperlyConfigured: (when decorating) ``operation`` is no name a
            record can hold: empty, longer than 255 characters, holding a
            control or unprintable character, or not a string; ``key``
            names no argument of the function; or the decorated function
            is an ``async def``, or already a Tasks framework ``Task``
            (``@idempotent_task`` placed above ``@task``).
        TaskKeyMissing: (from the task) The key is ``None`` or empty: the
            message carries no id. Nothing ran.
        TaskInProgress: (from the task) Another worker runs the same key
            right now, or took it over.
        TaskOutcomeUncertain: (from the task) A run of the same key began an
            external call and did not finish: the reconciler settles it.
        TaskFailed: (from the task) The record was settled as FAILED.
        TaskKeyReused: (from the task) The key was used with other arguments.
    """

    if operation is not None and not isinstance(operation, str):
        raise ImproperlyConfigured(
            f"idempotent_task(operation={operation!r}) must be a name (a string) or None."
        )

    def decorate(func: Task) -> Task:
        _check_decorated(func)
        _check_key_names_an_argument(key, func)
        name = f"task {func.__module__}.{func.__qualname__}" if operation is None else operation
        # Judged once, here, as a view's fixed name is: a name no record can
        # hold fails at import, not at the first message's claim. _names
        # imports no model: task modules load before Django's apps are ready.
        check_operation_spec(name)
        labels.declare(name)  # written in the code: a metrics label in every process

        @functools.wraps(func)
        def run_once(*args: Any, **kwargs: Any) -> Any:
            from django_idempotency import _store as store
            from django_idempotency._store.routing import database_for
            from django_idempotency.scope import Scope

            conf = idempotency_settings
            scope = Scope(TASK_TENANT, name, _key_of(key, func, args, kwargs))
            ended = _Ended()
            try:
                arguments = _arguments(func, args, kwargs)
                digest = fingerprint(arguments)
                # Asked once per run; a router may route by the task's arguments.
                database = database_for(scope, task=func, arguments=arguments)
                retention = as_timedelta(ttl) if ttl is not None else conf.TTL
                held_for = as_timedelta(lease) if lease is not None else conf.LEASE
                celery_task.warn_about_timeouts(held_for)
                try:
                    attempt = store.claim_or_take_over(
                        scope, digest, ttl=retention, lease=held_for, using=database
                    )
                except DatabaseError as exc:
                    # A takeover that ran out of IN_FLIGHT_WAIT on a row another
                    # session locked: the key is busy, not the database down.
                    if not is_contention(exc):
                        raise
                    raise TaskInProgress(f"{scope} is held by another session") from exc
                held, record = attempt.held, attempt.record
                if held is None:
                    if record is not None and not digest.matches(record.fingerprint):
                        raise TaskKeyReused(f"{scope} was used with other arguments")
                    if record is not None and record.is_resolved:
                        ended.kind = "replayed"
                        return _stored_result(record, scope)
                    _refuse_unresolved(record, scope)
                return _run_owned(func, args, kwargs, held, retention, ended)
            except BaseException as exc:
                ended.failed_with(exc)
                raise
            finally:
                _announce(ended.outcome(scope))

        _leases[run_once] = as_timedelta(lease) if lease is not None else None
        return cast(Task, run_once)

    return decorate


def _check_decorated(func: Callable[..., Any]) -> None:
    """Refuse, at import, a function no run of which could be kept once."""
    if django_task.is_task(func):
        body = getattr(func, "func", func)
        raise ImproperlyConfigured(
            f"idempotent_task was placed above @task on {body.__qualname__}: place it "
            "under @task, directly above the function, so that the worker runs it."
        )
    if inspect.iscoroutinefunction(func):
        raise ImproperlyConfigured(
            f"idempotent_task cannot protect the async function {func.__qualname__}: its "
            "database writes would not share the transaction that stores its result. "
            "Make the task a plain def (the Tasks framework and Celery both run it)."
        )


def _run_owned(
    func: Callable[..., Any],
    args: Any,
    kwargs: Any,
    held: store.Claim,
    retention: timedelta,
    ended: _Ended,
) -> Any:
    """Run the body as the owner of ``held``; store its result with its writes."""
    from django_idempotency import _store as store
    from django_idempotency.context import IdempotencyContext

    context = IdempotencyContext(held)
    try:
        with transaction.atomic(using=held.database), _exposed(context, args):
            result = func(*args, **kwargs)
            body = json.dumps(result).encode("utf-8")
            stored = StoredResponse(200, [["Content-Type", "application/json"]], body)
            store.complete(held, Verdict.COMPLETED, stored, ttl=retention)
    except StaleOwner:
        raise TaskInProgress(f"{held.scope} was taken over by another worker") from None
    except SimulatedCrash:
        raise  # a "killed" worker cleans nothing up (testing helper)
    except BaseException:
        if context.external_begun:
            # The provider may have been called: never "not run".
            ended.kind = "uncertain" if _leave_uncertain(held, context) else "unsettled"
        else:
            # Nothing committed: a redelivery (or a Celery retry) runs it again.
            store.release(held)
            ended.kind = "released"
        raise
    finally:
        # begin_external()'s second connection is this run's alone.
        store.close_independent_connections()
    ended.kind = "executed"
    return json.loads(body)


#: Exceptions that refuse a run, by the refusal they stand for.
_REFUSALS: dict[type[BaseException], str] = {
    TaskInProgress: "in_progress",
    TaskKeyReused: "key_reused",
    TaskOutcomeUncertain: "outcome_uncertain",
    TaskFailed: "failed",
}


@dataclass(frozen=True)
class TaskOutcome:
    """How one run of an idempotent task ended: the one value its announcement reads."""

    scope: Scope
    #: "executed" (the body ran and its result was stored), "replayed" (a
    #: duplicate got the stored result), "refused" (see ``refusal``),
    #: "released" (the body failed before any external call: a redelivery
    #: runs it), "uncertain" (it failed after one: left to the reconciler),
    #: "unsettled" (that could not be written: recovery finds it), "error"
    #: (the claim itself failed, or a duplicate's stored result could not be read).
    kind: str
    #: "in_progress", "key_reused", "outcome_uncertain" or "failed" when refused.
    refusal: str | None = None


class _Ended:
    """What a run has come to so far: written by its steps, frozen at the end."""

    __slots__ = ("kind", "refusal")

    def __init__(self) -> None:
        self.kind = "error"
        self.refusal: str | None = None

    def failed_with(self, exc: BaseException) -> None:
        if self.kind not in ("error", "replayed"):
            return  # the body ran: what became of it is said already
        refusal = _REFUSALS.get(type(exc))
        if refusal is not None:
            self.kind, self.refusal = "refused", refusal
        else:
            # The claim failed, or the stored result could not be read: no replay.
            self.kind = "error"

    def outcome(self, scope: Scope) -> TaskOutcome:
        return TaskOutcome(scope, self.kind, self.refusal)


def _announce(outcome: TaskOutcome) -> None:
    """Log the run's outcome and set it on the current span (a Celery task's), once."""
    scope = outcome.scope
    if outcome.kind == "replayed":
        logger.info("Duplicate message for %s: returning the stored result", scope)
    elif outcome.kind == "uncertain":
        logger.warning(
            "%s failed after begin_external(): left UNCERTAIN for the reconciler of %r.",
            scope,
            scope.operation,
        )
    describe_current_span(lambda: _span_attributes(outcome))


def _span_attributes(outcome: TaskOutcome) -> dict[str, str | int | bool]:
    attributes: dict[str, str | int | bool] = {
        "idempotency.operation": outcome.scope.operation,
        "idempotency.task.outcome": outcome.kind,
    }
    if outcome.refusal is not None:
        attributes["idempotency.refusal"] = outcome.refusal
    return attributes


@contextmanager
def _exposed(context: IdempotencyContext, args: Any) -> Iterator[None]:
    """``task_idempotency()`` and ``self.request.idempotency`` while the body runs."""
    request = celery_task.bound_request(args)
    token = _running.set(context)
    if request is not None:
        request.idempotency = context
    try:
        yield
    finally:
        _running.reset(token)
        if request is not None:
            request.idempotency = None


def _leave_uncertain(held: store.Claim, context: IdempotencyContext) -> bool:
    """The body failed after ``begin_external()``: leave the record UNCERTAIN.

    The same write as a view's (``IdempotencyContext.leave_uncertain``): the
    record's provider key and id and every step the run began, written again
    in case they rolled back with the body's transaction.
    """
    from django.db import DatabaseError, InterfaceError

    try:
        context.leave_uncertain()
    except (StaleOwner, DatabaseError, InterfaceError):
        logger.exception(
            "Could not mark %s uncertain; recovery finds it once its lease ends.", held.scope
        )
        return False
    return True


def _stored_result(record: IdempotencyRecord, scope: Any) -> Any:
    """What a duplicate of a resolved record returns (or raises, if it FAILED)."""
    from django_idempotency import _store as store

    _, stored_body = store.unseal(
        record.response_headers, record.response_body, sealed=record.response_sealed
    )
    try:
        result = json.loads(stored_body or b"null")
    except ValueError:
        # A reconciler may store any text (Completed(body="...")): given as it is.
        result = (stored_body or b"").decode("utf-8", "replace")
    if record.state == record.State.FAILED:
        raise TaskFailed(f"{scope} was settled as FAILED by its reconciler", result)
    return result


def _refuse_unresolved(record: IdempotencyRecord | None, scope: Any) -> NoReturn:
    """Raise what a delivery meets when another run holds the key."""
    if record is not None and _left_to_the_reconciler(record):
        raise TaskOutcomeUncertain(
            f"{scope}: an earlier run began an external call and did not finish "
            f"(record {record.state}); not run again. The reconciler registered for "
            f"{scope.operation!r} settles it; duplicates then get its result."
        )
    raise TaskInProgress(f"{scope} is being handled by another worker")


def _left_to_the_reconciler(record: IdempotencyRecord) -> bool:
    """UNCERTAIN, or IN_PROGRESS whose owner's lease ran out: no owner will finish it."""
    State = record.State
    if record.state == State.UNCERTAIN:
        return True
    if record.state != State.IN_PROGRESS or record.lease_expires_at is None:
        return False
    from django_idempotency._store.database_time import time_left

    # As store.claims judges a takeover: the database's time of the lookup.
    return time_left(record, record.lease_expires_at) <= timedelta(0)
