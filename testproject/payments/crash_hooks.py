"""Test-only crash and stall points, for the crash tests in ``tests/live``.

Off unless the server process runs with ``PAYMENTS_CRASH_HOOKS=1``. Then a
request chooses a named point with a header:

- ``X-Crash-At: <point>``: the worker process SIGKILLs itself there (no
  cleanup, no rollback, no answer: the connection just drops);
- ``X-Stall-At: <point>`` with ``X-Stall-Seconds: <s>``: it sleeps there,
  as a worker stuck in a long GC pause or on a slow disk would.

Points, in the order a payment passes them:

``after-claim``
    the claim committed, the view has not run (``request_claimed`` signal);
``after-begin-external``
    the intent (IN_PROGRESS, provider key) committed, the provider not called;
``after-provider-charge``
    the provider charged and answered, ``set_provider_operation`` not called;
``after-payment-write``
    the Payment row written, the transaction not committed;
``after-commit``
    the Payment and the stored outcome committed, the answer not sent
    (``response_stored`` signal).

The two-step payment (``payments/two_step.py``: authorize, then capture)
has its own points, ``STEP_POINTS``, in the order it passes them:

``after-authorize-begin``
    the authorize step's intent committed, the provider not called;
``after-authorize``
    the provider authorized, ``set_provider_operation(step="authorize")``
    not called;
``after-authorize-recorded``
    the authorization's id committed, the capture not begun;
``after-capture-begin``
    the capture step's intent committed, the provider not called;
``after-capture``
    the provider captured, its id not recorded;
``after-capture-recorded``
    the capture's id committed, the Payment and the outcome not.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

ENV = "PAYMENTS_CRASH_HOOKS"
CRASH_HEADER = "X-Crash-At"
STALL_HEADER = "X-Stall-At"
STALL_SECONDS_HEADER = "X-Stall-Seconds"
MAX_STALL = 60.0
POINTS = (
    "after-claim",
    "after-begin-external",
    "after-provider-charge",
    "after-payment-write",
    "after-commit",
)
STEP_POINTS = (
    "after-authorize-begin",
    "after-authorize",
    "after-authorize-recorded",
    "after-capture-begin",
    "after-capture",
    "after-capture-recorded",
)

logger = logging.getLogger("payments.crash_hooks")


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def checkpoint(request: Any, point: str) -> None:
    """Crash or stall here if the request asks for this point; else nothing."""
    if not enabled() or request is None:
        return
    assert point in POINTS or point in STEP_POINTS, point
    headers = request.headers
    if headers.get(STALL_HEADER) == point:
        seconds = min(float(headers.get(STALL_SECONDS_HEADER) or 5), MAX_STALL)
        logger.warning("stall at %s for %.1f s (pid %d)", point, seconds, os.getpid())
        time.sleep(seconds)
    if headers.get(CRASH_HEADER) == point:
        logger.warning("crash at %s: SIGKILL pid %d", point, os.getpid())
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # never reached: SIGKILL cannot be caught


def _after_claim(sender: Any, request: Any = None, **kwargs: Any) -> None:
    checkpoint(request, "after-claim")


def _after_commit(sender: Any, request: Any = None, **kwargs: Any) -> None:
    checkpoint(request, "after-commit")


def install() -> None:
    """Connect the signal-based points (called by ``PaymentsConfig.ready``)."""
    from django_idempotency import signals

    signals.request_claimed.connect(_after_claim, dispatch_uid="payments.crash_hooks.claim")
    signals.response_stored.connect(_after_commit, dispatch_uid="payments.crash_hooks.commit")
    logger.warning("%s=1: crash hooks are ON in pid %d (test use only)", ENV, os.getpid())
