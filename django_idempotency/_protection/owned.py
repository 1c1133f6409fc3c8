"""The view run by the owner of a claim, and what its failure leaves behind.

The view's writes and the stored outcome commit in one transaction; a view
that fails releases the claim, or, once an external call has begun, leaves
the record UNCERTAIN for a reconciler. A database error is answered with
what is known of the outcome (``OutcomeUncertain`` when the commit or an
external call may have happened).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import DatabaseError, InterfaceError, transaction

from django_idempotency import _store as store
from django_idempotency import signals
from django_idempotency._observability.tracing import step_span
from django_idempotency._protection.answers import (
    IN_FLIGHT_RETRY_AFTER,
    UNREACHABLE_ERRORS,
)
from django_idempotency._protection.crash import SimulatedCrash
from django_idempotency._protection.outcome import Tally
from django_idempotency._protection.transactions import (
    view_transactions,
    writes_discarded,
)
from django_idempotency._store.connections import close_independent_connections
from django_idempotency._store.errors import is_connection_lost
from django_idempotency.conf import idempotency_settings
from django_idempotency.context import IdempotencyContext
from django_idempotency.exceptions import (
    OutcomeUncertain,
    RequestInProgress,
    RolledBackResponse,
    StaleOwner,
    StoreUnavailable,
)
from django_idempotency.outcomes import Outcome
from django_idempotency.responses import StoredResponse, Verdict, capture
from django_idempotency.scope import Scope

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase


logger = logging.getLogger("django_idempotency")


class _Step(enum.Enum):
    """How far a claimed request got: what a database error then means."""

    VIEW = "view"
    COMPLETING = "completing"
    COMMITTING = "committing"


def _complete(held: store.Claim, verdict: Verdict, stored: StoredResponse, ttl: timedelta) -> None:
    with step_span("idempotency.complete", held.scope) as span:
        span.set_attribute("idempotency.outcome", verdict.value)
        store.complete(held, verdict, stored, ttl=ttl)


def run_owned(
    request: HttpRequest,
    tally: Tally,
    held: store.Claim,
    view: Callable[[], HttpResponseBase],
    ttl: timedelta,
    outcome: Outcome,
) -> HttpResponseBase:
    conf = idempotency_settings
    store_after: StoredResponse | None = None
    context = IdempotencyContext(held)
    step = _Step.VIEW
    try:
        request.idempotency = context  # type: ignore[attr-defined]
        # Documented to come before the view runs: the one signal not sent
        # with the request's outcome, at its end.
        tally.claimed = True
        signals.notify(
            signals.request_claimed, request, held.scope, fencing_token=held.fencing_token
        )
        # The view's writes and the stored outcome commit in one transaction:
        # a crash leaves both or neither.
        with view_transactions(records_database=held.database) as opened:
            response = view()
            step = _Step.COMPLETING
            verdict = outcome(response)
            if verdict in (Verdict.RELEASE, Verdict.UNCERTAIN):
                # The retry, or the reconciler, starts from a clean slate.
                for alias in opened:
                    transaction.set_rollback(True, using=alias)
            elif verdict is Verdict.COMPLETED and writes_discarded():
                raise rolled_back_success(held.scope, response)
            else:
                stored = capture(response, conf.STORED_HEADERS, conf.MAX_STORED_BODY)
                if transaction.get_rollback(using=held.database):
                    # DRF's exception handler marked the transaction for
                    # rollback (it does under ATOMIC_REQUESTS): the view's
                    # writes are undone, so the refusal is stored on its own.
                    store_after = stored
                else:
                    _complete(held, verdict, stored, ttl)
            step = _Step.COMMITTING
        if store_after is not None:
            step = _Step.COMPLETING
            _complete(held, verdict, store_after, ttl)
    except StaleOwner:
        tally.in_flight_state = "taken over"
        raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER) from None
    except SimulatedCrash:
        raise  # a "killed" process cleans nothing up (testing helper)
    except (DatabaseError, InterfaceError) as exc:
        lost = is_connection_lost(exc)
        released = give_up(
            tally, held, context, reason="store unavailable" if lost else "exception"
        )
        _answer_a_database_error(held, context, step, exc, released=released)
        raise
    except BaseException:
        give_up(tally, held, context, reason="exception")
        raise
    finally:
        # The second connection begin_external() may have opened is this
        # request's alone: close it now, not at request_finished, which may
        # run on another thread (ASGI).
        close_independent_connections()
    if verdict is Verdict.RELEASE:
        give_up(tally, held, context, reason=response.status_code)
    elif verdict is Verdict.UNCERTAIN:
        _leave_uncertain(tally, held, context, reason=response.status_code)
    else:
        note_stored(tally, verdict, response.status_code)
    return response


def _answer_a_database_error(
    held: store.Claim, context: IdempotencyContext, step: _Step, exc: Exception, *, released: bool
) -> None:
    """Raise the refusal that says what is known after a database error; else return.

    The claim is already released (``released``), or the record left
    UNCERTAIN. A view's own error (a deadlock, a timeout, a bug) returns: it
    is re-raised as it is.
    """
    lost = is_connection_lost(exc)
    lease_seconds = max(1, round(idempotency_settings.LEASE.total_seconds()))
    committed_maybe = step is _Step.COMMITTING and lost and not released
    if committed_maybe or (step is not _Step.VIEW and context.external_begun):
        # The commit may have happened (a CLAIMED record deleted by the
        # release proves it did not), or an external call did and its
        # outcome could not be recorded: never "not run".
        logger.error("Could not record the outcome of %s (%s); answering 503.", held.scope, exc)
        raise OutcomeUncertain(retry_after=lease_seconds) from exc
    if lost:
        # The store went away: the view's writes rolled back with its session.
        logger.error("Idempotency store lost during %s (%s); answering 503.", held.scope, exc)
        if context.external_begun:
            raise OutcomeUncertain(retry_after=lease_seconds) from exc
        raise StoreUnavailable(retry_after=lease_seconds) from exc


def note_stored(tally: Tally, verdict: Verdict, status: int) -> None:
    tally.stored_state = verdict.value
    tally.stored_status = status


def give_up(
    tally: Tally, held: store.Claim, context: IdempotencyContext, *, reason: object
) -> bool:
    """The view failed: release the claim, or, after an external call began,
    leave the record UNCERTAIN, since the call may have happened. Whether it
    was released."""
    if not context.external_begun:
        return _release(tally, held, reason=reason)
    try:
        context.leave_uncertain()
    except (StaleOwner, DatabaseError, InterfaceError) as exc:
        log_unsettled(exc, f"mark {held.scope} uncertain", "recovery finds it once its lease ends")
        return False
    logger.warning(
        "%s failed (%s) after begin_external(): left UNCERTAIN for a reconciler.",
        held.scope,
        reason,
    )
    tally.uncertain_reason = reason
    return False


def _leave_uncertain(
    tally: Tally, held: store.Claim, context: IdempotencyContext, *, reason: object
) -> None:
    """The outcome policy called the answer uncertain: a reconciler settles the record.

    Without ``begin_external()`` the provider key written is the one the view
    could read as ``request.idempotency.provider_key``.
    """
    try:
        context.leave_uncertain(with_provider_key=True)
    except (StaleOwner, DatabaseError, InterfaceError) as exc:
        log_unsettled(exc, f"mark {held.scope} uncertain", "recovery finds it once its lease ends")
        return
    logger.warning("%s answered %s: left UNCERTAIN for a reconciler.", held.scope, reason)
    tally.uncertain_reason = reason


def log_unsettled(exc: Exception, write: str, afterwards: str) -> None:
    """A release or mark-uncertain failed: the record waits for its lease to end."""
    if isinstance(exc, UNREACHABLE_ERRORS):
        # Most likely the store is gone, the reason we are here. The error
        # says it all (a lost connection, a deadlock...): no traceback.
        logger.error(
            "Could not %s (%s: %s); %s.", write, type(exc).__name__, str(exc).strip(), afterwards
        )
    else:  # taken over meanwhile, or a bug
        logger.exception("Could not %s", write)


def _release(tally: Tally, held: store.Claim, *, reason: object) -> bool:
    try:
        released = store.release(held)
    except (StaleOwner, DatabaseError, InterfaceError) as exc:
        log_unsettled(
            exc, f"release the claim on {held.scope}", "it stays CLAIMED until its lease ends"
        )
        return False
    if released:
        tally.release_reason = reason
    return released


def rolled_back_success(scope: Scope, response: HttpResponseBase) -> RolledBackResponse:
    return RolledBackResponse(
        f"The view answered {response.status_code} for {scope}, but its transaction "
        "(on one of its databases) was marked for rollback (a database error caught "
        "without a savepoint?), so its writes are discarded. Not stored; the claim is "
        "released and the retry runs. Wrap the statement that may fail in its own "
        "transaction.atomic() block."
    )
