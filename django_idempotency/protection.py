"""The request flow: key and fingerprint -> claim -> view -> outcome -> response.

HTTP glue (``decorators.py``, ``drf.py``) adapts the kinds of views to
``protect()``; the store is the only thing that touches records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.utils import timezone

from django_idempotency import signals, store
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.context import IdempotencyContext
from django_idempotency.exceptions import (
    InputUnreadable,
    KeyMissing,
    KeyReused,
    RequestInProgress,
    StaleOwner,
    StoreUnavailable,
)
from django_idempotency.fingerprint import (
    FingerprintSpec,
    NonCanonicalValue,
    request_fingerprint,
)
from django_idempotency.keys import parse_key
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import Outcome, StoredResponse, capture, outcome_of, replay
from django_idempotency.scope import OperationSpec, Scope, resolve_operation, resolve_tenant

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

logger = logging.getLogger("django_idempotency")

PROTECTED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: Errors that mean "the record store cannot be reached", as opposed to a
#: bug or a missing migration, which should surface as they are.
UNREACHABLE_ERRORS = (OperationalError, InterfaceError)
IN_FLIGHT_RETRY_AFTER = 1
UNAVAILABLE_RETRY_AFTER = 5
#: How often a claim may find its key taken yet no record behind it (the
#: holder released it in between) before answering 409 instead of looping.
_MAX_VANISHED = 3


@dataclass(frozen=True)
class Options:
    """The keyword arguments of ``idempotent()`` / ``IdempotentMixin``."""

    fingerprint: FingerprintSpec = None
    operation: OperationSpec = None
    required: bool | None = None
    ttl: timedelta | float | None = None


@contextmanager
def requests_transactions(*, also: str | None = None) -> Iterator[list[str]]:
    """Open what ``ATOMIC_REQUESTS`` would have opened, plus ``also``.

    Protected views are exempt from Django's ``ATOMIC_REQUESTS`` (the claim
    has to commit before the view starts); this puts the view back into a
    transaction on every such database, after the claim. Yields the aliases
    whose block was opened here.
    """
    opened: list[str] = []
    with ExitStack() as stack:
        for alias, settings_dict in connections.settings.items():
            wanted = alias == also or (
                settings_dict.get("ATOMIC_REQUESTS") and not connections[alias].in_atomic_block
            )
            if wanted:
                stack.enter_context(transaction.atomic(using=alias))
                opened.append(alias)
        yield opened


def run_unprotected(view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
    with requests_transactions():
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
    header = conf.HEADER
    raw_key = request.headers.get(header)
    if raw_key is None:
        if options.required if options.required is not None else conf.REQUIRED:
            raise KeyMissing(f"This operation requires an {header} header.")
        return run_unprotected(view)
    scope = Scope(
        tenant=resolve_tenant(request, conf.TENANT),
        operation=resolve_operation(request, options.operation),
        key=parse_key(raw_key, conf.KEY_MAX_LENGTH),
    )
    try:
        fingerprint = request_fingerprint(request, options.fingerprint, view_args, view_kwargs)
    except NonCanonicalValue as exc:
        raise InputUnreadable() from exc
    ttl = as_timedelta(options.ttl) if options.ttl is not None else conf.TTL
    database = conf.DATABASE
    wait_until = (
        time.monotonic() + conf.IN_FLIGHT_WAIT.total_seconds() if conf.IN_FLIGHT == "wait" else None
    )
    poll = 0.05
    vanished = 0
    while True:
        try:
            held = store.claim(scope, fingerprint, ttl=ttl, lease=conf.LEASE, using=database)
            record = None if held else store.lookup(scope, using=database)
        except UNREACHABLE_ERRORS as exc:
            return _store_unavailable(request, scope, view, exc)
        if held is not None:
            response = _run_owned(request, held, view, ttl)
            response[header] = raw_key
            return response
        if record is None:
            vanished += 1
            if vanished <= _MAX_VANISHED:
                continue
            state = "vanished"
        elif record.is_resolved and record.expires_at <= timezone.now():
            store.discard_expired(record, using=database)
            continue
        elif record.fingerprint != fingerprint:
            signals.key_reused.send(IdempotencyRecord, request=request, scope=scope)
            raise KeyReused()
        elif record.is_resolved:
            signals.response_replayed.send(
                IdempotencyRecord, request=request, scope=scope, status=record.response_status
            )
            response = replay(
                record.response_status or 200,
                record.response_headers,
                None if record.response_body is None else bytes(record.response_body),
            )
            response[header] = raw_key
            return response
        else:
            state = record.state
            if wait_until is not None and time.monotonic() < wait_until:
                time.sleep(min(poll, max(wait_until - time.monotonic(), 0)))
                poll = min(poll * 2, 0.5)
                continue
        signals.request_in_flight.send(IdempotencyRecord, request=request, scope=scope, state=state)
        raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER)


def _run_owned(
    request: HttpRequest,
    held: store.Claim,
    view: Callable[[], HttpResponseBase],
    ttl: timedelta,
) -> HttpResponseBase:
    request.idempotency = IdempotencyContext(  # type: ignore[attr-defined]
        scope=held.scope, fencing_token=held.fencing_token
    )
    signals.request_claimed.send(
        IdempotencyRecord, request=request, scope=held.scope, fencing_token=held.fencing_token
    )
    conf = idempotency_settings
    store_after: StoredResponse | None = None
    try:
        # The view's writes and the stored outcome commit in one transaction:
        # a crash leaves both or neither.
        with requests_transactions(also=held.database) as opened:
            response = view()
            outcome = outcome_of(response.status_code)
            if outcome is Outcome.RELEASE:
                # The retry must start from a clean slate.
                for alias in opened:
                    transaction.set_rollback(True, using=alias)
            else:
                stored = capture(response, conf.STORED_HEADERS, conf.MAX_STORED_BODY)
                if transaction.get_rollback(using=held.database):
                    # DRF's exception handler marked the transaction for
                    # rollback (it does under ATOMIC_REQUESTS): the view's
                    # writes are undone, so the outcome is stored on its own.
                    store_after = stored
                else:
                    store.complete(held, outcome, stored, ttl=ttl)
        if store_after is not None:
            store.complete(held, outcome, store_after, ttl=ttl)
    except StaleOwner:
        signals.request_in_flight.send(
            IdempotencyRecord, request=request, scope=held.scope, state="taken over"
        )
        raise RequestInProgress(retry_after=IN_FLIGHT_RETRY_AFTER) from None
    except BaseException:
        _release(request, held, reason="exception")
        raise
    if outcome is Outcome.RELEASE:
        _release(request, held, reason=response.status_code)
    else:
        signals.response_stored.send(
            IdempotencyRecord,
            request=request,
            scope=held.scope,
            state=outcome.value,
            status=response.status_code,
        )
    return response


def _release(request: HttpRequest, held: store.Claim, *, reason: object) -> None:
    try:
        released = store.release(held)
    except DatabaseError:
        # The record stays CLAIMED; recovery releases it once its lease ends.
        logger.exception("Could not release the claim on %s", held.scope)
        return
    if released:
        signals.claim_released.send(
            IdempotencyRecord, request=request, scope=held.scope, reason=reason
        )


def _store_unavailable(
    request: HttpRequest,
    scope: Scope,
    view: Callable[[], HttpResponseBase],
    exc: Exception,
) -> HttpResponseBase:
    fail_open = idempotency_settings.FAIL_OPEN
    signals.store_unavailable.send(
        IdempotencyRecord, request=request, scope=scope, fail_open=fail_open
    )
    if fail_open:
        logger.warning(
            "Idempotency store unreachable (%s); FAIL_OPEN runs %s unprotected.",
            exc,
            scope,
        )
        return run_unprotected(view)
    logger.error("Idempotency store unreachable (%s); refusing %s with 503.", exc, scope)
    raise StoreUnavailable(retry_after=UNAVAILABLE_RETRY_AFTER) from exc
