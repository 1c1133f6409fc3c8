"""Django's mysql backend, wrapped: the same kind of database under another ENGINE path."""

from __future__ import annotations

from django.db.backends.mysql import base

__all__ = ["DatabaseWrapper"]


class DatabaseWrapper(base.DatabaseWrapper):
    pass
