"""WSGI entry point for the live tests: ``gunicorn tests.live.wsgi:application``.

The database comes from ``DATABASE_URL`` (read by ``tests.settings``).
"""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

application = get_wsgi_application()

from tests.live import hooks  # noqa: E402  (needs the app registry, ready now)

hooks.install()
