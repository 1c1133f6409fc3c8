"""Settings of the demo project.

SQLite (``testproject/db.sqlite3``) by default; PostgreSQL (or any database
``dj-database-url`` understands) when ``DATABASE_URL`` is set. Not hardened
for production: the secret key and the demo users are public.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

from django_idempotency.tasks import BEAT_SCHEDULE

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get(
    "DJANGO_SECRET_KEY", "django-insecure-demo-only-do-not-use-this-key-in-production"
)
DEBUG = os.environ.get("DJANGO_DEBUG", "").lower() in {"1", "true", "yes", "on"}
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    # The OpenAPI schema at /v1/schema; django-idempotency's extension adds the
    # Idempotency-Key header and its refusals to the protected operations.
    "drf_spectacular",
    "django_idempotency",
    "payments",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASES = {
    # An empty DATABASE_URL means the default too.
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{BASE_DIR / 'db.sqlite3'}"
    ),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several gunicorn workers write to one file: writers take the lock when
    # their transaction begins (IMMEDIATE) and wait up to 20 s for it instead
    # of failing with "database is locked"; WAL lets readers run meanwhile.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL;",
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Payments demo API",
    "DESCRIPTION": "The django-idempotency demo: payments and refunds, safe to retry.",
    "VERSION": "1",
    # The schema describes the payments API, not the schema endpoint itself.
    "SERVE_INCLUDE_SCHEMA": False,
}

# Every key at its default, spelled out so the demo shows what can be tuned.
# The tenant is the authenticated user ("user:<pk>"): one user's keys can
# never replay another user's responses. IDEMPOTENCY_LEASE (seconds) in the
# environment shortens the lease, as the crash tests do.
IDEMPOTENCY = {
    "HEADER": "Idempotency-Key",
    "REQUIRED": True,
    "TTL": 24 * 60 * 60,
    "LEASE": float(os.environ.get("IDEMPOTENCY_LEASE", 2 * 60)),
    "TENANT": "django_idempotency.scope.default_tenant",
    "IN_FLIGHT": "conflict",
    "FAIL_OPEN": False,
    # No tombstones: a retry after TTL runs again. Set because the demo
    # registers reconcilers, and system check W023 asks such a project to
    # decide (docs/ttl-and-lease.md, "Expired keys").
    "TOMBSTONE_TTL": None,
}

# Webhook signing secrets (payments/stripe_webhooks.py, github_webhooks.py).
# Stand-ins for the demo: set the real ones from the environment.
STRIPE_WEBHOOK_SECRET = os.environ.get("STRIPE_WEBHOOK_SECRET", "whsec_demo_stand_in_secret")
GITHUB_WEBHOOK_SECRET = os.environ.get("GITHUB_WEBHOOK_SECRET", "demo-stand-in-github-secret")

# The payment provider (the simulator: python testproject/provider/server.py).
PAYMENTS_PROVIDER_URL = os.environ.get("PAYMENTS_PROVIDER_URL", "http://127.0.0.1:8765")
PAYMENTS_PROVIDER_TIMEOUT = float(os.environ.get("PAYMENTS_PROVIDER_TIMEOUT", 10))
# Pass a client's X-Simulate / X-Simulate-Delay headers on to the simulator,
# so the demo and the tests can make it fail on purpose. Never in production.
PAYMENTS_PROVIDER_SIMULATION = os.environ.get("PAYMENTS_PROVIDER_SIMULATION", "") == "1"

# Celery (testproject/celery.py): `celery -A testproject worker` from testproject/.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", CELERY_BROKER_URL)
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "celery")
# At-least-once delivery for tasks: acknowledged after they ran, redelivered
# when a worker dies mid-task (idempotent_task makes that safe).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# django-idempotency's recovery (every minute) and eviction (every ten minutes).
CELERY_BEAT_SCHEDULE = {**BEAT_SCHEDULE}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "console": {"format": "%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s"}
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "console"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "django_idempotency": {"handlers": ["console"], "level": "WARNING", "propagate": False},
    },
}
