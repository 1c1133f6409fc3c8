"""The project's Celery app: ``celery -A testproject worker`` (and ``beat``), from testproject/.

Broker and result backend come from ``CELERY_BROKER_URL`` /
``CELERY_RESULT_BACKEND`` (default ``redis://127.0.0.1:6379/0``), read by
the settings like every other ``CELERY_*`` setting. The tasks are
django-idempotency's (``recover_stale_records``, ``purge_expired_records``),
found through the installed apps; the beat schedule is the settings'
``CELERY_BEAT_SCHEDULE``.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

app = Celery("testproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Imports the "tasks" module of every installed app: django_idempotency.tasks.
app.autodiscover_tasks()
