"""The Ninja operations behind a URL pattern's view, and their ``ATOMIC_REQUESTS``.

Ninja routes each path to a function made by ``PathView.get_view()``,
which closes over the ``PathView`` holding the path's operations (one per
method or set of methods); Django's URL pattern has only the function.
The system checks, the metrics' operation names and the middleware find
the operations from it here.

``ATOMIC_REQUESTS`` wraps that function in a transaction, where a claim
could not commit before the operation runs. A URL with protected
operations is marked exempt the way Django reads it
(``_non_atomic_requests``), as ``@idempotent`` marks a view: the protection
opens the transactions after the claim. Its other operations are put back
into the blocks Django would have opened for them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ninja.operation import Operation, PathView

from django_idempotency._ninja.operations import (
    RUN_OUTSIDE_DJANGOS_BLOCKS,
    Protection,
    protection_of,
)
from django_idempotency._protection.transactions import run_as_django_would
from django_idempotency.decorators import EVERY_DATABASE


def path_view_of(view: object) -> PathView | None:
    """The ``PathView`` whose operations a URL pattern's view runs; None for other views."""
    owner = getattr(view, "__self__", None)  # a bound _sync_view, in some releases
    if isinstance(owner, PathView):
        return owner
    for cell in getattr(view, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, PathView):
            return contents
    return None


def protected_operations(view: object) -> list[tuple[Operation, Protection]] | None:
    """The protected operations of a Ninja URL's view; None when it is no Ninja view."""
    path_view = path_view_of(view)
    if path_view is None:
        return None
    found = []
    for operation in path_view.operations:
        protection = protection_of(operation)
        if protection is not None:
            found.append((operation, protection))
    return found


def exempt_from_atomic_requests(view: Callable[..., Any]) -> bool:
    """Exempt a Ninja URL's view from ``ATOMIC_REQUESTS`` if it has a protected operation.

    Returns whether it has one. Its unprotected operations that Django would
    have run in a transaction (the sync ones) still are.
    """
    path_view = path_view_of(view)
    if path_view is None:
        return False
    operations = path_view.operations
    if not any(protection_of(operation) is not None for operation in operations):
        return False
    view._non_atomic_requests = EVERY_DATABASE  # type: ignore[attr-defined]
    for operation in operations:
        if (
            protection_of(operation) is None
            and not operation.is_async  # Django refuses ATOMIC_REQUESTS to async views
            and not hasattr(operation, RUN_OUTSIDE_DJANGOS_BLOCKS)
        ):
            setattr(operation, RUN_OUTSIDE_DJANGOS_BLOCKS, operation.run)
            operation.run = _as_django_would(operation.run)  # type: ignore[method-assign]
    return True


def _as_django_would(run: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run)
    def in_django_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
        return run_as_django_would(lambda: run(request, *args, **kwargs))

    return in_django_blocks
