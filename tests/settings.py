"""Settings for the test suite. DATABASE_URL picks the database (SQLite by default)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import dj_database_url
import django

BASE_DIR = Path(__file__).resolve().parent

# The demo project's `payments` app is tested too; make it importable for
# every process that loads these settings (pytest, live servers, mypy).
_TESTPROJECT = str(BASE_DIR.parent / "testproject")
if _TESTPROJECT not in sys.path:
    sys.path.append(_TESTPROJECT)
SECRET_KEY = "tests-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "rest_framework",
    "rest_framework.authtoken",
    "adrf",
    "drf_spectacular",
    "django_idempotency",
    "tests.testapp",
    "payments",  # the demo project's app, tested in test_testproject.py
    # Django's Tasks framework with its database backend (tests/test_tasks_framework*.py):
    # built into Django from 6.0, the django-tasks backport's app before.
    *(["django_tasks"] if django.VERSION < (6, 0) else []),
    "django_tasks_db",
]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "tests.testapp.urls"
STATIC_URL = "/static/"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
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

_sqlite_file = os.environ.get("TEST_SQLITE_PATH", str(BASE_DIR / "test.sqlite3"))
DATABASES = {
    "default": dj_database_url.parse(os.environ.get("DATABASE_URL") or f"sqlite:///{_sqlite_file}"),
}
# One test database per run, so that concurrent runs on one machine never
# share (and destroy) each other's.
_run = os.getpid()
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not memory: tests that use a second connection need to share it.
    DATABASES["default"]["TEST"] = {"NAME": str(BASE_DIR / f"test-{_run}.sqlite3")}
    # synchronous=OFF: a commit is handed to the OS without waiting for the
    # disk (2-4 ms a commit here, thousands of commits a pass). What the tests
    # kill is a Python process, never the machine, so nothing committed is lost.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA synchronous=OFF",
    }
else:
    DATABASES["default"]["TEST"] = {"NAME": f"test_idempotency_{_run}"}
# Two more databases on the same server, the tenants' shards of
# tests/test_shards.py (IDEMPOTENCY["DATABASE"] = None, routed per tenant).
# pytest-django creates a test database only for the aliases the collected
# tests ask for, so other runs do not pay for them.
SHARD_ALIASES = ("shard_a", "shard_b")
for _shard in SHARD_ALIASES:
    _default = DATABASES["default"]
    if _default["ENGINE"] == "django.db.backends.sqlite3":
        _test_name = str(BASE_DIR / f"test-{_run}-{_shard}.sqlite3")
        _name = str(Path(_sqlite_file).with_name(f"{Path(_sqlite_file).stem}-{_shard}.sqlite3"))
    else:
        _test_name, _name = f"test_idempotency_{_run}_{_shard}", _default["NAME"]
    DATABASES[_shard] = {**_default, "NAME": _name, "TEST": {"NAME": _test_name}}
if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    try:
        import MySQLdb  # noqa: F401  (mysqlclient, the driver Django recommends)
    except ImportError:
        # PyMySQL needs no C headers, so a fresh machine can run the suite.
        import pymysql

        pymysql.install_as_MySQLdb()

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The database backend of the Tasks framework: its tasks are rows in the test
# database, run by `manage.py db_worker` (in the test process or its own).
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}

# The demo project's webhook endpoints (testproject/payments/*_webhooks.py).
STRIPE_WEBHOOK_SECRET = "whsec_test_secret"
GITHUB_WEBHOOK_SECRET = "github-test-secret"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_idempotency": {"handlers": ["console"], "level": "WARNING"}},
}

# The real-project configuration this run is under (IDEMPOTENCY_TEST_CONFIGURATION,
# tests/configurations/): last, so that it adjusts everything above.
from tests.configurations import apply as _apply_configuration  # noqa: E402

_apply_configuration(globals())
