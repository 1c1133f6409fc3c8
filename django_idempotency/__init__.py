"""Safe retries for Django REST Framework mutations, keyed by ``Idempotency-Key``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"
__all__ = ["idempotent"]

if TYPE_CHECKING:
    from django_idempotency.decorators import idempotent


def __getattr__(name: str) -> Any:
    # Imported lazily so that ``import django_idempotency`` works before
    # ``django.setup()`` (settings files and AppConfig discovery import us).
    if name == "idempotent":
        from django_idempotency.decorators import idempotent

        return idempotent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
