"""The crashes that ``testing``'s ``simulate_crash_after_*`` helpers stage.

The request path has to know about them (``context`` raises one right after
a write commits, ``protection`` lets it pass without cleaning up), but must
not import the test helpers to do so: this module is the small part both
sides share. Users import ``SimulatedCrash`` from ``testing``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

#: The writes of ``IdempotencyContext`` after which a crash can be staged.
CrashPoint = Literal["begin_external", "set_provider_operation"]

_crash = threading.local()


class SimulatedCrash(BaseException):
    """Raised where a ``simulate_crash_after_*`` helper makes the process "die".

    A BaseException, so that no ``except Exception`` in the view catches it;
    the package lets it pass without any cleanup, as a killed process would.
    A client double may raise it too, to die where no helper can: after the
    provider did the work, before its answer reached the view.
    """


@dataclass(frozen=True)
class _Staged:
    after: CrashPoint
    #: The step whose write crashes; ``None``: the next such write, of any step.
    step: str | None


def crash_requested(after: CrashPoint, step: str | None) -> bool:
    """Whether the write ``after`` of ``step`` (``None``: the one call) should "crash" now."""
    staged: _Staged | None = getattr(_crash, "staged", None)
    if staged is None or staged.after != after:
        return False
    return staged.step is None or staged.step == step


@contextmanager
def armed(after: CrashPoint = "begin_external", step: str | None = None) -> Iterator[None]:
    """Request the crash for the duration of the block, on this thread."""
    _crash.staged = _Staged(after, step)
    try:
        yield
    finally:
        _crash.staged = None
