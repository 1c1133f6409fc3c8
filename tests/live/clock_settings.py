"""Django settings of the clock-skew tests' gunicorn servers, Celery workers and purge.

The test settings (with the matrix's configuration applied), serving
``tests.live.clock_app``, with the idempotency lease from
``IDEMPOTENCY_TEST_LEASE`` (seconds): shorter than the skew the tests give
the clocks, so that a process judging the lease by its own clock misjudges
it. The database comes from ``DATABASE_URL``.
"""

from __future__ import annotations

import os
from datetime import timedelta

from tests.settings import *  # noqa: F403  (these are the test settings, extended)

ROOT_URLCONF = "tests.live.clock_app"
IDEMPOTENCY = {
    **globals().get("IDEMPOTENCY", {}),
    "LEASE": timedelta(seconds=float(os.environ.get("IDEMPOTENCY_TEST_LEASE", "120"))),
}
