"""Django settings of the live tests' Celery worker and beat processes.

The test settings, plus the one knob those processes need that the suite
does not: a lease short enough that a worker SIGKILLed mid-task has its
claim taken over within the test (``IDEMPOTENCY_TEST_LEASE``, seconds;
default the package's two minutes). The database comes from
``DATABASE_URL``, as for every process that loads ``tests.settings``.
"""

from __future__ import annotations

import os
from datetime import timedelta

from tests.settings import *  # noqa: F403  (these are the test settings, extended)

IDEMPOTENCY = {"LEASE": timedelta(seconds=float(os.environ.get("IDEMPOTENCY_TEST_LEASE", "120")))}
