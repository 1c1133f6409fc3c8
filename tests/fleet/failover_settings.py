"""Settings for the failover tests: ``tests.settings`` with a short lease.

A record whose claim reached the standby but whose completion did not
survives the failover as CLAIMED, its owner gone with the old primary's
connections; the retry is refused (409) until the lease ends, then takes
the record over. A lease of a few seconds lets the test see that within
its time.
"""

from __future__ import annotations

from typing import Any

from tests import settings as _base
from tests.settings import *  # noqa: F403

# Whatever a configuration of the matrix set (tests/configurations/), and the lease.
_configured: dict[str, Any] = dict(getattr(_base, "IDEMPOTENCY", {}))
IDEMPOTENCY: dict[str, Any] = {**_configured, "LEASE": 4.0}
