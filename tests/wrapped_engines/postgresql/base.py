"""Django's postgresql backend, wrapped: the same kind of database under another ENGINE path."""

from __future__ import annotations

from django.db.backends.postgresql import base

__all__ = ["DatabaseWrapper"]


class DatabaseWrapper(base.DatabaseWrapper):
    pass
