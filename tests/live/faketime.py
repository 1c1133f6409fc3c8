"""Processes with a clock of their own: libfaketime (Debian package ``faketime``).

``skewed_clock(offset)`` is the environment that makes a child process see
its wall clock ``offset`` off (``"+10m"``, ``"-10m"``, ``"+3d"``): the
library preloaded with ``FAKETIME`` set, which is what ``faketime -f
<offset> <command>`` does, minus the wrapper process. The wrapper is left
out on purpose: it forks the command and waits for it, so the SIGTERM the
harness sends to stop a gunicorn master or a Celery worker would reach the
wrapper, not the server. Every descendant (gunicorn's workers, Celery's pool)
inherits the environment, so the whole server shares the skew.

The monotonic clock is skewed too. ``FAKETIME_DONT_FAKE_MONOTONIC=1`` would
keep it true, but libfaketime 0.9.10 (Debian 12) then fails every
``time.sleep()`` with EINVAL (CPython sleeps with ``clock_nanosleep(
CLOCK_MONOTONIC, TIMER_ABSTIME)``, whose deadline the library shifts). With
both clocks shifted alike, durations measured inside a process stay right;
only a comparison of monotonic readings across processes with different
clocks would not, and nothing makes one (gunicorn's worker heartbeat is
written and read by processes of one server, which share its clock).

``require_libfaketime()`` skips the calling test when the library is
missing, or fails it under ``IDEMPOTENCY_REQUIRE_SERVICES=1`` (CI).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from tests.live.services import REQUIRE_SERVICES_ENV, services_required

#: A libfaketime.so.1 to use instead of the one installed (or a missing path,
#: to see the test fail as CI would without the package).
LIBFAKETIME_ENV = "IDEMPOTENCY_TEST_LIBFAKETIME"
#: Where distributions install the library (Debian and Ubuntu: the multiarch one).
CANDIDATES = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
)


def libfaketime_path() -> Path | None:
    """The installed ``libfaketime.so.1``, or ``None``."""
    chosen = os.environ.get(LIBFAKETIME_ENV)
    if chosen:
        return Path(chosen) if Path(chosen).is_file() else None
    for pattern in CANDIDATES:
        for found in sorted(glob.glob(pattern)):
            return Path(found)
    return None


def require_libfaketime() -> Path:
    """The library's path; else skip the test (fail it under IDEMPOTENCY_REQUIRE_SERVICES=1)."""
    path = libfaketime_path()
    if path is not None:
        return path
    where = os.environ.get(LIBFAKETIME_ENV) or ", ".join(CANDIDATES)
    reason = f"libfaketime is not installed (looked for {where}; apt-get install faketime)"
    if services_required():
        pytest.fail(
            f"libfaketime is required ({REQUIRE_SERVICES_ENV}=1) but unavailable: {reason}",
            pytrace=False,
        )
    pytest.skip(f"{reason}; set {REQUIRE_SERVICES_ENV}=1 to make this a failure")


def skewed_clock(offset: str | None) -> dict[str, str]:
    """Environment variables for a child whose wall clock is ``offset`` off (None: true)."""
    if offset is None:
        return {}
    library = require_libfaketime()
    preload = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD", "")]))
    return {
        "LD_PRELOAD": preload,
        "FAKETIME": offset,
    }


def offset_seconds(offset: str | None) -> float:
    """``"+10m"`` as seconds (600.0); ``None`` as 0."""
    if offset is None:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    sign = -1.0 if offset.startswith("-") else 1.0
    body = offset.lstrip("+-")
    unit = units.get(body[-1], 1)
    number = body[:-1] if body[-1] in units else body
    return sign * float(number) * unit
