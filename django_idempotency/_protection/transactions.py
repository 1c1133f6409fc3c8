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

from django.db import connections, transaction

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
    opened: list[str] = []
    with ExitStack() as stack:
        for alias, settings_dict in connections.settings.items():
            wanted = alias == records_database or (
                settings_dict.get("ATOMIC_REQUESTS") and not connections[alias].in_atomic_block
            )
            if wanted:
                stack.enter_context(transaction.atomic(using=alias))
                opened.append(alias)
        yield opened


def run_unprotected(view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
    with view_transactions():
        return view()


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
