"""ASGI entry point for the live async tests: ``uvicorn tests.live.asgi:application``."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

application = get_asgi_application()
