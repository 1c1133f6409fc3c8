"""``gunicorn benchmarks.benchproject.wsgi:application`` (from the repository root)."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.benchproject.settings")

application = get_wsgi_application()
