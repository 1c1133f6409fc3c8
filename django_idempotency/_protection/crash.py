"""The crash that ``testing.simulate_crash_after_begin_external`` stages.

The request path has to know about it (``context`` raises it right after
the intent commits, ``protection`` lets it pass without cleaning up), but
must not import the test helpers to do so: this module is the small part
both sides share. Users import ``SimulatedCrash`` from ``testing``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_crash = threading.local()


class SimulatedCrash(BaseException):
    """Raised where ``simulate_crash_after_begin_external`` makes the process "die".

    A BaseException, so that no ``except Exception`` in the view catches it;
    the package lets it pass without any cleanup, as a killed process would.
    """


def crash_requested() -> bool:
    """Whether the next ``begin_external()`` on this thread should "crash"."""
    return bool(getattr(_crash, "armed", False))


@contextmanager
def armed() -> Iterator[None]:
    """Request the crash for the duration of the block, on this thread."""
    _crash.armed = True
    try:
        yield
    finally:
        _crash.armed = False
