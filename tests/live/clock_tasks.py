"""A Celery task for the clock-skew tests: the wall clock of the worker process that runs it.

Loaded into ``tests.live.celery_app`` workers with ``--include
tests.live.clock_tasks``; it tells the test that the pool process which runs
the recovery task really has a skewed clock.
"""

from __future__ import annotations

import os
import time

from celery import shared_task

__all__ = ["wall_clock"]


@shared_task(name="tests.live.clock_tasks.wall_clock")
def wall_clock() -> dict[str, float]:
    return {"time": time.time(), "pid": float(os.getpid())}
