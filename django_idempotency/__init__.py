"""Safe retries for Django REST Framework mutations, keyed by ``Idempotency-Key``.

The names most projects need, importable from here::

    from django_idempotency import idempotent, IdempotentMixin, idempotent_task

and ``idempotent_exempt``, which leaves a view out of what
``django_idempotency.middleware.IdempotencyMiddleware`` protects.

Each is loaded at first use, so that ``import django_idempotency`` works
before ``django.setup()`` (settings files and AppConfig discovery import
the package). ``idempotent_task`` needs neither Celery nor Django's Tasks
framework: it is the same decorator under either one's task decorator.
Modules whose names start with an underscore are private.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "1.0.0rc1"
__all__ = ["IdempotentMixin", "idempotent", "idempotent_exempt", "idempotent_task"]

if TYPE_CHECKING:
    from django_idempotency._protection.task import idempotent_task
    from django_idempotency.decorators import idempotent, idempotent_exempt
    from django_idempotency.drf import IdempotentMixin

_HOMES = {
    "idempotent": "django_idempotency.decorators",
    "idempotent_exempt": "django_idempotency.decorators",
    "IdempotentMixin": "django_idempotency.drf",
    # The run loop's own home, not tasks.py: that one needs Celery.
    "idempotent_task": "django_idempotency._protection.task",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
