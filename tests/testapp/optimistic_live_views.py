"""Views in the optimistic mode (``@idempotent(optimistic=True)``) for the live races.

(optimistic_views.py holds those of the in-process tests.)

Concurrent duplicates may each run an optimistic view's body; only one
commits. The live tests and benchmarks/contention.py count the bodies run,
including those whose transaction rolled back, so every run appends a line
(``<key> <run> <pid> <time.time()>``) to the file ``TESTAPP_BODIES_RUN_LOG``
names, outside any transaction: one ``write()`` on an ``O_APPEND`` file,
whole even when processes write at once.

Every run writes a Charge whose ``tenant`` is the run's id, so that the
committed row tells which run won. ``/optimistic/orders`` also writes an
Order numbered from the body (``order``): a business unique key, on which
losers fail inside the view (IntegrityError). ``/optimistic/notes`` writes
the Charge alone: no business unique key, losers get as far as the record's
INSERT. ``/optimistic/orders-default`` is the orders view in the default
(two-commit) mode, for benchmarks/contention.py's side by side.

The body steers the view: ``sleep`` (seconds, inside the transaction before
the business write: the duplicates overlap), ``hold`` (seconds after it: the
duplicates wait on the row the winner wrote), ``hold_after_record_insert``
(seconds after the INSERT of the finished record, before the COMMIT, under
the live server's hooks: the duplicates' INSERT statements wait on it), and, where the live server
allows it (``TESTAPP_ALLOW_SIGKILL=1``), the ``X-Crash-At`` header (not
the body, which the fingerprint covers: a retry without it is the same
request): SIGKILL the worker
``in-view`` (after the business write), ``after-record-insert`` (after the
INSERT of the finished record, before the COMMIT; tests/live/hooks.py) or
``after-commit`` (before the response is sent).
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from django.db import connection, transaction
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from tests.testapp.models import Charge, Order
from tests.utils import data_of

BODIES_RUN_LOG_ENV = "TESTAPP_BODIES_RUN_LOG"
ALLOW_SIGKILL_ENV = "TESTAPP_ALLOW_SIGKILL"
CRASH_HEADER = "X-Crash-At"
CRASH_POINTS = ("in-view", "after-record-insert", "after-commit")


def count_body_run(request: Request, run: str) -> None:
    path = os.environ.get(BODIES_RUN_LOG_ENV)
    if not path:
        return
    key = request.headers.get("Idempotency-Key", "-")
    line = f"{key} {run} {os.getpid()} {time.time():.6f}\n".encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)


def kill_this_process() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10)  # never reached: SIGKILL cannot be caught


def crash_point(request: Request) -> str | None:
    if os.environ.get(ALLOW_SIGKILL_ENV) != "1":
        return None
    point = request.headers.get(CRASH_HEADER)
    if point is not None and point not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}")
    return point


def prepare_crash(request: Request) -> None:
    """Arm the crash points that fire after the body returns (and the hold after the INSERT)."""
    hold = data_of(request).get("hold_after_record_insert")
    if hold:
        from tests.live import hooks

        hooks.hold_after_record_insert(float(hold))
    point = crash_point(request)
    if point == "after-record-insert":
        from tests.live import hooks

        hooks.crash_after_record_insert()
    elif point == "after-commit":
        # In autocommit on_commit runs at once: a crash in the view, not
        # after a commit.
        if not connection.in_atomic_block:
            raise RuntimeError("an optimistic view runs inside a transaction")
        transaction.on_commit(kill_this_process)


def crash_in_view(request: Request) -> None:
    if crash_point(request) == "in-view":
        kill_this_process()


def place_order(request: Request) -> Response:
    """The orders views' body: a Charge for the run, an Order for the number."""
    data = data_of(request)
    run = uuid.uuid4().hex
    count_body_run(request, run)
    number, amount = str(data["order"]), int(data.get("amount", 0))
    with transaction.atomic():  # the same body in both modes: its own transaction
        if data.get("sleep"):
            time.sleep(float(data["sleep"]))
        Charge.objects.create(tenant=run, amount=amount, note=number)
        Order.objects.create(number=number, amount=amount)
        if data.get("hold"):
            time.sleep(float(data["hold"]))
        crash_in_view(request)
    prepare_crash(request)
    return Response(
        {"order": number, "amount": amount, "run": run},
        status=201,
        headers={"Location": f"/orders/{number}"},
    )


@api_view(["POST"])
@idempotent(optimistic=True)
def optimistic_orders(request: Request) -> Response:
    return place_order(request)


@api_view(["POST"])
@idempotent
def default_mode_orders(request: Request) -> Response:
    return place_order(request)


@api_view(["POST"])
@idempotent(optimistic=True)
def optimistic_notes(request: Request) -> Response:
    """A Charge per run, noted ``order``: no business unique key; losers reach the record INSERT."""
    data = data_of(request)
    run = uuid.uuid4().hex
    count_body_run(request, run)
    if data.get("sleep"):
        time.sleep(float(data["sleep"]))
    charge = Charge.objects.create(
        tenant=run, amount=int(data.get("amount", 0)), note=str(data["order"])
    )
    if data.get("hold"):
        time.sleep(float(data["hold"]))
    crash_in_view(request)
    prepare_crash(request)
    return Response(
        {"id": charge.pk, "amount": charge.amount, "run": run},
        status=201,
        headers={"Location": f"/charges/{charge.pk}"},
    )
