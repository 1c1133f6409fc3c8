"""Four ways to make the same business write (one Payment row).

* ``unprotected``: the bare view.
* ``protected``: the same view under ``@idempotent`` (django-idempotency).
* ``protected_single``: the same under ``@idempotent(single_transaction=True)``
  (measured only with ``benchmarks/http.py --single-transaction``).
* ``floor_single``: the single-transaction design written by hand the same
  way (claim, business INSERT and completion in one transaction; a
  concurrent duplicate waits on the unique index, bounded by lock_timeout):
  the ceiling for ``single_transaction=True`` (``benchmarks/http.py
  --single-transaction``).
* ``floor``: the same view under a minimal correct idempotency written by
  hand in raw SQL: the claim is ``INSERT ... ON CONFLICT DO NOTHING
  RETURNING`` in its own statement (autocommit, so it commits at once); the
  business INSERT and the completion UPDATE share one transaction; a replay
  is that claim (a no-op) plus one SELECT. It refuses a reused key (422)
  and answers 409 while the first request runs, but has no lease, recovery,
  fencing, external-call states, signals, configurable scope or stored
  headers beyond Location: what the package adds on top is what the ratio
  "protected / floor" prices.

``_charge`` is shared, so the business part is identical byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse
from rest_framework.decorators import api_view
from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from benchmarks.benchapp.models import Payment
from django_idempotency import idempotent


def health(request: HttpRequest) -> HttpResponse:
    return HttpResponse(b"ok", content_type="text/plain")


def _charge(data: Any) -> tuple[dict[str, Any], str]:
    amount = int(data["amount"])
    currency = str(data["currency"])
    payment = Payment.objects.create(amount=amount, currency=currency)
    body = {"id": payment.pk, "amount": amount, "currency": currency, "status": "created"}
    return body, f"/payments/{payment.pk}"


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
@idempotent(single_transaction=True)
def protected_single(request: Request) -> Response:
    """Issue 7 item 5's mode: claim, view and completion in one transaction."""
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
    try:
        with transaction.atomic():
            content, location = _charge_and_complete(request, claimed[0])
    except BaseException:
        with connection.cursor() as cursor:  # the retry must run: release the claim
            cursor.execute(_RELEASE, [claimed[0]])
        raise
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
