from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

__all__ = [
    "IdempotencyConfig",
]


class IdempotencyConfig(AppConfig):
    name = "django_idempotency"
    label = "django_idempotency"
    verbose_name = _("Idempotency")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_idempotency import (
            _routes,
            checks,  # noqa: F401  (registers the checks)
        )
        from django_idempotency._observability import labels

        # The protected views' operation names are metrics labels; read from
        # the URLconf when a name first needs them, not here (it may import
        # this app's models).
        labels.declare_source(_routes.protected_operations)

        try:
            import drf_spectacular  # noqa: F401
        except ImportError:
            return
        from django_idempotency import _openapi  # noqa: F401  (registers the extensions)
