"""Deprecated: the purge lives in ``django_idempotency.purge``.

Kept so that code written against the documented ``django_idempotency.eviction``
path still imports; it will be removed in a later release.
"""

from __future__ import annotations

import warnings

from django_idempotency.purge import PurgeReport, expired_count, purge_expired_records

__all__ = ["PurgeReport", "expired_count", "purge_expired_records"]

warnings.warn(
    "django_idempotency.eviction is deprecated: import from django_idempotency.purge.",
    DeprecationWarning,
    stacklevel=2,
)
