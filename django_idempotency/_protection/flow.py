"""The request flow: key and fingerprint -> claim -> view -> outcome -> response.

HTTP glue (``decorators.py``, ``drf.py``) adapts the kinds of views to
``protect()``; the store is the only thing that touches records. The
owner's run is in ``owned``, the write-once variant in ``optimistic``, the
answers to everybody else in ``answers``. What the request ended with is
noted on a ``Tally`` on the way and announced once, here, at the end
(``outcome``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from rest_framework.request import Request

from django_idempotency import _store as store
from django_idempotency._observability.tracing import (
    NO_SPAN,
    contended,
    step_span,
    traced_view,
)
from django_idempotency._protection.answers import (
    UNREACHABLE_ERRORS,
    answer_settled,
    held,
    in_flight,
    store_unavailable,
)
from django_idempotency._protection.body_limit import refuse_a_body_too_large
from django_idempotency._protection.keys import KeySource
from django_idempotency._protection.optimistic import run_optimistically
from django_idempotency._protection.outcome import Tally, announce, finish, observed
from django_idempotency._protection.owned import run_owned
from django_idempotency._protection.plan import Plan, plan_of
from django_idempotency._protection.refused import sender_named, sender_of
from django_idempotency._protection.retention import advertise_first_execution
from django_idempotency._protection.transactions import run_unprotected
from django_idempotency._store.digests import Fingerprint, Sender
from django_idempotency._store.errors import is_contention
from django_idempotency._store.routing import database_for
from django_idempotency.conf import as_timedelta, idempotency_settings
from django_idempotency.exceptions import (
    IdempotencyRefusal,
    InputUnreadable,
    KeyMissing,
)
from django_idempotency.fingerprint import (
    FingerprintSpec,
    NonCanonicalValue,
    request_fingerprint,
)
from django_idempotency.models import IdempotencyRecord
from django_idempotency.outcomes import Outcome, standard, webhook
from django_idempotency.scope import (
    ANONYMOUS_TENANT,
    OperationSpec,
    Scope,
    check_operation_spec,
    checked_tenant,
    default_tenant,
    resolve_operation,
    resolve_tenant,
)

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase


logger = logging.getLogger("django_idempotency")
State = IdempotencyRecord.State

PROTECTED_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

#: The longest ``credential_rotation`` window: a revoked credential still
#: fetches the replay of the request that revoked it only for minutes.
CREDENTIAL_ROTATION_MAX = timedelta(hours=1)

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
    optimistic: bool = False
    key: KeySource = field(default_factory=KeySource)
    outcome: Outcome | None = None
    tenant: Callable[[Any], str] | None = None
    verify: Callable[[Any], HttpResponseBase | None] | None = None
    credential_rotation: timedelta | float | None = None

    def __post_init__(self) -> None:
        # A fixed name is judged once, here, so that a bad one fails at
        # import; a computed one is judged per request (resolve_operation).
        check_operation_spec(self.operation)
        window = self.credential_window
        if window is not None and not timedelta(0) < window <= CREDENTIAL_ROTATION_MAX:
            raise ImproperlyConfigured(
                f"idempotent(credential_rotation={self.credential_rotation!r}) must be a "
                f"positive duration of at most {CREDENTIAL_ROTATION_MAX}: for how long the "
                "holder of a credential the view rotated still gets its replay."
            )

    @property
    def credential_window(self) -> timedelta | None:
        """``credential_rotation`` as a duration; None: the view does not opt in."""
        rotation = self.credential_rotation
        return None if rotation is None else as_timedelta(rotation)

    @property
    def retention(self) -> timedelta:
        """``ttl``, else the ``TTL`` setting."""
        return idempotency_settings.TTL if self.ttl is None else as_timedelta(self.ttl)

    @property
    def outcome_policy(self) -> Outcome:
        """``outcome``; else the ``OUTCOME`` setting (``standard``) for a client's key.

        A key from elsewhere gets ``webhook`` whatever the project stores for
        its clients: a sender redelivers what it did not see succeed.
        """
        if self.outcome is not None:
            return self.outcome
        if not self.key.is_client_header:
            return webhook
        return idempotency_settings.OUTCOME or standard


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
    if options.verify is not None:
        # Before anything is read or claimed, whatever the method: a forged
        # request's refusal must never be stored under the genuine key.
        refusal = options.verify(request)
        if refusal is not None:
            return refusal
    if request.method not in PROTECTED_METHODS:
        return run_unprotected(view)
    tally = Tally()
    refused: IdempotencyRefusal | None = None
    try:
        return _protect(request, _timed(view, tally), options, view_args, view_kwargs, tally)
    except IdempotencyRefusal as refusal:
        refused = refusal
        raise
    finally:
        if observed():  # else nothing would hear of it: nothing to build
            if refused is not None and tally.scope is None:
                # Refused before it had a scope (no key, a body too large): named anyway.
                with contextlib.suppress(Exception):
                    tally.operation = resolve_operation(request, options.operation)
            tally.operation_from_code = _operation_from_code(request, options.operation)
            announce(request, finish(tally, refused))


def _operation_from_code(request: HttpRequest, spec: OperationSpec) -> bool:
    """Whether ``spec`` names the operation from the code, the same in every process.

    A literal name and a route's (its pattern or its URL name) are written
    in the code; a callable's and a request path's (a route with no pattern:
    see ``scope.default_operation``) may be anything. The metrics label only
    the first kind by name (``_observability.labels``).
    """
    if spec is None:
        match = request.resolver_match
        return match is not None and bool(match.route)
    return not callable(spec)


def _timed(view: Callable[[], HttpResponseBase], tally: Tally) -> Callable[[], HttpResponseBase]:
    """``view``, its time added up so that it can be taken out of the protection's."""

    def run() -> HttpResponseBase:
        tally.view_ran = True
        started = time.perf_counter()
        try:
            return view()
        finally:
            tally.view_seconds += time.perf_counter() - started

    return run


def _protect(
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    options: Options,
    view_args: Sequence[Any],
    view_kwargs: Mapping[str, Any],
    tally: Tally,
) -> HttpResponseBase:
    plan = plan_of(options)
    try:
        if plan.client_header:
            key = plan.client_key(request)
        else:
            if options.key.reads_body:
                refuse_a_body_too_large(request)  # before it is read for the key
            key = options.key.read(request, plan.key_max_length)
    except NonCanonicalValue as exc:  # a body too deeply nested to find the key in
        raise InputUnreadable(str(exc)) from exc
    if key is None:
        if plan.required:
            raise KeyMissing(f"This operation requires {options.key.wanted()}.")
        return run_unprotected(view)
    if not plan.client_header:
        tally.key_source = options.key.describe()
    drf_request = isinstance(request, Request)
    principal: str | None = None
    if drf_request and plan.tenant is default_tenant:
        # The tenant is who sent it (principal_of): asked once, for both.
        tenant = default_tenant(request)
        principal = None if tenant == ANONYMOUS_TENANT else tenant
        tenant = checked_tenant(tenant, default_tenant)
    else:
        tenant = resolve_tenant(request, plan.tenant)
    scope = Scope(
        tenant=tenant,
        operation=resolve_operation(request, options.operation),
        key=key,
    )
    tally.scope = scope
    view = traced_view(scope, view)
    refuse_a_body_too_large(request)
    try:
        fingerprint = request_fingerprint(request, options.fingerprint, view_args, view_kwargs)
    except NonCanonicalValue as exc:  # NestedTooDeeply included
        raise InputUnreadable(str(exc)) from exc
    # Asked once: the claim, the view's transaction and the completion all
    # use this alias, and the view learns it as request.idempotency.database.
    database = database_for(scope, request=request)
    # Kept on the record for a retry that DRF refuses before the claim (``refused``).
    if plan.tenant is default_tenant and drf_request:
        sender = sender_named(request, principal, plan.credential_window)
    else:
        sender = sender_of(request, options)
    response = None
    if options.optimistic and not connections[database].in_atomic_block:
        response = run_optimistically(
            request,
            tally,
            scope,
            fingerprint,
            view,
            plan.retention,
            database=database,
            outcome=plan.outcome,
            sender=sender,
        )
    if response is None:
        response = _claim_or_answer(request, tally, fingerprint, view, plan, database, sender)
    if plan.client_header:
        # Echoed to the client that sent it, as it sent it; a key read from
        # elsewhere (a webhook's delivery id) is the sender's, and no
        # Idempotency-Key.
        meta = request._request.META if isinstance(request, Request) else request.META
        response[plan.header] = meta[plan.header_meta]
    if plan.advertise_retention:
        advertise_first_execution(response, plan.retention, stored=tally.stored_state is not None)
    return response


def _describe_claim(span: Any, attempt: store.Attempt) -> None:
    if attempt.held is not None:
        span.set_attribute("idempotency.outcome", "claimed")
        span.set_attribute("idempotency.fencing_token", attempt.held.fencing_token)
    else:
        span.set_attribute("idempotency.outcome", "held")
        state = attempt.last_seen if attempt.record is None else attempt.record.state
        span.set_attribute("idempotency.record.state", state)


def _claim_or_answer(
    request: HttpRequest,
    tally: Tally,
    fingerprint: Fingerprint,
    view: Callable[[], HttpResponseBase],
    plan: Plan,
    database: str,
    sender: Sender,
) -> HttpResponseBase:
    conf = idempotency_settings
    scope = tally.scope
    assert scope is not None
    ttl = plan.retention
    lease = plan.lease
    deadline: float | None = None  # "wait" mode: when to stop, once there is a wait
    poll = _FIRST_POLL
    while True:
        try:
            with step_span("idempotency.claim", scope, expected=contended) as span:
                attempt = store.claim_or_take_over(
                    scope, fingerprint, ttl=ttl, lease=lease, using=database, sender=sender
                )
                if span is not NO_SPAN:  # described only where a span records it
                    _describe_claim(span, attempt)
        except UNREACHABLE_ERRORS as exc:
            if is_contention(exc):  # a busy database, most likely this very key
                in_flight(tally, state="contended", cause=exc)
            return store_unavailable(tally, view, exc)
        if attempt.held is not None:
            return run_owned(request, tally, attempt.held, view, ttl, plan.outcome)
        record = attempt.record
        if record is not None:
            matched = fingerprint.matches(record.fingerprint)
            if not matched or record.is_resolved:
                return answer_settled(tally, fingerprint, record, matched=matched)
        if record is not None and record.state == State.UNCERTAIN:
            held(tally, record)  # nothing runs it: waiting would not settle it
        if record is not None and conf.IN_FLIGHT == "wait":
            if deadline is None:
                deadline = time.monotonic() + conf.IN_FLIGHT_WAIT.total_seconds()
            if time.monotonic() >= deadline:
                in_flight(tally, state=record.state)
            time.sleep(min(poll, max(deadline - time.monotonic(), 0)))
            poll = min(poll * 2, _LAST_POLL)
            continue
        # In flight, or (None) the key kept changing hands: ask again later.
        if record is not None:
            held(tally, record)
        in_flight(tally, state=attempt.last_seen)
