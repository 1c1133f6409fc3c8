"""What a protected request ended with, and its announcement: once, at the end.

The flow notes what it learns on a ``Tally`` as it goes (plain attribute
writes: no branch calls back into this module); ``protect()`` turns it
into one frozen ``RequestOutcome`` when the request is answered, and
``announce`` sends the outcome signals and counts the metrics from that
value alone, and sets it on the request's span. ``request_claimed`` is the
one exception, sent where the view is about to run, as documented; the
step spans are made where their steps run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django_idempotency import signals
from django_idempotency._observability import recording, tracing

if TYPE_CHECKING:
    from django.dispatch import Signal
    from django.http import HttpRequest

    from django_idempotency.scope import Scope


logger = logging.getLogger("django_idempotency")


#: Refusals by their code, as the ``outcome`` label; any other (no key, a
#: key too long, a body too large or unreadable) is refused input, "rejected".
_REFUSAL_LABELS = {
    "idempotency_key_reused": "key_reused",
    "idempotency_key_expired": "key_expired",
    "idempotency_request_in_progress": "in_flight",
    "idempotency_store_unavailable": "store_unavailable",
    "idempotency_outcome_uncertain": "outcome_uncertain",
}


class Tally:
    """What one protected request has learnt so far; written by the flow as it goes.

    Every field but ``started`` starts as its class's default: most stay
    so, and a request writes only what it learns.
    """

    scope: Scope | None = None
    #: Where the key came from, as refusals name it ("the body field
    #: 'id'"); None for the client's Idempotency-Key header.
    key_source: str | None = None
    #: The operation of a request refused before it had a scope.
    operation: str | None = None
    #: Whether the operation's name is the route's or a literal one.
    operation_from_code = False
    claimed = False
    view_ran = False
    view_seconds = 0.0
    stored_state: str | None = None
    stored_status: int | None = None
    replayed = False
    replayed_status: int | None = None
    refusal: str | None = None
    in_flight_state: str | None = None
    release_reason: object = None
    uncertain_reason: object = None
    store_unreachable = False
    fail_open = False

    def __init__(self) -> None:
        self.started = time.perf_counter()


@dataclass(frozen=True)
class RequestOutcome:
    """How one protected request ended: the one value its announcement reads."""

    scope: Scope | None
    operation: str | None
    #: Its name is the route's or a literal one: a metrics label of its own.
    operation_from_code: bool
    #: "executed", "replayed", "refused", "unprotected" or "error" (an
    #: exception that is no refusal, before any view ran).
    kind: str
    #: The refusal's ``code`` when refused.
    refusal: str | None
    #: The record's state a 409 met ("taken over", "contended"...).
    in_flight_state: str | None
    #: COMPLETED or FAILED, and the status, when the view's answer was stored.
    stored_state: str | None
    stored_status: int | None
    replayed: bool
    replayed_status: int | None
    #: Why the claim was given up (``claim_released``), when it was.
    release_reason: object
    #: Why the record was left UNCERTAIN (``record_uncertain``), when it was.
    uncertain_reason: object
    #: The store could not be reached at the claim (``store_unavailable``).
    store_unreachable: bool
    fail_open: bool
    #: The protection's own time, the view's taken out, and the view's.
    protection_seconds: float
    view_seconds: float

    @property
    def label(self) -> str:
        """The ``outcome`` label of ``idempotency_requests_total``."""
        if self.refusal is not None:
            return _REFUSAL_LABELS.get(self.refusal, "rejected")
        return self.kind

    @property
    def released(self) -> bool:
        return self.release_reason is not None

    @property
    def uncertain(self) -> bool:
        return self.uncertain_reason is not None


def finish(tally: Tally, refusal: BaseException | None) -> RequestOutcome:
    """The tally, frozen: what the request ended with, ``refusal`` if refused."""
    code = getattr(refusal, "default_code", None) if refusal is not None else None
    if code is not None:
        kind = "refused"
    elif tally.store_unreachable and tally.fail_open:
        kind = "unprotected"
    elif tally.replayed:
        kind = "replayed"  # an optimistic loser's view ran, and the winner answered
    elif tally.claimed or tally.view_ran:
        kind = "executed"
    else:
        kind = "error"
    elapsed = time.perf_counter() - tally.started - tally.view_seconds
    return RequestOutcome(
        scope=tally.scope,
        operation=tally.scope.operation if tally.scope is not None else tally.operation,
        operation_from_code=tally.operation_from_code,
        kind=kind,
        refusal=str(code) if code is not None else None,
        in_flight_state=tally.in_flight_state,
        stored_state=tally.stored_state,
        stored_status=tally.stored_status,
        replayed=tally.replayed,
        replayed_status=tally.replayed_status,
        release_reason=tally.release_reason,
        uncertain_reason=tally.uncertain_reason,
        store_unreachable=tally.store_unreachable,
        fail_open=tally.fail_open,
        protection_seconds=elapsed,
        view_seconds=tally.view_seconds,
    )


#: The signals ``announce`` sends, whichever the outcome calls for.
_OUTCOME_SIGNALS = (
    signals.store_unavailable,
    signals.record_uncertain,
    signals.claim_released,
    signals.response_stored,
    signals.response_replayed,
    signals.key_reused,
    signals.key_expired,
    signals.request_in_flight,
)


def observed() -> bool:
    """Whether anything would hear of a request's outcome: a receiver, a metrics sink, a span.

    Asked at the end of every protected request: with no receiver connected
    to the outcome signals, no metrics backend and no tracing SDK (the
    common case), the outcome is neither frozen nor announced. Asked each
    time, so a receiver connected later hears of the next request.
    """
    for signal in _OUTCOME_SIGNALS:
        if signal.receivers:
            return True
    return recording.receiving() or tracing.recording_spans()


def announce(request: HttpRequest, outcome: RequestOutcome) -> None:
    """Send the outcome's signals, count it and set it on the request's span.

    In the order the events happened: the unreachable store, then what
    became of the claim, then the answer.
    """
    scope = outcome.scope
    if scope is not None:
        for signal, arguments in _signals_of(outcome):
            signals.notify(signal, request, scope, **arguments)
    try:
        _count(outcome)
    except Exception:  # counting must never replace the answer
        logger.exception("Counting the request failed; the request goes on.")
    if outcome.operation is not None:
        tracing.describe_current_span(lambda: span_attributes(outcome))


def span_attributes(outcome: RequestOutcome) -> dict[str, str | int | bool]:
    """What the request's span says of it: never the key, never the tenant."""
    assert outcome.operation is not None
    attributes: dict[str, str | int | bool] = {
        "idempotency.operation": outcome.operation,
        "idempotency.request.outcome": outcome.label,
        "idempotency.replayed": outcome.replayed,
    }
    if outcome.refusal is not None:
        attributes["idempotency.refusal"] = outcome.refusal
    if outcome.stored_state is not None:
        attributes["idempotency.record.state"] = outcome.stored_state
    elif outcome.uncertain:
        attributes["idempotency.record.state"] = "UNCERTAIN"
    if outcome.released:
        attributes["idempotency.release.reason"] = recording.release_label(outcome.release_reason)
    return attributes


def _signals_of(outcome: RequestOutcome) -> list[tuple[Signal, dict[str, object]]]:
    sent: list[tuple[Signal, dict[str, object]]] = []
    if outcome.store_unreachable:
        sent.append((signals.store_unavailable, {"fail_open": outcome.fail_open}))
    if outcome.uncertain:
        sent.append((signals.record_uncertain, {"reason": outcome.uncertain_reason}))
    if outcome.released:
        sent.append((signals.claim_released, {"reason": outcome.release_reason}))
    if outcome.stored_state is not None:
        stored = (outcome.stored_state, outcome.stored_status)
        sent.append((signals.response_stored, {"state": stored[0], "status": stored[1]}))
    if outcome.replayed:
        sent.append((signals.response_replayed, {"status": outcome.replayed_status}))
    if outcome.refusal == "idempotency_key_reused":
        sent.append((signals.key_reused, {}))
    elif outcome.refusal == "idempotency_key_expired":
        sent.append((signals.key_expired, {}))
    elif outcome.in_flight_state is not None:
        sent.append((signals.request_in_flight, {"state": outcome.in_flight_state}))
    return sent


def _count(outcome: RequestOutcome) -> None:
    if not recording.receiving():
        return
    operation = outcome.operation
    if operation is None:
        return  # not a protected request after all
    from_code = outcome.operation_from_code
    if outcome.released:
        recording.count_release(operation, outcome.release_reason, from_code=from_code)
    if outcome.uncertain:
        recording.count_uncertain(operation, from_code=from_code)
    tenant = outcome.scope.tenant if outcome.scope is not None else None
    recording.count_request(
        operation, outcome.label, outcome.protection_seconds, tenant=tenant, from_code=from_code
    )
