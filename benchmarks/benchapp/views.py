"""Ways to make the same business write (one Payment row), and the view without it.

* ``no_write``: the unprotected view without its business INSERT (no
  database at all): what Django, DRF, gunicorn and HTTP cost by themselves,
  so that ratios against ``unprotected`` can be read.
* ``unprotected``: the bare view.
* ``protected``: the same view under ``@idempotent`` (django-idempotency).
* ``protected_optimistic``: the same under ``@idempotent(optimistic=True)``:
  the view and one conditional INSERT of the finished record in one
  transaction, after a lookup that sets a transaction-local lock_timeout.
* ``floor_single``: the single-transaction design written by hand (claim,
  business INSERT and completion in one transaction; a concurrent duplicate
  waits on the unique index, bounded by lock_timeout), measured with
  ``benchmarks/http.py --single-transaction``. The package's own mode of
  that design was removed (docs/performance.md says why).
* ``floor``: the same view under a minimal correct idempotency written by
  hand in raw SQL: the claim is ``INSERT ... ON CONFLICT DO NOTHING
  RETURNING`` in its own statement (autocommit, so it commits at once); the
  business INSERT and the completion UPDATE share one transaction; a replay
  is that claim (a no-op) plus one SELECT. It refuses a reused key (422)
  and answers 409 while the first request runs, but has no lease, recovery,
  fencing, external-call states, signals, configurable scope or stored
  headers beyond Location: what the package adds on top is what the ratio
  "protected / floor" prices.
* ``floor_lookup_first``: the same two-commit floor, but a SELECT of the key
  first and the claim only on a miss: a replay is one statement, a first
  execution one more. With ``floor`` it measures the order "claim first" vs
  "lookup first" apart from the package.
* ``floor_optimistic``: the optimistic design written by hand: in one
  transaction, the lookup (which also sets lock_timeout), the business
  INSERT, then ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` of the
  finished record; a duplicate that lost (nothing inserted, or an error
  such as a lock timeout) rolls back and answers from the winner's record.
  The ceiling for ``protected_optimistic``.

``_charge`` is shared, so the business part is identical byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.http import HttpRequest, HttpResponse
from rest_framework.decorators import api_view
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from benchmarks.benchapp.models import Payment
from django_idempotency import idempotent


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b"ok", content_type="text/plain")


def _payment(payment_id: int, amount: int, currency: str) -> tuple[dict[str, Any], str]:
    body = {"id": payment_id, "amount": amount, "currency": currency, "status": "created"}
    return body, f"/payments/{payment_id}"


def _charge(data: Any) -> tuple[dict[str, Any], str]:
    amount = int(data["amount"])
    currency = str(data["currency"])
    payment = Payment.objects.create(amount=amount, currency=currency)
    return _payment(payment.pk, amount, currency)


@api_view(["POST"])
def no_write(request: Request) -> Response:
    """``unprotected`` without the INSERT: the same parsing, rendering and answer."""
    body, location = _payment(0, int(request.data["amount"]), str(request.data["currency"]))
    return Response(body, status=201, headers={"Location": location})


@api_view(["POST"])
def unprotected(request: Request) -> Response:
    body, location = _charge(request.data)
    return Response(body, status=201, headers={"Location": location})


@api_view(["POST"])
@idempotent
def protected(request: Request) -> Response:
    body, location = _charge(request.data)
    return Response(body, status=201, headers={"Location": location})


@api_view(["POST"])
@idempotent(optimistic=True)
def protected_optimistic(request: Request) -> Response:
    """The optimistic mode: the view, then the finished record, one commit."""
    body, location = _charge(request.data)
    return Response(body, status=201, headers={"Location": location})


# -- the floor -------------------------------------------------------------------------

_TABLE = "benchapp_floorrecord"
_CLAIM = (
    f"INSERT INTO {_TABLE} (tenant, operation, key, fingerprint, state, response_location, "
    "created_at, expires_at) "
    "VALUES (%s, %s, %s, %s, 'CLAIMED', '', now(), now() + interval '24 hours') "
    "ON CONFLICT (tenant, operation, key) DO NOTHING RETURNING id"
)
_LOOKUP = (
    "SELECT fingerprint, state, response_status, response_location, response_body "
    f"FROM {_TABLE} WHERE tenant = %s AND operation = %s AND key = %s"
)
_COMPLETE = (
    f"UPDATE {_TABLE} SET state = 'COMPLETED', response_status = %s, "
    "response_location = %s, response_body = %s WHERE id = %s AND state = 'CLAIMED'"
)
_LOOKUP_WAITING = (
    # One row on a hit and on a miss (the LEFT JOIN), so that set_config runs
    # either way: a set_config in a WHERE clause would never run on a miss.
    "SELECT set_config('lock_timeout', '10000', true), r.fingerprint, r.state, "
    "r.response_status, r.response_location, r.response_body "
    f"FROM (VALUES (1)) AS one LEFT JOIN {_TABLE} AS r "
    "ON r.tenant = %s AND r.operation = %s AND r.key = %s"
)
_INSERT_FINISHED = (
    f"INSERT INTO {_TABLE} (tenant, operation, key, fingerprint, state, response_status, "
    "response_location, response_body, created_at, expires_at) "
    "VALUES (%s, %s, %s, %s, 'COMPLETED', %s, %s, %s, now(), now() + interval '24 hours') "
    "ON CONFLICT (tenant, operation, key) DO NOTHING RETURNING id"
)
_RELEASE = f"DELETE FROM {_TABLE} WHERE id = %s AND state = 'CLAIMED'"
_CLAIM_WAITING = (
    f"INSERT INTO {_TABLE} (tenant, operation, key, fingerprint, state, response_location, "
    "created_at, expires_at) "
    "SELECT %s, %s, %s, %s, 'CLAIMED', '', now(), now() + interval '24 hours' "
    "WHERE set_config('lock_timeout', '10000', true) IS NOT NULL "
    "ON CONFLICT (tenant, operation, key) DO NOTHING RETURNING id"
)


def _refusal(status: int, code: str) -> Response:
    return Response({"detail": code.replace("_", " "), "code": code}, status=status)


def _floor_input(request: Request) -> tuple[list[str], str] | Response:
    key = request.headers.get("Idempotency-Key")
    if not key or len(key) > 255:
        return _refusal(400, "idempotency_key_invalid")
    canonical = json.dumps(request.data, sort_keys=True, separators=(",", ":"))
    fingerprint = hashlib.sha256(canonical.encode()).hexdigest()
    return ["anonymous", f"POST {request.path}", key], fingerprint


def _floor_answer(found: Any, fingerprint: str) -> HttpResponse | Response:
    if found is None:
        return _refusal(409, "idempotency_request_in_progress")  # released meanwhile
    stored_fingerprint, state, status, location, stored_body = found
    if stored_fingerprint != fingerprint:
        return _refusal(422, "idempotency_key_reused")
    if state != "COMPLETED":
        return _refusal(409, "idempotency_request_in_progress")
    replayed = HttpResponse(bytes(stored_body), status=status, content_type="application/json")
    replayed["Location"] = location
    replayed["Idempotent-Replayed"] = "true"
    return replayed


def _floor_created(content: bytes, location: str) -> HttpResponse:
    response = HttpResponse(content, status=201, content_type="application/json")
    response["Location"] = location
    return response


def _charge_and_complete(request: Request, record_id: int) -> tuple[bytes, str]:
    """The business write and the completion, in the caller's transaction."""
    body, location = _charge(request.data)
    content = JSONRenderer().render(body)
    with connection.cursor() as cursor:
        cursor.execute(_COMPLETE, [201, location, content, record_id])
    return content, location


def _run_claimed(request: Request, record_id: int) -> HttpResponse:
    """The two-commit floors' second transaction: the business write and the completion."""
    try:
        with transaction.atomic():
            content, location = _charge_and_complete(request, record_id)
    except BaseException:
        with connection.cursor() as cursor:  # the retry must run: release the claim
            cursor.execute(_RELEASE, [record_id])
        raise
    return _floor_created(content, location)


@api_view(["POST"])
def floor(request: Request) -> HttpResponse | Response:
    checked = _floor_input(request)
    if isinstance(checked, Response):
        return checked
    scope, fingerprint = checked
    with connection.cursor() as cursor:  # autocommit: the claim commits at once
        cursor.execute(_CLAIM, [*scope, fingerprint])
        claimed = cursor.fetchone()
        if claimed is None:
            cursor.execute(_LOOKUP, scope)
            found = cursor.fetchone()
    if claimed is None:
        return _floor_answer(found, fingerprint)
    return _run_claimed(request, claimed[0])


@api_view(["POST"])
def floor_lookup_first(request: Request) -> HttpResponse | Response:
    checked = _floor_input(request)
    if isinstance(checked, Response):
        return checked
    scope, fingerprint = checked
    claimed = None
    with connection.cursor() as cursor:  # autocommit, as in floor
        cursor.execute(_LOOKUP, scope)
        found = cursor.fetchone()
        if found is None:
            cursor.execute(_CLAIM, [*scope, fingerprint])
            claimed = cursor.fetchone()
            if claimed is None:  # a duplicate claimed between the two statements
                cursor.execute(_LOOKUP, scope)
                found = cursor.fetchone()
    if claimed is None:
        return _floor_answer(found, fingerprint)
    return _run_claimed(request, claimed[0])


class _LostTheRace(Exception):
    """A duplicate's finished record was committed first: roll this one back."""


@api_view(["POST"])
def floor_optimistic(request: Request) -> HttpResponse | Response:
    checked = _floor_input(request)
    if isinstance(checked, Response):
        return checked
    scope, fingerprint = checked
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(_LOOKUP_WAITING, scope)
                found = cursor.fetchone()[1:]
            if found[0] is not None:
                return _floor_answer(found, fingerprint)  # commits a read-only transaction
            body, location = _charge(request.data)
            content = JSONRenderer().render(body)
            with connection.cursor() as cursor:
                cursor.execute(_INSERT_FINISHED, [*scope, fingerprint, 201, location, content])
                if cursor.fetchone() is None:
                    raise _LostTheRace
    except (_LostTheRace, DatabaseError) as lost:
        # Rolled back, the payment with it. A duplicate running at the same time
        # can also make this one fail before its record's INSERT (a lock timeout,
        # a deadlock): answer as the winner did; with no winner, the error stands.
        with connection.cursor() as cursor:
            cursor.execute(_LOOKUP, scope)
            winner = cursor.fetchone()
        if winner is None and isinstance(lost, DatabaseError):
            raise
        return _floor_answer(winner, fingerprint)
    return _floor_created(content, location)


@api_view(["POST"])
def floor_single(request: Request) -> HttpResponse | Response:
    checked = _floor_input(request)
    if isinstance(checked, Response):
        return checked
    scope, fingerprint = checked
    # An exception rolls the claim back with the payment: nothing to release.
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(_CLAIM_WAITING, [*scope, fingerprint])
            claimed = cursor.fetchone()
        if claimed is not None:
            content, location = _charge_and_complete(request, claimed[0])
    if claimed is not None:
        return _floor_created(content, location)
    with connection.cursor() as cursor:  # a new statement sees the winner's commit
        cursor.execute(_LOOKUP, scope)
        return _floor_answer(cursor.fetchone(), fingerprint)
