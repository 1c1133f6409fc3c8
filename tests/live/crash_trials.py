"""What every crash trial does after its kill: recovery, then the client's retries.

Shared by the single-call (test_crashes.py) and two-step
(test_two_step_crashes.py) crash tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from tests.live.processes import PaymentsStack
from tests.live.server import Result, post

__all__ = [
    "LEASE_MARGIN",
    "SETTLE_DEADLINE",
    "recover_then_retry",
]

#: How long a trial may take to get a non-409 answer after its crash.
SETTLE_DEADLINE = 60.0
#: Beyond the lease, before recovery is sent: clocks and scheduling.
LEASE_MARGIN = 0.3


class Settling(Protocol):
    body: dict[str, Any]
    recoveries: list[dict[str, int]]
    retries: list[Result]
    final: Result | None


def recover_then_retry(
    stack: PaymentsStack,
    trial: Settling,
    url: str,
    headers: dict[str, str],
    *,
    crashed_at: float,
    lease_over: Callable[[], bool],
) -> None:
    """Wait out the dead owner's lease, run recovery, retry until the answer is not 409.

    A retry still answered 409 a lease after the last recovery runs one more,
    as beat would: another trial's recovery may have run just before this
    record's lease ran out.
    """
    time.sleep(max(0.0, crashed_at + stack.lease + LEASE_MARGIN - time.monotonic()))
    deadline = time.monotonic() + 30
    while not lease_over():
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.1)
    trial.recoveries.append(stack.recover())
    last_recovery = time.monotonic()

    deadline = time.monotonic() + SETTLE_DEADLINE
    while time.monotonic() < deadline:
        answer = post(url, trial.body, headers)
        trial.retries.append(answer)
        if answer.status != 409:
            trial.final = answer
            return
        time.sleep(0.2)
        if time.monotonic() - last_recovery > stack.lease + LEASE_MARGIN:
            trial.recoveries.append(stack.recover())
            last_recovery = time.monotonic()
