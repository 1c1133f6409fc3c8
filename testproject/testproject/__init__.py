"""The demo project. Importing it loads its Celery app, so that ``@shared_task``
tasks bind to it (the layout Celery's Django guide recommends)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery

celery_app: Celery | None
try:
    from testproject.celery import app as celery_app
except ImportError:  # pragma: no cover - Celery is optional for the web app
    celery_app = None

__all__ = ["celery_app"]
