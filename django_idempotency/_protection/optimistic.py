"""``optimistic``: the view runs first, and its record is written once, finished.

For views whose effects all live in the records' database. Nothing is
claimed before the view: a lookup of the key, in autocommit, answers a
settled record at once (a replay is that one statement, in no explicit
transaction); otherwise the view runs in its transaction, which ends with
one INSERT of the finished record (``store.record_finished``), which the
unique index on (tenant, operation, key) arbitrates. One commit, no
UPDATE, no dead row version.

The promise differs from the other modes': concurrent duplicates may each
run the view body, and exactly one commits. Every other one rolls back,
whatever stopped it (the record's INSERT lost, a business unique key, a
deadlock, a lock timeout, a serialization failure, an error the view
swallowed), looks the key up again and answers from the winner's record:
its replay, or 422 for other input; 409 only when it gave up waiting before
the winner committed. A key held by a request of the two-commit kind goes
to the general path in ``protection``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

from django.db import DatabaseError, InterfaceError, transaction

from django_idempotency import _store as store
from django_idempotency._observability.tracing import step_span
from django_idempotency._protection.answers import (
    UNAVAILABLE_RETRY_AFTER,
    UNREACHABLE_ERRORS,
    answer_settled,
    held,
    in_flight,
    store_unavailable,
)
from django_idempotency._protection.crash import SimulatedCrash
from django_idempotency._protection.outcome import Tally
from django_idempotency._protection.owned import log_unsettled, note_stored
from django_idempotency._protection.run import (
    Phase,
    Progress,
    Ran,
    rolled_back_success,
    run_view,
    what_a_lost_store_means,
)
from django_idempotency._protection.transactions import view_transactions, writes_discarded
from django_idempotency._store.digests import NOBODY, Fingerprint, Sender
from django_idempotency._store.errors import (
    is_connection_lost,
    is_contention,
    is_deadlock,
    is_serialization_failure,
)
from django_idempotency.conf import idempotency_settings
from django_idempotency.context import IdempotencyContext
from django_idempotency.exceptions import StoreUnavailable
from django_idempotency.models import IdempotencyRecord
from django_idempotency.outcomes import Outcome
from django_idempotency.responses import StoredResponse, Verdict
from django_idempotency.scope import Scope

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase


logger = logging.getLogger("django_idempotency")


class _OptimisticRecording:
    """The optimistic mode's part of the run: the view in its transaction, then
    one INSERT of its finished record (after the DELETE of the expired record
    it replaces, if any)."""

    refuses_a_rolled_back_success_at_once = False  # the winner answers first

    def __init__(
        self,
        scope: Scope,
        fingerprint: Fingerprint,
        ttl: timedelta,
        database: str,
        sender: Sender,
        replacing: IdempotencyRecord | None,
    ) -> None:
        self.scope = scope
        self.fingerprint = fingerprint
        self.ttl = ttl
        self.database = database
        self.sender = sender
        self.replacing = replacing

    @contextmanager
    def transactions(self) -> Iterator[list[str]]:
        with view_transactions() as opened:  # other ATOMIC_REQUESTS databases
            yield [self.database, *opened]

    def refusal_discarded(self) -> bool:
        return writes_discarded()

    def write(self, verdict: Verdict, stored: StoredResponse) -> bool:
        wait = idempotency_settings.IN_FLIGHT_WAIT
        with step_span("idempotency.complete", self.scope) as span:
            span.set_attribute("idempotency.outcome", verdict.value)
            if self.replacing is not None:
                # Here, not before the view: its wait bound (the DELETE's own)
                # then covers only our statements, and a run that rolls back
                # never took the expired record's row lock.
                store.discard_expired_waiting_at_most(
                    self.replacing, using=self.database, wait=wait
                )
            recorded = store.record_finished(
                self.scope,
                self.fingerprint,
                verdict,
                stored,
                ttl=self.ttl,
                using=self.database,
                sender=self.sender,
                wait=wait,
            )
            span.set_attribute("idempotency.recorded", recorded)
        return recorded


def run_optimistically(
    request: HttpRequest,
    tally: Tally,
    scope: Scope,
    fingerprint: Fingerprint,
    view: Callable[[], HttpResponseBase],
    ttl: timedelta,
    *,
    database: str,
    outcome: Outcome,
    sender: Sender = NOBODY,
) -> HttpResponseBase | None:
    """Look up (autocommit), then run the view and insert its finished record in one transaction.

    ``None``: the key is held by an unresolved record (a request of the
    two-commit kind, a record handed back) that may be taken over or waited
    for (``IN_FLIGHT`` "wait"): take the general path, which knows how.
    Any other unresolved record is refused at once (409, or 503 for one
    left UNCERTAIN), as the general path would.

    A deadlock or a serialization failure usually strikes a duplicate
    before the winner has committed, when no record answers yet: the
    transaction is tried again (the standard answer to both errors, and
    safe in this mode, whose view's writes all rolled back), up to
    ``_ATTEMPTS`` times within ``IN_FLIGHT_WAIT``, after a random pause. The
    next attempt waits on the winner's rows, then finds its record.
    """
    deadline = time.monotonic() + idempotency_settings.IN_FLIGHT_WAIT.total_seconds()
    for attempt in range(1, _ATTEMPTS + 1):
        started = time.monotonic()
        try:
            return _attempt(request, tally, fingerprint, view, ttl, database, outcome, sender)
        except _Retryable as retryable:
            exc = retryable.error
            answer = _the_winners_answer(tally, fingerprint, database)
            if answer is not None:
                return answer
            # At least as long as the attempt took: duplicates whose views take
            # longer than the pauses would otherwise start together again and
            # deadlock again, attempt after attempt (seen on MariaDB,
            # SERIALIZABLE, three duplicates with views of 0.3 s, under load,
            # which also ran out of six attempts: now ten, within the deadline).
            took = time.monotonic() - started
            pause = random.uniform(0, max(_FIRST_PAUSE * 2 ** (attempt - 1), took))
            if attempt == _ATTEMPTS or time.monotonic() + pause >= deadline:
                return _after_a_database_error(tally, fingerprint, view, database, Phase.VIEW, exc)
            logger.info("%s: %s; trying its transaction again.", scope, type(exc).__name__)
            # Duplicates that deadlocked together would meet again at once
            # (MariaDB's SERIALIZABLE lookups share locks on the key's gap).
            time.sleep(pause)
    raise AssertionError("unreachable")  # the last attempt returns or raises


#: How many times one request runs its transaction when a deadlock or a
#: serialization failure ends it, and the longest pause before the second
#: (doubled before each next one, a random part of it taken).
_ATTEMPTS = 10
_FIRST_PAUSE = 0.02


class _Retryable(Exception):
    """A deadlock or a serialization failure ended the transaction: it may be tried again."""

    def __init__(self, error: DatabaseError | InterfaceError) -> None:
        super().__init__(str(error))
        self.error = error


def _attempt(
    request: HttpRequest,
    tally: Tally,
    fingerprint: Fingerprint,
    view: Callable[[], HttpResponseBase],
    ttl: timedelta,
    database: str,
    outcome: Outcome,
    sender: Sender,
) -> HttpResponseBase | None:
    scope = tally.scope
    assert scope is not None
    progress = Progress(Phase.LOOKUP)
    record = None
    run: Ran | None = None
    try:
        # In autocommit, before any transaction: a replay (the common retry)
        # is this one statement. It takes no lock and waits on nobody: the
        # statements that may wait on a duplicate (the record's INSERT, the
        # expired record's DELETE) carry their own bound.
        record = store.lookup_to_answer(scope, using=database)
        replacing = record if record is not None and store.past_retention(record) else None
        if record is None or replacing is not None:
            progress.phase = Phase.VIEW
            # No record exists while the view runs: nothing to fence
            # (token 0), no lease to renew, no intent to commit before a call.
            unclaimed = store.Claim(record_id=0, fencing_token=0, scope=scope, database=database)
            request.idempotency = IdempotencyContext(unclaimed, optimistic=True)  # type: ignore[attr-defined]
            recording = _OptimisticRecording(scope, fingerprint, ttl, database, sender, replacing)
            with transaction.atomic(using=database):
                run = run_view(view, outcome, recording, progress)
    except SimulatedCrash:
        raise  # a "killed" process cleans nothing up (testing helper)
    except (DatabaseError, InterfaceError) as exc:
        retryable = is_deadlock(exc) or is_serialization_failure(exc)
        if progress.phase is not Phase.LOOKUP and retryable:
            raise _Retryable(exc) from exc
        return _after_a_database_error(tally, fingerprint, view, database, progress.phase, exc)
    except Exception as exc:
        # The view's own error, or one it raised on meeting a duplicate's
        # row (its own "order exists", say): the winner answers, if any.
        try:
            answer = _the_winners_answer(tally, fingerprint, database)
        except StoreUnavailable:
            answer = None  # the view's error tells more than this one
        if answer is None:
            tally.release_reason = "exception"
            raise exc
        return answer
    if run is None:
        assert record is not None
        if not fingerprint.matches(record.fingerprint) or record.is_resolved:
            return answer_settled(tally, fingerprint, record)
        if idempotency_settings.IN_FLIGHT == "conflict" and not store.abandoned(
            record, fingerprint
        ):
            # A live claim of the two-commit kind: the general path's claim
            # would find this very record and refuse; refused from the lookup.
            held(tally, record)
        return None  # to take over, or to wait for
    return _settle(tally, fingerprint, run, ttl, database, sender)


def _settle(
    tally: Tally,
    fingerprint: Fingerprint,
    run: Ran,
    ttl: timedelta,
    database: str,
    sender: Sender,
) -> HttpResponseBase:
    """After the transaction: the winner tells what it stored; anybody else asks the winner."""
    scope = tally.scope
    assert scope is not None
    status = run.response.status_code
    if run.recorded:
        note_stored(tally, run.verdict, status)
        return run.response
    # Rolled back: by losing the record's INSERT, or by the view or the
    # outcome policy, where a duplicate's row may be what made it fail (a
    # 409 or a 500 the view made of a unique key): the winner answers. An
    # answer the policy calls UNCERTAIN is released like a retryable one:
    # nothing outside the database ran in this mode, and its writes rolled
    # back, so nothing is uncertain, and a record claimed now to say so
    # could take the key from a duplicate still running.
    answer = _the_winners_answer(tally, fingerprint, database)
    if answer is not None:
        return answer
    if run.lost:  # taken, then gone again (released, purged): ask again later
        in_flight(tally, state="released")
    if run.discarded and run.verdict is Verdict.COMPLETED:
        raise rolled_back_success(scope, run.response)
    if run.store_after is not None:
        if _store_on_its_own(scope, fingerprint, run, ttl, database, sender):
            note_stored(tally, run.verdict, status)
            return run.response
        answer = _the_winners_answer(tally, fingerprint, database)
        if answer is not None:  # a duplicate's record, stored meanwhile
            return answer
    tally.release_reason = status
    return run.response


def _store_on_its_own(
    scope: Scope, fingerprint: Fingerprint, run: Ran, ttl: timedelta, database: str, sender: Sender
) -> bool:
    assert run.store_after is not None
    try:
        return store.record_finished(
            scope,
            fingerprint,
            run.verdict,
            run.store_after,
            ttl=ttl,
            using=database,
            sender=sender,
            wait=idempotency_settings.IN_FLIGHT_WAIT,
        )
    except DatabaseError as exc:
        log_unsettled(exc, f"store the refusal of {scope}", "its retry runs again")
        return False


def _after_a_database_error(
    tally: Tally,
    fingerprint: Fingerprint,
    view: Callable[[], HttpResponseBase],
    database: str,
    phase: Phase,
    exc: DatabaseError | InterfaceError,
) -> HttpResponseBase:
    """The transaction rolled back on a database error: say what is known."""
    scope = tally.scope
    assert scope is not None
    if phase is Phase.LOOKUP and is_connection_lost(exc):
        return store_unavailable(
            tally, view, exc
        )  # nothing ran: the one outage FAIL_OPEN may answer
    # Nothing was claimed, so nothing is released, and no call began.
    refusal = what_a_lost_store_means(
        scope,
        exc,
        phase,
        external_begun=False,
        released=False,
        retry_after=UNAVAILABLE_RETRY_AFTER,
    )
    if refusal is not None:
        raise refusal from exc
    # A business unique key, a deadlock, a lock timeout, a serialization
    # failure: a duplicate's work, most likely, and then its record answers.
    answer = _the_winners_answer(tally, fingerprint, database)
    if answer is not None:
        return answer
    if is_contention(exc):
        # A busy database, a duplicate still running most likely: never an
        # outage, never the view's error. The retry finds the winner's record.
        in_flight(tally, state="contended", cause=exc)
    # The view's own error (a rule of its own, a bug): as in any mode.
    tally.release_reason = "exception"
    raise exc


def _the_winners_answer(
    tally: Tally, fingerprint: Fingerprint, database: str
) -> HttpResponseBase | None:
    """After this request rolled back: the answer of the record holding the key now.

    A replay, or 422 for other input; 409 while a request of the two-commit
    kind holds it; ``None`` when no record holds it (or one past retention).
    """
    scope = tally.scope
    assert scope is not None
    try:
        record = store.lookup_to_answer(scope, using=database)
    except UNREACHABLE_ERRORS as exc:
        logger.error("Idempotency store lost during %s (%s); answering 503.", scope, exc)
        raise StoreUnavailable(retry_after=UNAVAILABLE_RETRY_AFTER) from exc
    if record is None or store.past_retention(record):
        return None
    if not fingerprint.matches(record.fingerprint) or record.is_resolved:
        return answer_settled(tally, fingerprint, record)
    held(tally, record)
