"""The operation status view, for ``path("idempotency/", include("django_idempotency.urls"))``.

Reversed as ``django_idempotency:status``.
"""

from __future__ import annotations

from django.urls import path

from django_idempotency.status import OperationStatusView

__all__ = [
    "app_name",
    "urlpatterns",
]

app_name = "django_idempotency"

urlpatterns = [
    path("status/", OperationStatusView.as_view(), name="status"),
]
