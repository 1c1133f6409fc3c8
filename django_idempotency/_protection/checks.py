"""System checks of the request's settings, and of the Celery tasks the package runs.

The key (``HEADER`` E002, ``KEY_MAX_LENGTH`` E004), the scope (``TENANT``
E007, ``OPERATION_NAMES`` E022), duplicates in flight (``IN_FLIGHT`` E009),
retention against the lease (E014), what is stored of a response
(``STORED_HEADERS`` E012, ``MAX_STORED_BODY`` E013) and which answers are
stored (``OUTCOME`` E041), the refusals
(``ERROR_FORMAT`` E015, ``PROBLEM_TYPE_BASE`` E016,
``MAX_FINGERPRINTED_BODY`` E019), and a task's lease against Celery's
limits (W020, W021). Registered by ``django_idempotency.checks``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

from django.core.checks import CheckMessage, Warning
from django.core.exceptions import ImproperlyConfigured

from django_idempotency._checks import (
    HEADER_NAME,
    ConfigurationCheck,
    Validator,
    error,
    is_count,
    positive_duration,
)
from django_idempotency.conf import DEFAULTS, as_timedelta, idempotency_settings, import_callable
from django_idempotency.models import KEY_MAX_LENGTH
from django_idempotency.scope import OPERATION_NAMES


def _check_header(value: Any) -> Iterator[CheckMessage]:
    if not isinstance(value, str) or not HEADER_NAME.match(value):
        yield error(
            2,
            f"IDEMPOTENCY['HEADER'] = {value!r} is not a valid HTTP header name.",
            "Use a header name such as 'Idempotency-Key' (letters, digits and '-').",
        )


def _check_key_max_length(value: Any) -> Iterator[CheckMessage]:
    if not is_count(value, least=1) or value > KEY_MAX_LENGTH:
        yield error(
            4,
            f"IDEMPOTENCY['KEY_MAX_LENGTH'] = {value!r} is not an integer from 1 to "
            f"{KEY_MAX_LENGTH}.",
            f"The key column holds {KEY_MAX_LENGTH} characters; Stripe documents 255.",
        )


def _check_tenant(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, str):
        try:
            import_callable(value, "TENANT")
        except ImproperlyConfigured as exc:
            yield error(
                7,
                str(exc),
                "Give a callable taking the request and returning the tenant as a "
                "string, or its dotted import path.",
            )
    elif not callable(value):
        yield error(
            7,
            f"IDEMPOTENCY['TENANT'] = {value!r} is neither callable nor a dotted path.",
            "Give a callable taking the request and returning the tenant as a string, "
            "or its dotted import path.",
        )


def _check_outcome(value: Any) -> Iterator[CheckMessage]:
    hint = (
        "Give an outcome policy: a callable taking the view's response and returning a "
        "Verdict (django_idempotency.outcomes.by_status(...), say), its dotted import path, "
        "or None for outcomes.standard."
    )
    if isinstance(value, str):
        try:
            import_callable(value, "OUTCOME")
        except ImproperlyConfigured as exc:
            yield error(41, str(exc), hint)
    elif value is not None and not callable(value):
        yield error(
            41, f"IDEMPOTENCY['OUTCOME'] = {value!r} is neither callable nor a dotted path.", hint
        )


def _check_in_flight(value: Any) -> Iterator[CheckMessage]:
    if value not in ("conflict", "wait"):
        yield error(
            9,
            f"IDEMPOTENCY['IN_FLIGHT'] = {value!r} is not 'conflict' or 'wait'.",
            "'conflict' answers 409 at once; 'wait' waits up to IN_FLIGHT_WAIT for "
            "the first request to finish, then replays its response.",
        )


def _check_stored_headers(value: Any) -> Iterator[CheckMessage]:
    if (
        isinstance(value, str)
        or not isinstance(value, (list, tuple))
        or not all(isinstance(name, str) and HEADER_NAME.match(name) for name in value)
    ):
        yield error(
            12,
            f"IDEMPOTENCY['STORED_HEADERS'] = {value!r} is not a list of header names.",
            "List further response headers to store and replay, e.g. ['ETag'].",
        )


def _check_max_stored_body(value: Any) -> Iterator[CheckMessage]:
    if not is_count(value, least=0):
        yield error(
            13,
            f"IDEMPOTENCY['MAX_STORED_BODY'] = {value!r} is not a number of bytes.",
            "Give a non-negative integer; bodies larger than this are not stored.",
        )


def _check_error_format(value: Any) -> Iterator[CheckMessage]:
    if value not in ("drf", "problem"):
        yield error(
            15,
            f"IDEMPOTENCY['ERROR_FORMAT'] = {value!r} is not 'drf' or 'problem'.",
            '\'drf\' raises refusals for your EXCEPTION_HANDLER ({"detail", "code"}); '
            "'problem' answers with RFC 9457 application/problem+json.",
        )


def _check_problem_type_base(value: Any) -> Iterator[CheckMessage]:
    if not isinstance(value, str):
        yield error(
            16,
            f"IDEMPOTENCY['PROBLEM_TYPE_BASE'] = {value!r} is not a string.",
            "Give the URI that, followed by an error code, documents the error.",
        )


def _check_max_fingerprinted_body(value: Any) -> Iterator[CheckMessage]:
    if not is_count(value, least=1):
        yield error(
            19,
            f"IDEMPOTENCY['MAX_FINGERPRINTED_BODY'] = {value!r} is not a positive number of bytes.",
            "Protected requests with a larger body are refused with 413.",
        )


def _check_operation_names(value: Any) -> Iterator[CheckMessage]:
    if value not in OPERATION_NAMES:
        yield error(
            22,
            f"IDEMPOTENCY['OPERATION_NAMES'] = {value!r} is not one of "
            f"{', '.join(map(repr, OPERATION_NAMES))}.",
            "'pattern' (the default) names an operation by its route pattern, "
            "'normalised' writes the URL arguments as {name}, 'route_name' uses the "
            "URL's name. Changing it renames operations: drain unresolved records first "
            "(see the settings reference).",
        )


VALIDATORS: Mapping[str, Validator] = {
    "HEADER": _check_header,
    "KEY_MAX_LENGTH": _check_key_max_length,
    "TENANT": _check_tenant,
    "IN_FLIGHT": _check_in_flight,
    "STORED_HEADERS": _check_stored_headers,
    "MAX_STORED_BODY": _check_max_stored_body,
    "OUTCOME": _check_outcome,
    "ERROR_FORMAT": _check_error_format,
    "PROBLEM_TYPE_BASE": _check_problem_type_base,
    "MAX_FINGERPRINTED_BODY": _check_max_fingerprinted_body,
    "OPERATION_NAMES": _check_operation_names,
}


def _check_retention_outlasts_the_lease(user_settings: Mapping[str, Any]) -> Iterator[CheckMessage]:
    ttl = user_settings.get("TTL", DEFAULTS["TTL"])
    lease = user_settings.get("LEASE", DEFAULTS["LEASE"])
    if (
        positive_duration(ttl)
        and positive_duration(lease)
        and as_timedelta(ttl) < as_timedelta(lease)
    ):
        yield error(
            14,
            "IDEMPOTENCY['TTL'] is shorter than IDEMPOTENCY['LEASE'].",
            "Retention must outlast the lease, or a record could be forgotten "
            "while its request still runs. Raise TTL or lower LEASE.",
        )


CONFIGURATION_CHECKS: tuple[ConfigurationCheck, ...] = (_check_retention_outlasts_the_lease,)


def check_celery_timeouts(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W020: a broker visibility timeout shorter than an idempotent task may run; W021:
    a task's time limit longer than its lease.

    Judged on Celery's current app (the project's, once its module is
    imported, as Django projects do in their package's ``__init__``) and the
    ``idempotent_task`` tasks imported by the time checks run (a task module
    that only workers import is judged by the worker instead: the first run
    of each task logs the same warnings). Silent without Celery.
    """
    try:
        from celery import current_app
    except ImportError:
        return []
    from django_idempotency._protection.celery_task import broker_visibility_timeout
    from django_idempotency._protection.task import idempotent_body, idempotent_task_leases

    # An invalid LEASE is E006's to report: the tasks that use it are not judged.
    setting = idempotency_settings.value_of("LEASE")
    default_lease = idempotency_settings.LEASE if positive_duration(setting) else None
    app: Any = current_app
    visibility = broker_visibility_timeout(app)
    leases = idempotent_task_leases()
    messages: list[CheckMessage] = []
    for name, task in sorted(app.tasks.items()):
        body = idempotent_body(task.run)
        if body is None:
            continue
        lease = leases[body] or default_lease
        if lease is None:
            continue
        limit = task.time_limit or app.conf.task_time_limit
        if limit is not None and timedelta(seconds=float(limit)) > lease:
            messages.append(
                Warning(
                    f"The idempotent task {name!r} may run for {float(limit):g}s (its time "
                    f"limit), longer than its lease ({lease.total_seconds():g}s): a "
                    "redelivery arriving after the lease takes over a body that is still "
                    "running.",
                    hint="Give idempotent_task(lease=...) at least the task's time_limit.",
                    obj=name,
                    id="django_idempotency.W021",
                )
            )
        longest = max(lease.total_seconds(), float(limit or 0))
        if visibility is not None and visibility < longest:
            messages.append(
                Warning(
                    "The broker delivers an unacknowledged message again after "
                    f"its visibility_timeout of {visibility:g}s, but the idempotent task "
                    f"{name!r} may run for {longest:g}s (its lease or time limit): a run "
                    "still going is delivered to a second worker, whose copy waits on "
                    "TaskInProgress retries, or takes the key over once the lease ran out.",
                    hint="Set CELERY_BROKER_TRANSPORT_OPTIONS = {'visibility_timeout': ...} "
                    "longer than every idempotent task's lease and time limit (Celery's "
                    "default is 3600 s on Redis).",
                    obj=name,
                    id="django_idempotency.W020",
                )
            )
    return messages
