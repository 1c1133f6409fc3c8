"""Safe retries for Django REST Framework mutations, keyed by ``Idempotency-Key``.

The names most projects need, importable from here::

    from django_idempotency import idempotent, IdempotentMixin, idempotent_task

and ``idempotent_exempt``, which leaves a view out of what
``django_idempotency.middleware.IdempotencyMiddleware`` protects.

Each is loaded at first use, so that ``import django_idempotency`` works
before ``django.setup()`` (settings files and AppConfig discovery import
the package) and without the extras a name needs (``idempotent_task``
needs Celery). Modules whose names start with an underscore are private.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "1.0.0rc1"
__all__ = ["IdempotentMixin", "idempotent", "idempotent_exempt", "idempotent_task"]

if TYPE_CHECKING:
    from django_idempotency.decorators import idempotent, idempotent_exempt
    from django_idempotency.drf import IdempotentMixin
    from django_idempotency.tasks import idempotent_task

_HOMES = {
    "idempotent": "django_idempotency.decorators",
    "idempotent_exempt": "django_idempotency.decorators",
    "IdempotentMixin": "django_idempotency.drf",
    "idempotent_task": "django_idempotency.tasks",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
