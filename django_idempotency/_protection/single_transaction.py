"""``single_transaction``: claim, view and completion in one transaction.

PostgreSQL only, for views without external calls: one commit instead of
two. Anything this path cannot settle itself (a key held by a request of
the two-commit kind, an expired record, a snapshot that cannot see a
committed duplicate) goes back to the general path in ``protection``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import DatabaseError, transaction

from django_idempotency import _store as store
from django_idempotency import signals
from django_idempotency._observability.tracing import contended, step_span
from django_idempotency._protection.answers import (
    UNAVAILABLE_RETRY_AFTER,
    UNREACHABLE_ERRORS,
    answer_settled,
    in_flight,
    store_unavailable,
)
from django_idempotency._protection.owned import (
    leave_uncertain_afresh,
    log_unsettled,
    rolled_back_success,
    signal_stored,
)
from django_idempotency._protection.transactions import (
    view_transactions,
    writes_discarded,
)
from django_idempotency._store.digests import Fingerprint
from django_idempotency._store.errors import (
    is_connection_lost,
    is_contention,
    is_serialization_failure,
)
from django_idempotency.conf import idempotency_settings
from django_idempotency.context import IdempotencyContext
from django_idempotency.exceptions import (
    OutcomeUncertain,
    StaleOwner,
    StoreUnavailable,
)
from django_idempotency.outcomes import Outcome, standard
from django_idempotency.responses import StoredResponse, Verdict, capture
from django_idempotency.scope import Scope

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase


logger = logging.getLogger("django_idempotency")


def claim_in_one_transaction(
    request: HttpRequest,
    scope: Scope,
    fingerprint: Fingerprint,
    view: Callable[[], HttpResponseBase],
    ttl: timedelta,
    *,
    database: str,
    outcome: Outcome = standard,
) -> HttpResponseBase | None:
    """Claim, view and completion in ONE transaction; None: take the general path.

    One commit instead of two. A concurrent duplicate's INSERT waits on the
    unique index until this transaction ends (bounded by ``lock_timeout`` =
    IN_FLIGHT_WAIT, then 409), and then replays the committed outcome; a
    crash, an exception or a retryable status rolls the claim back with the
    view's writes, so the retry runs.
    """
    conf = idempotency_settings
    held: store.Claim | None = None
    run: _SingleRun | None = None
    try:
        with transaction.atomic(using=database):
            with step_span("idempotency.claim", scope, expected=contended) as span:
                held = store.claim(
                    scope,
                    fingerprint,
                    ttl=ttl,
                    lease=conf.LEASE,
                    using=database,
                    wait_at_most=conf.IN_FLIGHT_WAIT,
                )
                if held is None:
                    record = store.lookup(scope, using=database)
                    span.set_attribute("idempotency.outcome", "held")
                    if record is not None:
                        span.set_attribute("idempotency.record.state", record.state)
                else:
                    span.set_attribute("idempotency.outcome", "claimed")
                    span.set_attribute("idempotency.fencing_token", held.fencing_token)
            if held is not None:
                request.idempotency = IdempotencyContext(held, single_transaction=True)  # type: ignore[attr-defined]
                signals.notify(
                    signals.request_claimed, request, scope, fencing_token=held.fencing_token
                )
                run = _view_in_the_claims_transaction(held, view, ttl, outcome)
    except UNREACHABLE_ERRORS as exc:
        if held is None:  # the claim or the lookup: the only outage FAIL_OPEN may answer
            if is_serialization_failure(exc):
                # A duplicate committed the key while this claim waited on it,
                # and the snapshot (REPEATABLE READ) cannot see it: look again.
                return None
            if is_contention(exc):
                in_flight(request, scope, state="waited", cause=exc)
            return store_unavailable(request, scope, view, exc)
        if run is not None and is_connection_lost(exc):
            # Lost while committing: it may have committed, so nothing is
            # said to be released either.
            logger.error("Could not learn whether %s committed (%s); answering 503.", scope, exc)
            raise OutcomeUncertain(retry_after=UNAVAILABLE_RETRY_AFTER) from exc
        signals.notify(signals.claim_released, request, scope, reason="exception")
        if not is_connection_lost(exc):
            raise  # the view's own error (a deadlock, a timeout...): a 500, the retry runs
        logger.error("Idempotency store lost during %s (%s); answering 503.", scope, exc)
        raise StoreUnavailable(retry_after=UNAVAILABLE_RETRY_AFTER) from exc
    except BaseException:
        if held is not None:
            signals.notify(signals.claim_released, request, scope, reason="exception")
        raise
    if run is not None:
        return _settle_single_run(request, fingerprint, run, ttl)
    settled = record is not None and (
        not fingerprint.matches(record.fingerprint) or record.is_resolved
    )
    if record is not None and settled and not store.past_retention(record):
        return answer_settled(request, scope, fingerprint, record)
    # Held by a request of the two-commit kind, expired or just released:
    # the general path handles all of these.
    return None


@dataclass(frozen=True)
class _SingleRun:
    """What the view of a single-transaction claim answered, and what became of it."""

    held: store.Claim
    response: HttpResponseBase
    verdict: Verdict
    #: Stored with the view's writes and the claim, in their transaction.
    stored: bool
    #: A definitive 4xx from a transaction marked for rollback (DRF does so
    #: under ATOMIC_REQUESTS): the claim went with it, so it is stored afresh.
    store_after: StoredResponse | None = None
    #: The outcome policy called the answer uncertain: the claim rolled back
    #: with the view's writes, so the record is claimed afresh and so marked.
    uncertain: bool = False


def _view_in_the_claims_transaction(
    held: store.Claim, view: Callable[[], HttpResponseBase], ttl: timedelta, outcome: Outcome
) -> _SingleRun:
    conf = idempotency_settings
    with view_transactions() as opened:  # other ATOMIC_REQUESTS databases
        response = view()
        verdict = outcome(response)
        rolled_back = transaction.get_rollback(using=held.database)
        if verdict is Verdict.COMPLETED and writes_discarded():
            raise rolled_back_success(held.scope, response)
        if verdict in (Verdict.RELEASE, Verdict.UNCERTAIN) or rolled_back:
            # Roll everything back, the claim included: the retry runs (an
            # uncertain record is claimed afresh after, by _settle_single_run).
            for alias in [held.database, *opened]:
                transaction.set_rollback(True, using=alias)
        if verdict is Verdict.RELEASE:
            return _SingleRun(held, response, verdict, stored=False)
        if verdict is Verdict.UNCERTAIN:
            return _SingleRun(held, response, verdict, stored=False, uncertain=True)
        stored = capture(response, conf.STORED_HEADERS, conf.MAX_STORED_BODY)
        if rolled_back:
            return _SingleRun(held, response, verdict, stored=False, store_after=stored)
        with step_span("idempotency.complete", held.scope) as span:
            span.set_attribute("idempotency.outcome", verdict.value)
            store.complete(held, verdict, stored, ttl=ttl)
        return _SingleRun(held, response, verdict, stored=True)


def _settle_single_run(
    request: HttpRequest, fingerprint: Fingerprint, run: _SingleRun, ttl: timedelta
) -> HttpResponseBase:
    """After the commit: store a rolled-back refusal afresh; tell what was stored."""
    status = run.response.status_code
    stored = run.stored
    if run.uncertain:
        return leave_uncertain_afresh(
            request, run.held.scope, fingerprint, run.response, ttl, run.held.database
        )
    if run.store_after is not None:
        conf = idempotency_settings
        try:
            again = store.claim(
                run.held.scope, fingerprint, ttl=ttl, lease=conf.LEASE, using=run.held.database
            )
            if again is not None:
                store.complete(again, run.verdict, run.store_after, ttl=ttl)
                stored = True
        except (StaleOwner, DatabaseError) as exc:
            log_unsettled(exc, f"store the refusal of {run.held.scope}", "its retry runs again")
    if stored:
        signal_stored(request, run.held, run.verdict, status)
    else:
        signals.notify(signals.claim_released, request, run.held.scope, reason=status)
    return run.response
