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
OpenTelemetry API, and little without an SDK (the API's spans are then
non-recording).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from django_idempotency import __version__
from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django_idempotency.scope import Scope

__all__ = ["SPAN_NAMES", "step_span", "traced"]

SPAN_NAMES = (
    "idempotency.claim",
    "idempotency.view",
    "idempotency.complete",
    "idempotency.begin_external",
    "idempotency.replay",
)

T = TypeVar("T")


@functools.cache
def _tracer() -> Any:
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_tracer("django_idempotency", __version__)


class _NoSpan:
    """What a step span is when tracing is off: attributes go nowhere."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass


_NO_SPAN = _NoSpan()


@contextlib.contextmanager
def step_span(name: str, scope: Scope) -> Iterator[Any]:
    """A span named ``name`` around a step of ``scope``'s protection.

    Yields the span, for the step to add what it found (``set_attribute``).
    An exception leaving the block is recorded on it and marks it an error,
    as the OpenTelemetry API does by default.
    """
    tracer = _tracer() if idempotency_settings.TRACING else None
    if tracer is None:
        yield _NO_SPAN
        return
    with tracer.start_as_current_span(
        name, attributes={"idempotency.operation": scope.operation}
    ) as span:
        yield span


def traced(name: str, scope: Scope, call: Callable[[], T]) -> Callable[[], T]:
    """``call``, run inside ``step_span(name, scope)``."""
    if not idempotency_settings.TRACING or _tracer() is None:
        return call

    def run() -> T:
        with step_span(name, scope):
            return call()

    return run
