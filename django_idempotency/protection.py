"""The request flow: key and fingerprint -> claim -> view -> outcome -> response.

HTTP glue (``decorators.py``, ``drf.py``) adapts the kinds of views to
``protect()``; the store is the only thing that touches records.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction

from django_idempotency import signals, store
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.context import IdempotencyContext
from django_idempotency.database_errors import (
    is_connection_lost,
    is_contention,
    is_serialization_failure,
)
from django_idempotency.digests import Fingerprint
from django_idempotency.exceptions import (
    UNREADABLE_RECORD,
    BodyTooLarge,
    InputUnreadable,
    KeyMissing,
    KeyReused,
    OutcomeUncertain,
    RequestInProgress,
    RolledBackResponse,
    StaleOwner,
    StoreUnavailable,
)
from django_idempotency.fingerprint import (
    FingerprintSpec,
    NonCanonicalValue,
    request_fingerprint,
)
from django_idempotency.key_header import parse_key
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse, Verdict, capture, replay, verdict_of
from django_idempotency.scope import OperationSpec, Scope, resolve_operation, resolve_tenant
from django_idempotency.simulated_crash import SimulatedCrash
from django_idempotency.store.connections import close_independent_connections
from django_idempotency.store.sealing import UnreadableRecord, unseal

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

__all__ = [
    "IN_FLIGHT_RETRY_AFTER",
    "PROTECTED_METHODS",
    "UNAVAILABLE_RETRY_AFTER",
    "UNREACHABLE_ERRORS",
    "Options",
    "protect",
    "run_unprotected",
    "view_transactions",
]

logger = logging.getLogger("django_idempotency")
State = IdempotencyRecord.State

PROTECTED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Errors of the claim or the lookup that mean "the record store cannot be
#: reached" (unless they are mere contention, see ``database_errors``), as
#: opposed to a bug or a missing migration, which should surface as they are.
UNREACHABLE_ERRORS = (OperationalError, InterfaceError)
IN_FLIGHT_RETRY_AFTER = 1
UNAVAILABLE_RETRY_AFTER = 5
#: The "wait" mode polls the record, backing off from the first interval
#: to the last (seconds).
_FIRST_POLL = 0.05
_LAST_POLL = 0.5


@dataclass(frozen=True)
class Options:
    """The keyword arguments of ``idempotent()`` / ``IdempotentMixin``."""

    fingerprint: FingerprintSpec = None
    operation: OperationSpec = None
    required: bool | None = None
    ttl: timedelta | float | None = None
    single_transaction: bool | None = None

    @property
    def retention(self) -> timedelta:
        """``ttl``, else the ``TTL`` setting."""
        return idempotency_settings.TTL if self.ttl is None else as_timedelta(self.ttl)


@contextmanager
def view_transactions(*, records_database: str | None = None) -> Iterator[list[str]]:
    """Open what ``ATOMIC_REQUESTS`` would have opened, plus ``records_database``.

    Protected views are exempt from Django's ``ATOMIC_REQUESTS`` (the claim
    has to commit before the view starts); this puts the view back into a
    transaction on every such database, after the claim. Yields the aliases
    whose block was opened here.
    """
    opened: list[str] = []
    with ExitStack() as stack:
        for alias, settings_dict in connections.settings.items():
            wanted = alias == records_database or (
                settings_dict.get("ATOMIC_REQUESTS") and not connections[alias].in_atomic_block
            )
            if wanted:
                stack.enter_context(transaction.atomic(using=alias))
                opened.append(alias)
        yield opened


def run_unprotected(view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
    with view_transactions():
        return view()


def protect(
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    options: Options,
    view_args: Sequence[Any],
    view_kwargs: Mapping[str, Any],
) -> HttpResponseBase:
    """Run ``view`` at most once per (tenant, operation, key) and answer retries.

    ``view`` calls the protected view and returns its finished response:
    exceptions the framework would turn into responses already turned into
    them, and the body rendered. Refusals are raised as ``IdempotencyRefusal``.
    """
    if request.method not in PROTECTED_METHODS:
        return run_unprotected(view)
    conf = idempotency_settings
    raw_key = request.headers.get(conf.HEADER)
    if raw_key is None:
        if options.required if options.required is not None else conf.REQUIRED:
            raise KeyMissing(f"This operation requires an {conf.HEADER} header.")
        return run_unprotected(view)
    scope = Scope(
        tenant=resolve_tenant(request, conf.TENANT),
        operation=resolve_operation(request, options.operation),
        key=parse_key(raw_key, conf.KEY_MAX_LENGTH),
    )
    if _declared_length(request) > conf.MAX_FINGERPRINTED_BODY:
        raise BodyTooLarge(
            f"The request body is larger than the {conf.MAX_FINGERPRINTED_BODY} bytes an "
            "idempotent request may have."
        )
    try:
        fingerprint = request_fingerprint(request, options.fingerprint, view_args, view_kwargs)
    except NonCanonicalValue as exc:  # NestedTooDeeply included
        raise InputUnreadable(str(exc)) from exc
    single = options.single_transaction
    if single is None:
        single = conf.SINGLE_TRANSACTION
    connection = connections[conf.DATABASE]
    if single and connection.vendor == "postgresql" and not connection.in_atomic_block:
        response = _claim_in_one_transaction(request, scope, fingerprint, view, options)
    else:
        response = _claim_or_answer(request, scope, fingerprint, view, options)
    response[conf.HEADER] = raw_key
    return response


def _declared_length(request: HttpRequest) -> int:
    """The body's length, as declared; 0 for multipart (uploads are hashed as streams)."""
    if (request.content_type or "").startswith("multipart/"):
        return 0
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0


def _claim_or_answer(
    request: HttpRequest,
    scope: Scope,
    fingerprint: Fingerprint,
    view: Callable[[], HttpResponseBase],
    options: Options,
) -> HttpResponseBase:
    conf = idempotency_settings
    ttl = options.retention
    database = conf.DATABASE
    waiting = conf.IN_FLIGHT == "wait"
    deadline = time.monotonic() + conf.IN_FLIGHT_WAIT.total_seconds()
    poll = _FIRST_POLL
    while True:
        try:
            held, record = store.claim_or_take_over(
                scope, fingerprint, ttl=ttl, lease=conf.LEASE, using=database
            )
        except UNREACHABLE_ERRORS as exc:
            if is_contention(exc):  # a busy database, most likely this very key
                _in_flight(request, scope, state="contended", cause=exc)
            return _store_unavailable(request, scope, view, exc)
        if held is not None:
            return _run_owned(request, held, view, ttl)
        if record is not None and (
            not fingerprint.matches(record.fingerprint) or record.is_resolved
        ):
            return _answer(request, scope, fingerprint, record)
        if record is not None and waiting and time.monotonic() < deadline:
            time.sleep(min(poll, max(deadline - time.monotonic(), 0)))
            poll = min(poll * 2, _LAST_POLL)
            continue
        # In flight, or (None) the key kept changing hands: ask again later.
        _in_flight(request, scope, state="unknown" if record is None else record.state)


def _in_flight(
    request: HttpRequest, scope: Scope, *, state: str, cause: BaseException | None = None
) -> NoReturn:
    signals.notify(signals.request_in_flight, request, scope, state=state)
    raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER) from cause


def _answer(
    request: HttpRequest, scope: Scope, fingerprint: Fingerprint, record: IdempotencyRecord
) -> HttpResponseBase:
    """The answer a settled record gives: 422 for other input, else its replay."""
    if not fingerprint.matches(record.fingerprint):
        signals.notify(signals.key_reused, request, scope)
        raise KeyReused()
    try:
        headers, body = unseal(
            record.response_headers, record.response_body, sealed=record.response_sealed
        )
    except UnreadableRecord as exc:
        logger.error("Cannot replay record %s (%s): %s", record.pk, scope, exc)
        raise StoreUnavailable(str(UNREADABLE_RECORD), retry_after=UNAVAILABLE_RETRY_AFTER) from exc
    signals.notify(signals.response_replayed, request, scope, status=record.response_status)
    return replay(record.response_status or 200, headers, body)


def _claim_in_one_transaction(
    request: HttpRequest,
    scope: Scope,
    fingerprint: Fingerprint,
    view: Callable[[], HttpResponseBase],
    options: Options,
) -> HttpResponseBase:
    """Claim, view and completion in ONE transaction (PostgreSQL, no external calls).

    One commit instead of two. A concurrent duplicate's INSERT waits on the
    unique index until this transaction ends (bounded by ``lock_timeout`` =
    IN_FLIGHT_WAIT, then 409), and then replays the committed outcome; a
    crash, an exception or a retryable status rolls the claim back with the
    view's writes, so the retry runs.
    """
    conf = idempotency_settings
    database = conf.DATABASE
    ttl = options.retention
    held: store.Claim | None = None
    run: _SingleRun | None = None
    try:
        with transaction.atomic(using=database):
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
            else:
                request.idempotency = IdempotencyContext(held, single_transaction=True)  # type: ignore[attr-defined]
                signals.notify(
                    signals.request_claimed, request, scope, fencing_token=held.fencing_token
                )
                run = _view_in_the_claims_transaction(held, view, ttl)
    except UNREACHABLE_ERRORS as exc:
        if held is None:  # the claim or the lookup: the only outage FAIL_OPEN may answer
            if is_serialization_failure(exc):
                # A duplicate committed the key while this claim waited on it,
                # and the snapshot (REPEATABLE READ) cannot see it: look again.
                return _claim_or_answer(request, scope, fingerprint, view, options)
            if is_contention(exc):
                _in_flight(request, scope, state="waited", cause=exc)
            return _store_unavailable(request, scope, view, exc)
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
        return _answer(request, scope, fingerprint, record)
    # Held by a request of the two-commit kind, expired or just released:
    # the general path handles all of these.
    return _claim_or_answer(request, scope, fingerprint, view, options)


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


def _view_in_the_claims_transaction(
    held: store.Claim, view: Callable[[], HttpResponseBase], ttl: timedelta
) -> _SingleRun:
    conf = idempotency_settings
    with view_transactions() as opened:  # other ATOMIC_REQUESTS databases
        response = view()
        verdict = verdict_of(response.status_code)
        rolled_back = transaction.get_rollback(using=held.database)
        if verdict is Verdict.COMPLETED and _writes_discarded():
            raise _rolled_back_success(held, response)
        if verdict is Verdict.RELEASE or rolled_back:
            # Roll everything back, the claim included: the retry runs.
            for alias in [held.database, *opened]:
                transaction.set_rollback(True, using=alias)
        if verdict is Verdict.RELEASE:
            return _SingleRun(held, response, verdict, stored=False)
        stored = capture(response, conf.STORED_HEADERS, conf.MAX_STORED_BODY)
        if rolled_back:
            return _SingleRun(held, response, verdict, stored=False, store_after=stored)
        store.complete(held, verdict, stored, ttl=ttl)
        return _SingleRun(held, response, verdict, stored=True)


def _settle_single_run(
    request: HttpRequest, fingerprint: Fingerprint, run: _SingleRun, ttl: timedelta
) -> HttpResponseBase:
    """After the commit: store a rolled-back refusal afresh; tell what was stored."""
    status = run.response.status_code
    stored = run.stored
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
            _log_unsettled(exc, f"store the refusal of {run.held.scope}", "its retry runs again")
    if stored:
        _signal_stored(request, run.held, run.verdict, status)
    else:
        signals.notify(signals.claim_released, request, run.held.scope, reason=status)
    return run.response


def _writes_discarded() -> bool:
    """Whether the view's writes on some database will be rolled back.

    Every open transaction counts, not only those opened here: an ``@api_view``
    function is not exempt from ``ATOMIC_REQUESTS``, so Django's own request
    transaction holds its writes on such a database.
    """
    return any(
        connection.in_atomic_block and connection.needs_rollback
        for connection in connections.all(initialized_only=True)
    )


def _rolled_back_success(held: store.Claim, response: HttpResponseBase) -> RolledBackResponse:
    return RolledBackResponse(
        f"The view answered {response.status_code} for {held.scope}, but its transaction "
        "(on one of its databases) was marked for rollback (a database error caught "
        "without a savepoint?), so its writes are discarded. Not stored; the claim is "
        "released and the retry runs. Wrap the statement that may fail in its own "
        "transaction.atomic() block."
    )


class _Step(enum.Enum):
    """How far a claimed request got: what a database error then means."""

    VIEW = "view"
    COMPLETING = "completing"
    COMMITTING = "committing"


def _run_owned(
    request: HttpRequest,
    held: store.Claim,
    view: Callable[[], HttpResponseBase],
    ttl: timedelta,
) -> HttpResponseBase:
    conf = idempotency_settings
    store_after: StoredResponse | None = None
    context = IdempotencyContext(held)
    step = _Step.VIEW
    try:
        request.idempotency = context  # type: ignore[attr-defined]
        signals.notify(
            signals.request_claimed, request, held.scope, fencing_token=held.fencing_token
        )
        # The view's writes and the stored outcome commit in one transaction:
        # a crash leaves both or neither.
        with view_transactions(records_database=held.database) as opened:
            response = view()
            step = _Step.COMPLETING
            verdict = verdict_of(response.status_code)
            if verdict is Verdict.RELEASE:
                # The retry must start from a clean slate.
                for alias in opened:
                    transaction.set_rollback(True, using=alias)
            elif verdict is Verdict.COMPLETED and _writes_discarded():
                raise _rolled_back_success(held, response)
            else:
                stored = capture(response, conf.STORED_HEADERS, conf.MAX_STORED_BODY)
                if transaction.get_rollback(using=held.database):
                    # DRF's exception handler marked the transaction for
                    # rollback (it does under ATOMIC_REQUESTS): the view's
                    # writes are undone, so the refusal is stored on its own.
                    store_after = stored
                else:
                    store.complete(held, verdict, stored, ttl=ttl)
            step = _Step.COMMITTING
        if store_after is not None:
            step = _Step.COMPLETING
            store.complete(held, verdict, store_after, ttl=ttl)
    except StaleOwner:
        signals.notify(signals.request_in_flight, request, held.scope, state="taken over")
        raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER) from None
    except SimulatedCrash:
        raise  # a "killed" process cleans nothing up (testing helper)
    except (DatabaseError, InterfaceError) as exc:
        lost = is_connection_lost(exc)
        released = _give_up(
            request, held, context, reason="store unavailable" if lost else "exception"
        )
        _answer_a_database_error(held, context, step, exc, released=released)
        raise
    except BaseException:
        _give_up(request, held, context, reason="exception")
        raise
    finally:
        # The second connection begin_external() may have opened is this
        # request's alone: close it now, not at request_finished, which may
        # run on another thread (ASGI).
        close_independent_connections()
    if verdict is Verdict.RELEASE:
        _give_up(request, held, context, reason=response.status_code)
    else:
        _signal_stored(request, held, verdict, response.status_code)
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


def _signal_stored(request: HttpRequest, held: store.Claim, verdict: Verdict, status: int) -> None:
    signals.notify(signals.response_stored, request, held.scope, state=verdict.value, status=status)


def _give_up(
    request: HttpRequest, held: store.Claim, context: IdempotencyContext, *, reason: object
) -> bool:
    """The view failed: release the claim, or, after an external call began,
    leave the record UNCERTAIN, since the call may have happened. Whether it
    was released."""
    if not context.external_begun:
        return _release(request, held, reason=reason)
    try:
        store.mark_uncertain(
            held,
            provider_key=context.provider_key,
            provider_operation_id=context.provider_operation_id,
        )
    except (StaleOwner, DatabaseError, InterfaceError) as exc:
        _log_unsettled(exc, f"mark {held.scope} uncertain", "recovery finds it once its lease ends")
        return False
    logger.warning(
        "%s failed (%s) after begin_external(): left UNCERTAIN for a reconciler.",
        held.scope,
        reason,
    )
    signals.notify(signals.record_uncertain, request, held.scope, reason=reason)
    return False


def _log_unsettled(exc: Exception, write: str, afterwards: str) -> None:
    """A release or mark-uncertain failed: the record waits for its lease to end."""
    if isinstance(exc, UNREACHABLE_ERRORS):
        # Most likely the store is gone, the reason we are here. The error
        # says it all (a lost connection, a deadlock...): no traceback.
        logger.error(
            "Could not %s (%s: %s); %s.", write, type(exc).__name__, str(exc).strip(), afterwards
        )
    else:  # taken over meanwhile, or a bug
        logger.exception("Could not %s", write)


def _release(request: HttpRequest, held: store.Claim, *, reason: object) -> bool:
    try:
        released = store.release(held)
    except (StaleOwner, DatabaseError, InterfaceError) as exc:
        _log_unsettled(
            exc, f"release the claim on {held.scope}", "it stays CLAIMED until its lease ends"
        )
        return False
    if released:
        signals.notify(signals.claim_released, request, held.scope, reason=reason)
    return released


def _store_unavailable(
    request: HttpRequest,
    scope: Scope,
    view: Callable[[], HttpResponseBase],
    exc: Exception,
) -> HttpResponseBase:
    fail_open = idempotency_settings.FAIL_OPEN
    signals.notify(signals.store_unavailable, request, scope, fail_open=fail_open)
    if fail_open:
        logger.warning(
            "Idempotency store unreachable (%s); FAIL_OPEN runs %s unprotected.",
            exc,
            scope,
        )
        return run_unprotected(view)
    logger.error("Idempotency store unreachable (%s); refusing %s with 503.", exc, scope)
    raise StoreUnavailable(retry_after=UNAVAILABLE_RETRY_AFTER) from exc
