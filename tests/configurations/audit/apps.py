from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_delete, pre_delete

#: (signal name, model label, primary key) of every deletion seen, newest last.
DELETIONS: list[tuple[str, str, Any]] = []


def _audit_pre_delete(sender: Any, instance: Any, **kwargs: Any) -> None:
    DELETIONS.append(("pre_delete", sender._meta.label, instance.pk))
    del DELETIONS[:-1000]


def _audit_post_delete(sender: Any, instance: Any, **kwargs: Any) -> None:
    DELETIONS.append(("post_delete", sender._meta.label, instance.pk))
    del DELETIONS[:-1000]


class AuditConfig(AppConfig):
    name = "tests.configurations.audit"
    label = "configurations_audit"

    def ready(self) -> None:
        # No sender: every model's deletions, as django-auditlog and
        # django-simple-history style receivers are often connected.
        pre_delete.connect(_audit_pre_delete, dispatch_uid="configurations_audit.pre")
        post_delete.connect(_audit_post_delete, dispatch_uid="configurations_audit.post")
