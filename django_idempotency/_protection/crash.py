"""The crashes that ``testing``'s ``simulate_crash_after_*`` helpers stage.

The request path has to know about them (``context`` raises one right after
a write commits, ``protection`` lets it pass without cleaning up), but must
not import the test helpers to do so: this module is the small part both
sides share. Users import ``SimulatedCrash`` from ``testing``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

#: The writes of ``IdempotencyContext`` after which a crash can be staged.
CrashPoint = Literal["begin_external", "set_provider_operation"]


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


#: A context variable, not a thread-local: asgiref's ``sync_to_async`` runs
#: an async view's claim and writes in a thread of its own, in a copy of the
#: caller's context, so an async test arms the request it awaits; a thread
#: of the caller's starts with a context of its own, unarmed, as before.
_staged: ContextVar[_Staged | None] = ContextVar("django_idempotency_staged_crash", default=None)


def crash_requested(after: CrashPoint, step: str | None) -> bool:
    """Whether the write ``after`` of ``step`` (``None``: the one call) should "crash" now."""
    staged = _staged.get()
    if staged is None or staged.after != after:
        return False
    return staged.step is None or staged.step == step


@contextmanager
def armed(after: CrashPoint = "begin_external", step: str | None = None) -> Iterator[None]:
    """Request the crash for the duration of the block, here and in the async code awaited here."""
    token = _staged.set(_Staged(after, step))
    try:
        yield
    finally:
        _staged.reset(token)
