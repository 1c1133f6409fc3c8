"""The router of the ``read-replica-router`` configuration."""

from __future__ import annotations

from typing import Any


class ReadReplicaRouter:
    """Reads from ``replica``, writes to ``default``: the usual primary/replica split.

    In tests ``replica`` mirrors ``default`` (``TEST["MIRROR"]``): the same
    database through another connection, so a read sees only what is committed.
    """

    def db_for_read(self, model: type[Any], **hints: Any) -> str:
        return "replica"

    def db_for_write(self, model: type[Any], **hints: Any) -> str:
        return "default"

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default"
