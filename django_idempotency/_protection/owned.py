"""The default mode: the view run by the owner of a claim, and what its failure leaves.

The run itself is ``run``'s, with this mode's ``Recording``: the view's
writes and the completion of the claim commit in one transaction. A view
that fails releases the claim, or, once an external call has begun, leaves
the record UNCERTAIN for a reconciler. A database error is answered with
what is known of the outcome (``run.what_a_lost_store_means``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
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
from django_idempotency._protection.run import Phase, Progress, run_view, what_a_lost_store_means
from django_idempotency._protection.transactions import (
    view_transactions,
)
from django_idempotency._store.connections import close_independent_connections
from django_idempotency._store.errors import is_connection_lost
from django_idempotency.conf import idempotency_settings
from django_idempotency.context import IdempotencyContext
from django_idempotency.exceptions import (
    RequestInProgress,
    StaleOwner,
)
from django_idempotency.outcomes import Outcome
from django_idempotency.responses import StoredResponse, Verdict

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase


logger = logging.getLogger("django_idempotency")


class _OwnedRecording:
    """The default mode's part of the run: the view's writes and the claim's
    completion commit in one transaction, so a crash leaves both or neither."""

    refuses_a_rolled_back_success_at_once = True

    def __init__(self, held: store.Claim, ttl: timedelta) -> None:
        self.held = held
        self.scope = held.scope
        self.ttl = ttl

    def transactions(self) -> AbstractContextManager[list[str]]:
        return view_transactions(records_database=self.held.database)

    def refusal_discarded(self) -> bool:
        # DRF's exception handler marked the transaction for rollback (it
        # does under ATOMIC_REQUESTS).
        return transaction.get_rollback(using=self.held.database)

    def write(self, verdict: Verdict, stored: StoredResponse) -> bool:
        _complete(self.held, verdict, stored, self.ttl)
        return True  # or StaleOwner: taken over meanwhile


def _complete(held: store.Claim, verdict: Verdict, stored: StoredResponse, ttl: timedelta) -> None:
    with step_span("idempotency.complete", held.scope) as span:
        span.set_attribute("idempotency.outcome", verdict._value_)  # .value: two calls
        store.complete(held, verdict, stored, ttl=ttl)


def run_owned(
    request: HttpRequest,
    tally: Tally,
    held: store.Claim,
    view: Callable[[], HttpResponseBase],
    ttl: timedelta,
    outcome: Outcome,
) -> HttpResponseBase:
    context = IdempotencyContext(held)
    progress = Progress()
    try:
        request.idempotency = context  # type: ignore[attr-defined]
        # Documented to come before the view runs: the one signal not sent
        # with the request's outcome, at its end.
        tally.claimed = True
        signals.notify(
            signals.request_claimed, request, held.scope, fencing_token=held.fencing_token
        )
        ran = run_view(view, outcome, _OwnedRecording(held, ttl), progress)
        if ran.store_after is not None:
            progress.phase = Phase.COMPLETING
            _complete(held, ran.verdict, ran.store_after, ttl)
    except StaleOwner:
        tally.in_flight_state = "taken over"
        raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER) from None
    except SimulatedCrash:
        raise  # a "killed" process cleans nothing up (testing helper)
    except (DatabaseError, InterfaceError) as exc:
        reason = "store unavailable" if is_connection_lost(exc) else "exception"
        released = give_up(tally, held, context, reason=reason)
        refusal = what_a_lost_store_means(
            held.scope,
            exc,
            progress.phase,
            external_begun=context.external_begun,
            released=released,
            retry_after=max(1, round(idempotency_settings.LEASE.total_seconds())),
        )
        if refusal is not None:
            raise refusal from exc
        raise
    except BaseException:
        give_up(tally, held, context, reason="exception")
        raise
    finally:
        # The second connection begin_external() may have opened is this
        # request's alone: close it now, not at request_finished, which may
        # run on another thread (ASGI).
        close_independent_connections()
    status = ran.response.status_code
    if ran.verdict is Verdict.RELEASE:
        give_up(tally, held, context, reason=status)
    elif ran.verdict is Verdict.UNCERTAIN:
        _leave_uncertain(tally, held, context, reason=status)
    else:
        note_stored(tally, ran.verdict, status)
    return ran.response


def note_stored(tally: Tally, verdict: Verdict, status: int) -> None:
    tally.stored_state = verdict._value_
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
