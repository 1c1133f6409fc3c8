"""The run of a protected view, one loop for both modes: view, verdict, record or rollback.

Both modes run the view in its transactions, ask the outcome policy for a
verdict, roll everything back for a release or an uncertain answer, keep
a definitive answer from a transaction marked for rollback to be stored
on its own afterwards, and otherwise write the record before the commit.
What differs is a small strategy, a ``Recording``: which transactions are
the view's, how the record is written (the owner's UPDATE of its claim,
or the optimistic mode's one INSERT, which a duplicate may win), whether
a rolled-back success is refused at once, and which rollback a refusal
from DRF's handler marks. A database error is read the same way in both
(``what_a_lost_store_means``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from django.db import transaction

from django_idempotency._protection.transactions import writes_discarded
from django_idempotency._store.errors import is_connection_lost
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import (
    IdempotencyRefusal,
    OutcomeUncertain,
    RolledBackResponse,
    StoreUnavailable,
)
from django_idempotency.responses import StoredResponse, Verdict, capture

if TYPE_CHECKING:
    from django.http import HttpResponseBase

    from django_idempotency.outcomes import Outcome
    from django_idempotency.scope import Scope


logger = logging.getLogger("django_idempotency")


class Phase(enum.Enum):
    """How far a run got: what a database error then means."""

    #: Nothing ran yet (the optimistic mode's lookup): the one outage FAIL_OPEN may answer.
    LOOKUP = "lookup"
    VIEW = "view"
    #: The view answered; its outcome is being decided and written.
    COMPLETING = "completing"
    #: The record was written; the transaction is committing.
    COMMITTING = "committing"


class Progress:
    """The phase a run has reached, read by whoever handles its error."""

    __slots__ = ("phase",)

    def __init__(self, phase: Phase = Phase.VIEW) -> None:
        self.phase = phase


@dataclass(frozen=True)
class Ran:
    """What the view answered, and what became of its transaction."""

    response: HttpResponseBase
    verdict: Verdict
    #: The record was written; it commits with the view's writes.
    recorded: bool = False
    #: The record's write found the key taken: a duplicate won.
    lost: bool = False
    #: The view's writes were discarded (a transaction marked for rollback:
    #: DRF does so under ATOMIC_REQUESTS, and so does a database error the
    #: view caught without a savepoint).
    discarded: bool = False
    #: A definitive refusal from such a transaction: stored on its own, after.
    store_after: StoredResponse | None = None


class Recording(Protocol):
    """What a mode does differently in the run (the strategy)."""

    scope: Scope
    #: A success whose writes were discarded is refused at once, inside the
    #: transaction (the owner's claim then rolls back with it), rather than
    #: after the others had their say (the optimistic mode asks the winner).
    refuses_a_rolled_back_success_at_once: bool

    def transactions(self) -> AbstractContextManager[list[str]]:
        """The view's transactions; yields every alias to roll back with the view."""
        ...

    def refusal_discarded(self) -> bool:
        """Whether a definitive refusal's transaction is marked for rollback."""
        ...

    def write(self, verdict: Verdict, stored: StoredResponse) -> bool:
        """Write the record in the view's transaction; False: a duplicate's record won."""
        ...


def run_view(
    view: Callable[[], HttpResponseBase],
    policy: Outcome,
    recording: Recording,
    progress: Progress,
) -> Ran:
    """Run the view in its transactions and leave them ready to commit or roll back."""
    conf = idempotency_settings
    with recording.transactions() as everything:
        response = view()
        progress.phase = Phase.COMPLETING
        verdict = policy(response)
        if verdict in (Verdict.RELEASE, Verdict.UNCERTAIN):
            # The retry, or the reconciler, starts from a clean slate.
            _roll_back(everything)
            return Ran(response, verdict)
        if verdict is Verdict.COMPLETED and writes_discarded():
            if recording.refuses_a_rolled_back_success_at_once:
                raise rolled_back_success(recording.scope, response)
            _roll_back(everything)
            return Ran(response, verdict, discarded=True)
        stored = capture(response, conf.STORED_HEADERS, conf.MAX_STORED_BODY)
        if recording.refusal_discarded():
            # The view's writes are undone, so the refusal is stored on its own.
            _roll_back(everything)
            return Ran(response, verdict, discarded=True, store_after=stored)
        if not recording.write(verdict, stored):
            _roll_back(everything)
            return Ran(response, verdict, lost=True)
        progress.phase = Phase.COMMITTING
        return Ran(response, verdict, recorded=True)


def _roll_back(aliases: list[str]) -> None:
    for alias in aliases:
        transaction.set_rollback(True, using=alias)


def what_a_lost_store_means(
    scope: Scope,
    exc: Exception,
    phase: Phase,
    *,
    external_begun: bool,
    released: bool,
    retry_after: int,
) -> IdempotencyRefusal | None:
    """The refusal that says what is known after a database error; None: the view's own.

    ``released``: the claim was given back after the error (a CLAIMED
    record deleted by the release proves the commit did not happen). A
    view's own error (a deadlock, a timeout, a bug) is None: it surfaces as
    it is, or as the mode makes of it.
    """
    lost = is_connection_lost(exc)
    committed_maybe = phase is Phase.COMMITTING and lost and not released
    if committed_maybe or (phase is not Phase.VIEW and external_begun):
        # The commit may have happened, or an external call did and its
        # outcome could not be recorded: never "not run".
        logger.error("Could not record the outcome of %s (%s); answering 503.", scope, exc)
        return OutcomeUncertain(retry_after=retry_after)
    if lost:
        # The store went away: the view's writes rolled back with its session.
        logger.error("Idempotency store lost during %s (%s); answering 503.", scope, exc)
        if external_begun:
            return OutcomeUncertain(retry_after=retry_after)
        return StoreUnavailable(retry_after=retry_after)
    return None


def rolled_back_success(scope: Scope, response: HttpResponseBase) -> RolledBackResponse:
    return RolledBackResponse(
        f"The view answered {response.status_code} for {scope}, but its transaction "
        "(on one of its databases) was marked for rollback (a database error caught "
        "without a savepoint?), so its writes are discarded. Not stored; the claim is "
        "released and the retry runs. Wrap the statement that may fail in its own "
        "transaction.atomic() block."
    )
