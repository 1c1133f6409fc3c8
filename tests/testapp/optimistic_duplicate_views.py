"""Views for the optimistic mode's concurrent duplicates (tests/test_optimistic_duplicates.py).

Plain Django views under ``@idempotent(optimistic=True)``, steered by the
JSON body (fingerprinted) and by headers (not fingerprinted, so that
duplicates with one body can still behave differently).
"""

from __future__ import annotations

import json
import time
from typing import Any

from django.db import DatabaseError, IntegrityError, transaction
from django.http import HttpRequest, JsonResponse

from django_idempotency import idempotent
from django_idempotency.outcomes import Verdict, by_status
from tests.testapp.models import Charge, Order


def _body(request: HttpRequest) -> dict[str, Any]:
    return dict(json.loads(request.body or b"{}"))


def _lock_the_account_then_charge(request: HttpRequest) -> JsonResponse:
    """The money-moving habit: lock the account's row, then write (a different key each)."""
    data = _body(request)
    account = Order.objects.select_for_update().get(number=data["account"])
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    time.sleep(float(data.get("hold", 0)))
    account.amount += int(data["amount"])
    account.save(update_fields=["amount"])
    return JsonResponse({"charge": charge.pk}, status=201)


lock_account_optimistic = idempotent(optimistic=True)(_lock_the_account_then_charge)
lock_account_default = idempotent()(_lock_the_account_then_charge)


@idempotent(optimistic=True)
def two_rows(request: HttpRequest) -> JsonResponse:
    """Two business rows, in the order the X-First header says: duplicates may deadlock."""
    data = _body(request)
    key = data["ref"]
    first = request.headers.get("X-First", "a")
    second = "b" if first == "a" else "a"
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    Order.objects.create(number=f"{key}-{first}", amount=1)
    time.sleep(float(data.get("hold", 0)))
    Order.objects.create(number=f"{key}-{second}", amount=1)
    return JsonResponse({"charge": charge.pk}, status=201)


@idempotent(optimistic=True, outcome=by_status({504: Verdict.UNCERTAIN}))
def uncertain_on_a_database_error(request: HttpRequest) -> JsonResponse:
    """Answers 504 (uncertain, by its policy) when its own statement fails: a duplicate's row."""
    data = _body(request)
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    try:
        with transaction.atomic():
            Order.objects.create(number=str(data["order"]), amount=1)
    except DatabaseError:
        return JsonResponse({"detail": "try again later"}, status=504)
    time.sleep(float(data.get("hold", 0)))
    return JsonResponse({"charge": charge.pk}, status=201)


@idempotent(optimistic=True)
def get_or_create_order(request: HttpRequest) -> JsonResponse:
    """The idempotent-create habit: ``get_or_create`` on the business key."""
    data = _body(request)
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    time.sleep(float(data.get("hold", 0)))
    order, created = Order.objects.get_or_create(number=str(data["order"]), defaults={"amount": 1})
    return JsonResponse({"charge": charge.pk, "order": order.pk}, status=201 if created else 200)


@idempotent(optimistic=True)
def caught_then_own_error(request: HttpRequest) -> JsonResponse:
    """Catches the duplicate's IntegrityError in a savepoint and raises its own exception."""
    data = _body(request)
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    time.sleep(float(data.get("hold", 0)))
    try:
        with transaction.atomic():
            Order.objects.create(number=str(data["order"]), amount=1)
    except IntegrityError as exc:
        raise RuntimeError("order exists") from exc
    return JsonResponse({"charge": charge.pk}, status=201)


@idempotent(optimistic=True)
async def async_charge(request: HttpRequest) -> JsonResponse:
    """``async def`` under optimistic=True: the ORM through its async API."""
    data = json.loads(request.body)
    charge = await Charge.objects.acreate(tenant="duplicates", amount=int(data["amount"]))
    if data.get("order"):
        await Order.objects.acreate(number=str(data["order"]), amount=1)
    return JsonResponse({"charge": charge.pk}, status=201)


def _charge_and_hold(request: HttpRequest) -> JsonResponse:
    data = _body(request)
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    time.sleep(float(data.get("hold", 0)))
    return JsonResponse({"charge": charge.pk}, status=201)


#: One operation served by both modes: a deploy switching a view's mode.
shared_operation_optimistic = idempotent(optimistic=True, operation="shared-transfer")(
    _charge_and_hold
)
shared_operation_default = idempotent(operation="shared-transfer")(_charge_and_hold)


@idempotent(optimistic=True)
def writes_to_a_second_alias(request: HttpRequest) -> JsonResponse:
    """A charge in the records' database, and a copy on ``shard_a`` (ATOMIC_REQUESTS there)."""
    data = _body(request)
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    Charge.objects.using("shard_a").create(tenant="duplicates", amount=int(data["amount"]))
    time.sleep(float(data.get("hold", 0)))
    return JsonResponse({"charge": charge.pk}, status=201)


@idempotent(optimistic=True)
def loses_its_connection(request: HttpRequest) -> JsonResponse:
    """Writes, then its session is terminated by the server (PostgreSQL) mid-view."""
    from django.db import connection

    data = _body(request)
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    if data.get("terminate"):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    return JsonResponse({"charge": charge.pk}, status=201)


@idempotent(optimistic=True, outcome=by_status({504: Verdict.UNCERTAIN}))
def two_rows_uncertain(request: HttpRequest) -> JsonResponse:
    """``two_rows``, answering 504 (uncertain, by its policy) when the second row fails.

    ``hold_after``: seconds to sleep after both rows, before answering.
    """
    data = _body(request)
    key = data["ref"]
    first = request.headers.get("X-First", "a")
    second = "b" if first == "a" else "a"
    charge = Charge.objects.create(tenant="duplicates", amount=int(data["amount"]))
    Order.objects.create(number=f"{key}-{first}", amount=1)
    time.sleep(float(data.get("hold", 0)))
    try:
        with transaction.atomic():
            Order.objects.create(number=f"{key}-{second}", amount=1)
    except DatabaseError:
        return JsonResponse({"detail": "try again later"}, status=504)
    time.sleep(float(data.get("hold_after", 0)))
    return JsonResponse({"charge": charge.pk}, status=201)
