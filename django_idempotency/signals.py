"""Signals sent for each outcome, so projects can count them.

Every signal is sent with ``sender=IdempotencyRecord`` and the keyword
arguments ``request`` and ``scope`` (a ``Scope``: tenant, operation, key).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.dispatch import Signal

if TYPE_CHECKING:
    from django.http import HttpRequest

    from django_idempotency.scope import Scope

__all__ = [
    "claim_released",
    "key_expired",
    "key_reused",
    "notify",
    "record_uncertain",
    "record_unreconciled",
    "request_claimed",
    "request_in_flight",
    "response_replayed",
    "response_stored",
    "store_unavailable",
]

logger = logging.getLogger("django_idempotency")

request_claimed = Signal()
"""This request won the claim (or took an abandoned one over) and runs the view.

Also sent with ``fencing_token``.
"""

response_stored = Signal()
"""The view's outcome was stored: ``state`` (COMPLETED or FAILED), ``status``."""

response_replayed = Signal()
"""A stored response was replayed: ``status``."""

request_in_flight = Signal()
"""Refused with 409: another request holds the key (``state``).

``state``: the record's state, "unknown", "taken over", "contended" (a wait
on another session's lock ran out) or "released" (see docs/signals.md).
"""

key_reused = Signal()
"""Refused with 422: the key was used with different input."""

key_expired = Signal()
"""Refused with 422: the key is past retention, kept as a tombstone (``TOMBSTONE_TTL``)."""

claim_released = Signal()
"""The claim was given up so that a retry runs.

``reason``: "exception", "store unavailable", the status code of an answer
that is not stored, or from recovery "recovery" (a CLAIMED record) or
"reconciled" (a reconciler's ``Release()``).
"""

record_uncertain = Signal()
"""A view failed after ``begin_external()``: the record is UNCERTAIN.

It stays so until a reconciler or an operator resolves it (``reason``:
"exception", "store unavailable" or the status code).
"""

record_unreconciled = Signal()
"""Recovery found no reconciler for an unresolved record's operation.

The record stays UNCERTAIN; sent with ``record``, and ``request`` is None.
"""

store_unavailable = Signal()
"""The record store could not be reached (``fail_open``: whether the view ran)."""


def notify(signal: Signal, request: HttpRequest | None, scope: Scope, **kwargs: Any) -> None:
    """Send ``signal``; a failing receiver is logged, never fails the request.

    Receivers count things. A metrics backend that is down must not turn a
    replay into a 500, nor leave a claim behind that nobody releases. (The
    package's own metrics do not listen here: they count the request's
    outcome beside its signals, ``_protection.outcome.announce``.)
    """
    if not signal.receivers:
        return  # the common case, on every request: nothing to build or look up
    from django_idempotency.models import IdempotencyRecord

    for receiver, result in signal.send_robust(
        IdempotencyRecord, request=request, scope=scope, **kwargs
    ):
        if isinstance(result, Exception):
            logger.error(
                "Signal receiver %r raised; the request goes on.",
                receiver,
                exc_info=(type(result), result, result.__traceback__),
            )
