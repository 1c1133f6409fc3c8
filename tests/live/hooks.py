"""Test-only behaviour of the live server process (installed by ``tests.live.wsgi``).

Server errors are logged with their traceback (see ``_log_server_errors``).

The ``IdempotentMixin`` and ViewSet test views take their input through a
serializer that knows only ``amount`` and ``note``, so they cannot be asked
to ``sleep`` like the ``@api_view`` one. To widen their race window all the
same, a Charge whose note contains ``[sleep=<seconds>]`` makes its save wait
that long: inside the view, after the claim, while the claim is held, exactly
where the ``sleep`` of the other views waits. One whose note contains
``[crash]`` SIGKILLs the worker process instead.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from typing import Any

SLOW_NOTE = re.compile(r"\[sleep=(\d+(?:\.\d+)?)\]")
#: A Charge whose note holds this kills its worker process (SIGKILL) as it is
#: saved: a crash in the middle of a view, after what the view did before.
CRASH_NOTE = "[crash]"


def slow_note(seconds: float) -> str:
    """The note suffix that makes a Charge's save wait ``seconds``."""
    return f"[sleep={seconds}]"


def _slow_charge(sender: Any, instance: Any, **kwargs: Any) -> None:
    note = getattr(instance, "note", "") or ""
    if CRASH_NOTE in note:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # never reached: SIGKILL cannot be caught
    match = SLOW_NOTE.search(note)
    if match:
        time.sleep(min(float(match.group(1)), 5.0))


def _log_server_errors() -> None:
    """Send ``django.request`` errors (500s, with their traceback) to the server log.

    With ``DEBUG = False`` Django's default logging prints them nowhere; the
    live tests quote the log's tail when a round goes wrong.
    """
    logger = logging.getLogger("django.request")
    if not any(getattr(h, "_idempotency_live", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("[%(process)d] [%(levelname)s] %(name)s: %(message)s")
        )
        handler._idempotency_live = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def install() -> None:
    from django.db.models.signals import pre_save

    from tests.testapp.models import Charge

    pre_save.connect(_slow_charge, sender=Charge, dispatch_uid="tests.live.hooks.slow_charge")
    _log_server_errors()
