"""The transactions a protected view runs in.

Protected views are exempt from Django's ``ATOMIC_REQUESTS`` (the claim has
to commit before the view starts); these put the view back into the
transactions it would have had, after the claim, and tell whether what it
wrote will be kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, transaction

if TYPE_CHECKING:
    from django.http import HttpResponseBase


@contextmanager
def view_transactions(*, records_database: str | None = None) -> Iterator[list[str]]:
    """Open what ``ATOMIC_REQUESTS`` would have opened, plus ``records_database``.

    Protected views are exempt from Django's ``ATOMIC_REQUESTS`` (the claim
    has to commit before the view starts); this puts the view back into a
    transaction on every such database, after the claim. Yields the aliases
    whose block was opened here.
    """
    opened = [
        alias
        for alias, settings_dict in connections.settings.items()
        if alias == records_database
        or (settings_dict.get("ATOMIC_REQUESTS") and not connections[alias].in_atomic_block)
    ]
    if len(opened) == 1:  # the records' database alone, nearly always: no ExitStack
        with transaction.atomic(using=opened[0]):
            yield opened
        return
    with ExitStack() as stack:
        for alias in opened:
            stack.enter_context(transaction.atomic(using=alias))
        yield opened


def run_unprotected(view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
    with view_transactions():
        return view()


def run_as_django_would(view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
    """Run ``view`` in the blocks Django's ``ATOMIC_REQUESTS`` opens for a view not exempt.

    One per such database, a savepoint where a block is open already (a
    test's): the handler of an exempt class that it does not protect (a GET,
    a 405) is then the view Django would have run, savepoint included, which
    takes DRF's rollback mark on a refusal.
    """
    with ExitStack() as stack:
        for alias, settings_dict in connections.settings.items():
            if settings_dict.get("ATOMIC_REQUESTS"):
                stack.enter_context(transaction.atomic(using=alias))
        return view()


class CallersMarks:
    """The rollback marks of the atomic blocks open now, to put back after a refusal.

    DRF's exception handler marks the open atomic block of every
    ``ATOMIC_REQUESTS`` database for rollback. A protected view is exempt
    from them and opens none before its claim, so a block open then is the
    caller's: ``TestCase``'s, pytest-django's ``django_db``, or an
    ``atomic()`` around the call. A refusal wrote nothing there, and must not
    make the caller's next query raise ``TransactionManagementError``. (One
    caused by a database error keeps the mark: that transaction may well be
    broken.)
    """

    def __init__(self) -> None:
        self.marks = {
            connection.alias: connection.needs_rollback
            for connection in connections.all(initialized_only=True)
            if connection.in_atomic_block
        }

    def put_back(self, refusal: BaseException) -> None:
        """Undo the marks set since, unless ``refusal`` came of a database error."""
        if isinstance(refusal, DatabaseError) or isinstance(refusal.__cause__, DatabaseError):
            return
        for alias, mark in self.marks.items():
            connections[alias].needs_rollback = mark


@contextmanager
def callers_transactions_left_alone(refusal: BaseException) -> Iterator[None]:
    """Answer ``refusal`` inside: the caller's transactions stay as they were (``CallersMarks``)."""
    marks = CallersMarks()
    try:
        yield
    finally:
        marks.put_back(refusal)


def writes_discarded() -> bool:
    """Whether the view's writes on some database will be rolled back.

    Every open transaction counts, not only those opened here: an ``@api_view``
    function is not exempt from ``ATOMIC_REQUESTS``, so Django's own request
    transaction holds its writes on such a database.
    """
    return any(
        connection.in_atomic_block and connection.needs_rollback
        for connection in connections.all(initialized_only=True)
    )


def durable_block_refused(error: BaseException) -> str | None:
    """The database of the ``atomic(durable=True)`` block Django refused with ``error``, if so.

    Django raises a bare ``RuntimeError`` from the block's ``__enter__``
    when it is nested in another: read off the frame that raised it (the
    block itself), not off the message's wording.
    """
    if not isinstance(error, RuntimeError) or error.__traceback__ is None:
        return None
    last = error.__traceback__
    while last.tb_next is not None:
        last = last.tb_next
    block = last.tb_frame.f_locals.get("self")
    # django-stubs do not declare Atomic's ``durable`` (Django 3.2+).
    if isinstance(block, transaction.Atomic) and getattr(block, "durable", False):
        return block.using or DEFAULT_DB_ALIAS
    return None
