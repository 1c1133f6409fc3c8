"""Smoke test of an installed django-idempotency (run from outside the repository).

Configures a minimal project in memory, migrates an SQLite database,
sends a protected request twice through Django's test client, and runs a
function protected by ``idempotent_task`` twice (Celery not installed).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import django
from django.conf import settings

database = str(Path(tempfile.mkdtemp()) / "smoke.sqlite3")
settings.configure(
    DEBUG=False,
    SECRET_KEY="smoke",
    ALLOWED_HOSTS=["*"],
    ROOT_URLCONF=__name__,
    INSTALLED_APPS=[
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "django.contrib.messages",
        "rest_framework",
        "django_idempotency",
    ],
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ],
    TEMPLATES=[
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
    ],
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": database,
            "OPTIONS": {"transaction_mode": "IMMEDIATE"},
        }
    },
    USE_TZ=True,
)
django.setup()

from django.contrib import admin  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import Client  # noqa: E402
from django.urls import path  # noqa: E402
from rest_framework.decorators import api_view  # noqa: E402
from rest_framework.response import Response  # noqa: E402

import django_idempotency  # noqa: E402
from django_idempotency import idempotent  # noqa: E402

calls = []


@api_view(["POST"])
@idempotent
def charge(request):  # type: ignore[no-untyped-def]
    calls.append(request.data)
    return Response({"charged": len(calls)}, status=201)


urlpatterns = [path("charge", charge), path("admin/", admin.site.urls)]

call_command("check", fail_level="WARNING")
call_command("migrate", verbosity=0)
client = Client()
first = client.post(
    "/charge",
    json.dumps({"amount": 1}),
    content_type="application/json",
    HTTP_IDEMPOTENCY_KEY="smoke",
)
retry = client.post(
    "/charge",
    json.dumps({"amount": 1}),
    content_type="application/json",
    HTTP_IDEMPOTENCY_KEY="smoke",
)
assert first.status_code == 201, first.content
assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
assert len(calls) == 1

# The task decorator with the wheel alone: neither Celery nor Django's Tasks
# framework is installed here.
from django_idempotency import idempotent_task  # noqa: E402

shipped = []


@idempotent_task(key="order_id")
def ship(order_id):  # type: ignore[no-untyped-def]
    shipped.append(order_id)
    return {"shipped": order_id}


assert ship(7) == ship(7) == {"shipped": 7} and shipped == [7], shipped
assert "celery" not in sys.modules
from django.contrib.auth.models import User  # noqa: E402

client.force_login(User.objects.create_superuser("smoke", "smoke@example.com", "x"))
page = client.get("/admin/django_idempotency/idempotencyrecord/")
assert page.status_code == 200 and b"idempotency-counts" in page.content, page.status_code
print(
    f"smoke test passed: django-idempotency {django_idempotency.__version__}, "
    f"Django {django.get_version()}, Python {sys.version.split()[0]}"
)
