"""Retries DRF refuses before the claim, answered with their replay: a narrow path.

DRF authenticates, checks permissions and throttles in ``APIView.initial()``,
and the claim, which finds the stored outcome, comes after them, so that a
request that will execute has passed every check first. A retry the first
request's own success makes a permission check refuse (the object it
deleted is gone, so the permission class that reads it says no) would then
get 403 instead of its outcome.

So when a permission check denies an authenticated caller, and only then,
the glue (``decorators.answer_refused_retry``) runs the view's throttles
and asks ``replay_past_permission_refusal``: the record of the same
tenant, operation and key is read (one SELECT), and replayed only if it is
COMPLETED or FAILED, within retention, of the same input (fingerprint),
and created by the same principal, whose keyed digest every claim of a
DRF request stores (``sender_of``). Anything else keeps DRF's own refusal.
The security argument is docs/security.md's, "Replays past a refused
permission".

A view that rotates or revokes the credential its caller authenticates
with opts in to a second path (``credential_rotation``): its claims keep
a keyed digest of the credential presented (the ``Authorization``
header), and a retry whose authentication fails is answered with the
replay of the record of the same operation and key whose first request
presented that same credential, of the same input, finished, and created
within the view's window (``replay_past_authentication_failure``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from rest_framework.exceptions import APIException
from rest_framework.request import Request

from django_idempotency import _store as store
from django_idempotency._protection.answers import answer_settled
from django_idempotency._protection.body_limit import refuse_a_body_too_large
from django_idempotency._protection.outcome import Tally, announce, finish
from django_idempotency._store.digests import (
    NOBODY,
    Fingerprint,
    Sender,
    credential_digest,
    credential_digests,
    principal_digest,
    principal_digests,
)
from django_idempotency._store.routing import database_for
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import IdempotencyRefusal
from django_idempotency.fingerprint import NonCanonicalValue, request_fingerprint
from django_idempotency.scope import (
    ANONYMOUS_TENANT,
    Scope,
    default_tenant,
    resolve_operation,
    resolve_tenant,
)

if TYPE_CHECKING:
    from django.http import HttpRequest, HttpResponseBase

    from django_idempotency._protection.flow import Options
    from django_idempotency.models import IdempotencyRecord


logger = logging.getLogger("django_idempotency")

#: What the path may meet on the way to the record and take as "no replay":
#: input DRF never had to read for its refusal (a key or a body it would
#: refuse), and a store it cannot reach. The original refusal stands.
_NO_REPLAY = (IdempotencyRefusal, APIException, NonCanonicalValue, DatabaseError)


def _unexpected(request: HttpRequest, why: str) -> None:
    """Log the failure of the project's code on the narrow path; the refusal stands.

    The path runs the view's tenant, operation, key and fingerprint code
    (callables, ``IDEMPOTENCY["TENANT"]``) on a request DRF has just
    refused, which such code may rightly assume never happens (the caller's
    organisation, for a caller in none): what it raises is no reason to
    answer the refusal with a 500. Logged with its traceback, since it
    would fail the same way on a request that passes the checks.
    """
    logger.warning("No replay %s for %s: looking for it failed.", why, request.path, exc_info=True)


def principal_of(request: HttpRequest) -> str | None:
    """Who sent the request, named as ``scope.default_tenant`` names a client.

    None for an anonymous request, and for a credential the default cannot
    name (a JWT's claims without a user): no replay past a refusal then.
    """
    try:
        principal = default_tenant(request)
    except ImproperlyConfigured:
        return None
    return None if principal == ANONYMOUS_TENANT else principal


def sent_by(record: IdempotencyRecord, principal: str | None) -> bool:
    """Whether ``principal`` (``principal_of``) sent the request that created ``record``.

    A record that names no principal (a plain Django view's, an anonymous
    request's, one written before 0008) was sent by nobody in particular:
    False here, and the status view lets its tenant read it as before.
    """
    return principal is not None and _one_of(record.principal_digest, principal_digests(principal))


def sender_of(request: HttpRequest, options: Options) -> Sender:
    """What the claim of ``request`` keeps of who sent it: digests, for DRF requests only.

    A DRF request has authenticated before the claim (``request.user`` is
    already read, no query added); a plain Django view has no DRF
    permission check to answer past.
    """
    if not isinstance(request, Request):
        return NOBODY
    return sender_named(request, principal_of(request), options.credential_window)


def sender_named(
    request: HttpRequest, principal: str | None, credential_window: timedelta | None
) -> Sender:
    """``sender_of``, for a DRF request whose ``principal_of`` is ``principal``."""
    credential = presented_credential(request) if credential_window else None
    if principal is None and credential is None:
        return NOBODY  # an anonymous request: the sender every such claim keeps
    return Sender(
        principal=None if principal is None else principal_digest(principal),
        credential=None if credential is None else credential_digest(credential),
    )


def presented_credential(request: HttpRequest) -> str | None:
    """The credential as the request presents it: its ``Authorization`` header, raw."""
    return request.headers.get("Authorization") or None


def key_of(request: HttpRequest, options: Options) -> str | None:
    """The request's key, or None when it has none, an invalid one, or a body DRF refuses."""
    try:
        return options.key.read(request, idempotency_settings.KEY_MAX_LENGTH)
    except (IdempotencyRefusal, APIException):
        return None
    except Exception:  # a key callable's failure: the refusal stands (_unexpected)
        _unexpected(request, "past a refusal")
        return None


def replay_past_permission_refusal(
    request: HttpRequest,
    options: Options,
    view_args: Sequence[Any],
    view_kwargs: Mapping[str, Any],
    *,
    principal: str,
    key: str,
) -> HttpResponseBase | None:
    """The replay owed to a retry a permission check refused; None: the refusal stands.

    The view's throttles have let the request through. One SELECT: the
    record of the request's scope, replayed if it is finished, within
    retention, of this input, and created by ``principal``.
    """
    try:
        scope = Scope(
            tenant=resolve_tenant(request, options.tenant or idempotency_settings.TENANT),
            operation=resolve_operation(request, options.operation),
            key=key,
        )
        refuse_a_body_too_large(request)  # as the protection would: no fingerprint read
        fingerprint = request_fingerprint(request, options.fingerprint, view_args, view_kwargs)
        record = store.lookup(scope, using=database_for(scope, request=request))
    except _NO_REPLAY as exc:
        logger.info("No replay past a refused permission for %s: %s", request.path, exc)
        return None
    except Exception:  # the project's code, refused callers unforeseen: the 403 stands
        _unexpected(request, "past a refused permission")
        return None
    if (
        record is None
        or not _finished_within_retention(record)
        or not fingerprint.matches(record.fingerprint)
        or not sent_by(record, principal)
    ):
        return None
    return _replayed(request, options, fingerprint, record, "a permission check refused")


def replay_past_authentication_failure(
    request: HttpRequest,
    options: Options,
    view_args: Sequence[Any],
    view_kwargs: Mapping[str, Any],
    *,
    credential: str,
    key: str,
) -> HttpResponseBase | None:
    """The replay owed to the holder of a credential the view rotated; None: the 401 stands.

    The view opted in (``credential_rotation``) and its throttles have let
    the request through. The record of the request's operation and key
    whose first request presented ``credential`` is replayed if it is the
    only one, finished, within retention, created within the view's window,
    and of this input.
    """
    window = options.credential_window
    assert window is not None
    try:
        operation = resolve_operation(request, options.operation)
        refuse_a_body_too_large(request)  # as the protection would: no fingerprint read
        fingerprint = request_fingerprint(request, options.fingerprint, view_args, view_kwargs)
        found = store.finished_for_credential(
            operation, key, credential_digests(credential), created_within=window
        )
    except _NO_REPLAY as exc:
        logger.info("No replay past a failed authentication for %s: %s", request.path, exc)
        return None
    except Exception:  # the project's code, unauthenticated callers unforeseen: the 401 stands
        _unexpected(request, "past a failed authentication")
        return None
    if len(found) != 1:
        return None  # none, or one per tenant: which one is not the credential's to say
    (record,) = found
    if not fingerprint.matches(record.fingerprint) or not _one_of(
        record.credential_digest, credential_digests(credential)
    ):
        return None
    return _replayed(request, options, fingerprint, record, "whose credential was rotated")


def _replayed(
    request: HttpRequest,
    options: Options,
    fingerprint: Fingerprint,
    record: IdempotencyRecord,
    why: str,
) -> HttpResponseBase | None:
    """``record``'s replay, with the key echoed, announced as any replay is."""
    tally = Tally()
    tally.scope = Scope(tenant=record.tenant, operation=record.operation, key=record.key)
    try:
        replay = answer_settled(tally, fingerprint, record)
    except IdempotencyRefusal as exc:  # unreadable (a missing encryption key): logged there
        logger.info("No replay for %s, %s: %s", tally.scope, why, exc)
        return None
    if options.key.is_client_header:  # echoed, as on every protected answer
        replay[idempotency_settings.HEADER] = request.headers[idempotency_settings.HEADER]
    logger.info("Replayed %s to a retry %s.", tally.scope, why)
    announce(request, finish(tally, None))
    return replay


def _one_of(stored: str | None, expected: Sequence[str]) -> bool:
    """Whether a stored digest is one of ``expected`` (compared in constant time)."""
    if stored is None:
        return False
    return any(hmac.compare_digest(stored.encode(), digest.encode()) for digest in expected)


def _finished_within_retention(record: IdempotencyRecord) -> bool:
    # Never an unresolved record (nothing to replay: a refusal must not
    # become a 409), nor one past retention or kept as a tombstone (its
    # response is gone: the refusal stands rather than a 422).
    return (
        record.is_resolved
        and not store.past_retention(record)
        and not store.kept_as_tombstone(record)
    )
