"""The clock-skew tests' views (``ROOT_URLCONF`` of ``tests.live.clock_settings``).

- ``GET /clock/now``: the serving process's wall clock and pid, so that a
  test can check that a server's clock really is skewed (a test that passes
  because libfaketime did not load would prove nothing).
- ``POST /clock/charges`` (``@idempotent``): one ``Charge`` (note = the
  body's ``run``), then, with ``external``, ``begin_external()`` (the record
  goes IN_PROGRESS); then, with ``hold``, the *first* execution for that
  ``run`` waits until the test releases it. Any later execution (a
  takeover) does not wait, so a test sees it finish at once.

Every execution leaves a marker file ``<run>.start.<pid>.<random>`` in
``IDEMPOTENCY_TEST_HOLD_DIR`` (written before it waits, its Charge not yet
committed): the markers count the view's executions across processes,
whether or not they committed. The test releases a run by creating
``<run>.release`` there, or every run at once with ``release-all``.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from tests.testapp.models import Charge
from tests.utils import data_of, idempotency_of

__all__ = [
    "HOLD_DIR_ENV",
    "HOLD_LIMIT",
    "RELEASE_ALL",
    "held_charge",
    "release",
    "starts",
    "urlpatterns",
    "wall_clock",
]

HOLD_DIR_ENV = "IDEMPOTENCY_TEST_HOLD_DIR"
#: Seconds a held execution waits at most for its release: a test that died
#: before releasing leaves no worker blocked for ever.
HOLD_LIMIT = 30.0
RELEASE_ALL = "release-all"


def _hold_dir() -> Path:
    return Path(os.environ[HOLD_DIR_ENV])


def starts(hold_dir: Path, run: str) -> list[Path]:
    """The marker files of the view's executions for ``run``."""
    return sorted(hold_dir.glob(f"{run}.start.*"))


def release(hold_dir: Path, run: str) -> None:
    """Let the held execution of ``run`` (if any, now or later) go on."""
    (hold_dir / f"{run}.release").touch()


def _released(hold_dir: Path, run: str) -> bool:
    return (hold_dir / f"{run}.release").exists() or (hold_dir / RELEASE_ALL).exists()


def _mark_start(hold_dir: Path, run: str) -> int:
    """Leave this execution's marker; how many executions there were, this one included."""
    (hold_dir / f"{run}.start.{os.getpid()}.{uuid.uuid4().hex}").touch()
    return len(starts(hold_dir, run))


def _hold(hold_dir: Path, run: str) -> None:
    # The monotonic clock: libfaketime shifts it, but durations stay right.
    deadline = time.monotonic() + HOLD_LIMIT
    while not _released(hold_dir, run) and time.monotonic() < deadline:
        time.sleep(0.02)


def wall_clock(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"time": time.time(), "pid": os.getpid()})


@api_view(["POST"])
@idempotent
def held_charge(request: Request) -> Response:
    data: dict[str, Any] = data_of(request)
    run = str(data["run"])
    charge = Charge.objects.create(tenant="clock-skew", amount=int(data.get("amount", 0)), note=run)
    if data.get("external"):
        idempotency_of(request).begin_external()
    hold_dir = _hold_dir()
    if _mark_start(hold_dir, run) == 1 and data.get("hold"):
        _hold(hold_dir, run)
    return Response({"id": charge.pk, "run": run, "pid": os.getpid()}, status=201)


urlpatterns = [
    path("clock/now", wall_clock),
    path("clock/charges", held_charge),
]
