"""Settings of the benchmark project: lean on purpose.

No middleware, no authentication classes, JSON in and out only: whatever a
request costs beyond the database and the idempotency layer is the same for
every endpoint, and the leaner it is, the larger the protection's share of
the total (stricter ratios). Database connections are persistent
(``CONN_MAX_AGE``), as in any production deployment (or behind PgBouncer):
connecting per request would dwarf everything measured here.

``DATABASE_URL`` names the (fresh) PostgreSQL database; benchmarks/http.py
creates it and passes it to gunicorn.
"""

from __future__ import annotations

import os

import dj_database_url

SECRET_KEY = "benchmarks-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "django_idempotency",
    "benchmarks.benchapp",
]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "benchmarks.benchproject.urls"
WSGI_APPLICATION = "benchmarks.benchproject.wsgi.application"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench"),
        conn_max_age=600,
    ),
}
# Under ASGI each request's sync work runs in a thread of its own, whose
# connection a persistent setting cannot keep: benchmarks/async_drf.py serves
# uvicorn with Django's connection pool instead (psycopg-pool), as Django's
# docs advise for async deployments.
if os.environ.get("IDEMPOTENCY_BENCH_POOL"):
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {"min_size": 4, "max_size": 16}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "UNAUTHENTICATED_USER": None,
}

# The documented defaults (24 h retention, 2 min lease, "conflict").
IDEMPOTENCY: dict[str, object] = {}
# benchmarks/telemetry_cost.py picks metrics and tracing (see telemetry.py).
if os.environ.get("IDEMPOTENCY_BENCH_TELEMETRY"):
    from benchmarks.benchproject import telemetry

    IDEMPOTENCY.update(telemetry.idempotency_settings(telemetry.configuration() or ""))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_idempotency": {"handlers": ["console"], "level": "WARNING"},
        "django.request": {"handlers": ["console"], "level": "ERROR"},
    },
}
