"""Spans for the protection's steps, through the OpenTelemetry API.

``idempotency.claim``, ``idempotency.view``, ``idempotency.complete``,
``idempotency.begin_external`` and ``idempotency.replay``, each an INTERNAL
span under whatever span is current: the request's span of
opentelemetry-instrumentation-django, a Celery task's. They carry
``idempotency.operation`` and what the step found
(``idempotency.outcome``); never the key, never the tenant. The database
statements inside them are the database instrumentation's spans
(psycopg's, say), with the semantic conventions' ``db.*`` attributes.

Off with ``IDEMPOTENCY["TRACING"] = False``; nothing is done without the
OpenTelemetry API, nor before an SDK's tracer provider is set (the API's
spans would record nothing).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from django_idempotency import __version__
from django_idempotency._observability.providers import trace_api, tracer_provider_set
from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpResponseBase

    from django_idempotency.scope import Scope


logger = logging.getLogger("django_idempotency")

SPAN_NAMES = (
    "idempotency.claim",
    "idempotency.view",
    "idempotency.complete",
    "idempotency.begin_external",
    "idempotency.replay",
)


@functools.cache
def _tracer() -> Any:
    api = trace_api()
    return None if api is None else api.get_tracer("django_idempotency", __version__)


def _active_tracer() -> Any:
    """The tracer, or None when tracing is off or nothing would record the spans.

    Until an SDK's TracerProvider is set, the API's spans record nothing;
    making them anyway cost 5 microseconds each against under 2 for this
    check (benchmarks/telemetry_cost.py), which reads the API's global
    rather than the environment (``providers``). Asked on every call, so a
    provider set later is used from then on.
    """
    if not tracer_provider_set() or not idempotency_settings.TRACING:
        return None
    return _tracer()


def recording_spans() -> bool:
    """Whether a span made now would be recorded (tracing on, an SDK's provider set)."""
    return _active_tracer() is not None


class _NoSpan:
    """What a step span is when tracing is off: attributes go nowhere."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass


#: What a step's block yields when nothing records spans.
NO_SPAN = _NoSpan()
#: The block a step is in when nothing records spans: no generator, no span.
_NO_SPAN_BLOCK = contextlib.nullcontext(NO_SPAN)


def step_span(
    name: str, scope: Scope, *, expected: Callable[[BaseException], str | None] | None = None
) -> AbstractContextManager[Any]:
    """A span named ``name`` around a step of ``scope``'s protection.

    Yields the span, for the step to add what it found (``set_attribute``).
    An exception leaving the block is recorded on it and marks it an error,
    unless ``expected`` names it an ordinary outcome (a claim that waited
    out its bound is a 409, not a failure): then that name is the span's
    ``idempotency.outcome``.

    A tracing SDK that fails (a span processor raising as the span starts
    or ends) is logged and never fails the step: the span ends after the
    claim has committed, and a request failing there would leave its
    record claimed until the lease runs out.
    """
    tracer = _active_tracer()
    if tracer is None:
        return _NO_SPAN_BLOCK  # every step of every request, with tracing unused
    return _recorded_step(tracer, name, scope, expected)


@contextlib.contextmanager
def _recorded_step(
    tracer: Any,
    name: str,
    scope: Scope,
    expected: Callable[[BaseException], str | None] | None,
) -> Iterator[Any]:
    try:
        opened = tracer.start_as_current_span(
            name,
            attributes={"idempotency.operation": scope.operation},
            record_exception=False,
            set_status_on_exception=False,
        )
        span = opened.__enter__()
    except Exception:
        logger.exception("The %s span could not be started; the request goes on.", name)
        yield NO_SPAN
        return
    try:
        yield span
    except BaseException as exc:
        _end(name, opened, span, exc, expected)
        raise
    _end(name, opened, span, None, expected)


def _end(
    name: str,
    opened: Any,
    span: Any,
    exc: BaseException | None,
    expected: Callable[[BaseException], str | None] | None,
) -> None:
    try:
        if exc is not None:
            from opentelemetry.trace import Status, StatusCode

            outcome = expected(exc) if expected is not None else None
            if outcome is not None:
                span.set_attribute("idempotency.outcome", outcome)
            else:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            opened.__exit__(type(exc), exc, exc.__traceback__)
        else:
            opened.__exit__(None, None, None)
    except Exception as failure:
        if failure is not exc:
            logger.exception("The %s span could not be ended; the request goes on.", name)


def describe_current_span(attributes: Callable[[], Mapping[str, str | int | bool]]) -> None:
    """Set a protected request's (or task run's) outcome on the span current as it ends.

    That span is the request's own (opentelemetry-instrumentation-django's
    server span, started when the request was), a Celery task's, or
    whatever the project made current around the view; the step spans have
    all ended by then. Set once, from the outcome; ``attributes`` is called
    only when there is a recording span (no work per request otherwise).
    """
    if _active_tracer() is None:
        return
    trace = trace_api()
    try:
        span = trace.get_current_span()  # type: ignore[union-attr]
        if span.is_recording():
            span.set_attributes(dict(attributes()))
    except Exception:
        logger.exception("The request's span could not be described; the request goes on.")


def contended(exc: BaseException) -> str | None:
    """ "contended" for a claim that waited out its bound (answered 409), else None."""
    from django_idempotency._store.errors import is_contention

    return "contended" if is_contention(exc) else None


def traced_view(
    scope: Scope, view: Callable[[], HttpResponseBase]
) -> Callable[[], HttpResponseBase]:
    """``view``, inside an ``idempotency.view`` span that says how it answered.

    A 5xx response is an error of the span, like an exception: DRF turns a
    view's ``APIException`` into a response before the span ends, and a
    provider's failure answered with 502 would otherwise look clean.
    """
    if _active_tracer() is None:
        return view

    def run() -> HttpResponseBase:
        with step_span("idempotency.view", scope) as span:
            response = view()
            span.set_attribute("http.response.status_code", response.status_code)
            if response.status_code >= 500:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR))
            return response

    return run
