"""Test-only behaviour of the live server process (installed by ``tests.live.wsgi``).

Server errors are logged with their traceback (see ``_log_server_errors``).

The ``IdempotentMixin`` and ViewSet test views take their input through a
serializer that knows only ``amount`` and ``note``, so they cannot be asked
to ``sleep`` like the ``@api_view`` one. To widen their race window all the
same, a Charge whose note contains ``[sleep=<seconds>]`` makes its save wait
that long: inside the view, after the claim, while the claim is held, exactly
where the ``sleep`` of the other views waits. One whose note contains
``[crash]`` SIGKILLs the worker process instead.

``crash_after_record_insert()``, called by a view, kills the worker right
after the next INSERT into the records' table on this thread has run: in the
optimistic mode, the finished record's INSERT, before the COMMIT
(tests/testapp/optimistic_live_views.py). ``hold_after_record_insert(seconds)``
sleeps there instead: the record's index entry stays uncommitted that long,
and a duplicate's INSERT waits on it. A wrapper on every connection watches
the statements (``connection.execute_wrapper``), so the library needs no hook.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
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


RECORD_INSERT = re.compile(r"\bINSERT\s+INTO\s+[\"`]?django_idempotency_record\b", re.IGNORECASE)
_armed = threading.local()


def crash_after_record_insert() -> None:
    """Kill this process after the next INSERT into the records' table on this thread."""
    _armed.record_insert = True


def hold_after_record_insert(seconds: float) -> None:
    """Sleep ``seconds`` after the next INSERT into the records' table on this thread."""
    _armed.hold = seconds


def _disarm(**kwargs: Any) -> None:
    _armed.record_insert = False
    _armed.hold = 0.0


def _after_record_insert(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
) -> Any:
    result = execute(sql, params, many, context)  # only a record INSERT that ran gets further
    if not RECORD_INSERT.search(sql):
        return result
    if getattr(_armed, "record_insert", False):
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # never reached: SIGKILL cannot be caught
    hold = getattr(_armed, "hold", 0.0)
    if hold:
        _armed.hold = 0.0
        time.sleep(min(hold, 5.0))
    return result


def _watch_statements(sender: Any, connection: Any, **kwargs: Any) -> None:
    if _after_record_insert not in connection.execute_wrappers:
        connection.execute_wrappers.append(_after_record_insert)


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
    from django.core.signals import request_started
    from django.db.backends.signals import connection_created
    from django.db.models.signals import pre_save

    from tests.testapp.models import Charge

    pre_save.connect(_slow_charge, sender=Charge, dispatch_uid="tests.live.hooks.slow_charge")
    connection_created.connect(_watch_statements, dispatch_uid="tests.live.hooks.watch_statements")
    request_started.connect(_disarm, dispatch_uid="tests.live.hooks.disarm")
    _log_server_errors()
