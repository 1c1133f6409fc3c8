"""A router by tenant: each tenant's records go to its shard (IDEMPOTENCY["DATABASE"] = None)."""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "SHARDS",
    "TenantShardRouter",
    "shard_of",
]

#: Tenant -> the alias holding its data; the aliases are defined by the
#: settings (tests/settings.py, tests/live/shards_settings.py).
SHARDS = {"tenant-a": "shard_a", "tenant-b": "shard_b"}


def shard_of(tenant: str) -> str:
    """The alias of ``tenant``'s shard; tenants without one live in ``default``."""
    return SHARDS.get(tenant, "default")


class TenantShardRouter:
    """Routes the idempotency records by the ``tenant`` hint, and records each question.

    The business models are left to the default (``default``): a view that
    writes its rows without ``.using(request.idempotency.database)`` lands
    there, which is what the tests catch. ``asked`` lists every question
    about the records (``("write" | "read", hints)``), so that the tests can
    count them.
    """

    asked: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        if model._meta.app_label != "django_idempotency":
            return None
        self.asked.append(("write", hints))
        tenant = hints.get("tenant")
        if tenant == "task":  # idempotent_task: the tenant is an argument of the task
            tenant = (hints.get("arguments") or {}).get("tenant")
        return shard_of(str(tenant))

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        if model._meta.app_label == "django_idempotency":
            self.asked.append(("read", hints))
        return None

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: Any
    ) -> bool | None:
        if app_label == "django_idempotency":
            return db in SHARDS.values()
        return None
