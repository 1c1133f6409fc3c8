"""``tests.settings`` with IN_FLIGHT_WAIT from ``IDEMPOTENCY_IN_FLIGHT_WAIT`` (seconds).

For the optimistic mode's live test of losers that give up: the winner
holds its rows longer than they are willing to wait (the transaction-local
``lock_timeout`` the mode sets on PostgreSQL).
"""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403

IDEMPOTENCY = {
    **globals().get("IDEMPOTENCY", {}),
    "IN_FLIGHT_WAIT": float(os.environ.get("IDEMPOTENCY_IN_FLIGHT_WAIT", "10")),
}
