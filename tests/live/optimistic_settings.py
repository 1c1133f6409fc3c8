"""``tests.settings`` with IN_FLIGHT and IN_FLIGHT_WAIT from the environment.

``IDEMPOTENCY_IN_FLIGHT_WAIT`` (seconds): for the optimistic mode's live
test of losers that give up, the winner holding its record uncommitted
longer than they are willing to wait (the ``lock_timeout`` of their
record's INSERT on PostgreSQL). ``IDEMPOTENCY_IN_FLIGHT`` ("conflict" or "wait"): for
benchmarks/contention.py, the default mode's duplicates answered 409 at once
or waiting for the outcome.
"""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403

IDEMPOTENCY = dict(globals().get("IDEMPOTENCY", {}))
if os.environ.get("IDEMPOTENCY_IN_FLIGHT"):
    IDEMPOTENCY["IN_FLIGHT"] = os.environ["IDEMPOTENCY_IN_FLIGHT"]
if os.environ.get("IDEMPOTENCY_IN_FLIGHT_WAIT"):
    IDEMPOTENCY["IN_FLIGHT_WAIT"] = float(os.environ["IDEMPOTENCY_IN_FLIGHT_WAIT"])
