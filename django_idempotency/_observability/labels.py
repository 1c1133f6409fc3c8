"""The ``operation`` label: an operation name the code declares, else "other".

A bound by first use in each process does not bound a deployment: under
gunicorn every new worker (``max_requests``, a timeout, a deploy) admitted
another ``METRICS_OPERATIONS`` names, and the files of the dead ones kept
their series in ``PROMETHEUS_MULTIPROC_DIR`` (83 values against a bound of
10 + "other"). So a name is a label only when it is written in the code,
the same in every process of one release:

- a request's name taken from its route (the method plus the pattern, or
  the URL's name) or from a literal ``operation="..."`` (the caller says
  so: ``from_code``);
- an ``idempotent_task``'s name and an operation with a reconciler
  (``declare``, when they are decorated);
- any name a protected view of ``ROOT_URLCONF`` gives its records, the
  views ``IdempotencyMiddleware`` protects included (``declare_source``:
  read from the URLconf at the first name that needs it, for recovery,
  which finds names on records).

Everything else, names a callable makes per request and a path with no
route pattern, is "other". ``METRICS_OPERATIONS`` stays a per-process
ceiling on top, for a project that protects more operations than a
backend should label.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from django.core.signals import setting_changed

from django_idempotency.conf import idempotency_settings

logger = logging.getLogger("django_idempotency")

OTHER = "other"

_declared: set[str] = set()
_sources: list[Callable[[], Iterable[str]]] = []
#: The sources' names, read at the first name that is not otherwise declared.
_found: frozenset[str] | None = None
_finding = threading.Lock()
#: The names this process has labelled, against METRICS_OPERATIONS.
_labelled: set[str] = set()
_ceiling_logged = False


def declare(operation: str) -> None:
    """Label ``operation`` by its name: a task's or a reconciler's, known at import."""
    _declared.add(operation)


def declare_source(source: Callable[[], Iterable[str]]) -> None:
    """Label the names ``source`` returns; called once, when a name first needs it."""
    global _found
    if source not in _sources:  # django.setup() again: one source still
        _sources.append(source)
        _found = None


def operation_label(operation: str, *, from_code: bool = False) -> str:
    """``operation`` when the code declares it (and the process's ceiling allows), else "other"."""
    if operation in _labelled:
        return operation
    if not (from_code or operation in _declared or operation in _names_of_sources()):
        return OTHER
    if len(_labelled) >= idempotency_settings.METRICS_OPERATIONS:
        _log_ceiling(operation)
        return OTHER
    _labelled.add(operation)
    return operation


def _names_of_sources() -> frozenset[str]:
    global _found
    found = _found
    if found is not None:
        return found
    with _finding:
        if _found is None:
            names: set[str] = set()
            for source in _sources:
                try:
                    names.update(source())
                except Exception:  # a URLconf that cannot be loaded must not fail a count
                    logger.exception("The operation names of %r could not be read.", source)
            _found = frozenset(names)
        return _found


def _log_ceiling(operation: str) -> None:
    global _ceiling_logged
    if not _ceiling_logged:
        _ceiling_logged = True
        logger.warning(
            "The operation %r and any further one are counted as 'other': this process "
            "labelled IDEMPOTENCY['METRICS_OPERATIONS'] = %d operations already. Raise it "
            "above the number of protected operations.",
            operation,
            idempotency_settings.METRICS_OPERATIONS,
        )


def _forget(*, setting: str, **kwargs: Any) -> None:
    global _found, _ceiling_logged
    # OPERATION_NAMES renames; a URLconf, or the middleware, adds protected operations.
    if setting in ("IDEMPOTENCY", "ROOT_URLCONF", "MIDDLEWARE"):
        _found = None
        _labelled.clear()
        _ceiling_logged = False


setting_changed.connect(_forget, dispatch_uid="django_idempotency._observability.labels")
