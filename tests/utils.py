"""Helpers the tests import; fixtures and pytest hooks stay in conftest.py."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from django.db import connection
from django.dispatch import Signal
from django.http import HttpRequest
from django.middleware.csrf import get_token
from rest_framework.authtoken.models import Token
from rest_framework.request import Request
from rest_framework.test import APIClient

from django_idempotency.context import IdempotencyContext
from django_idempotency.models import IdempotencyRecord

if TYPE_CHECKING:  # the stubs' type of a test client's response; DRF has no such class
    from rest_framework.response import _MonkeyPatchedResponse

SentSignals = list[tuple[str, dict[str, Any]]]

#: The import paths SPEC's "Public contract" fixes (test_public_api checks
#: they resolve; test_docs_api that the reference documents them).
SPEC_PATHS = [
    "django_idempotency.idempotent",
    "django_idempotency.drf.IdempotentMixin",
    "django_idempotency.models.IdempotencyRecord",
    "django_idempotency.models.IdempotencyRecord.State",
    "django_idempotency.recovery.register_reconciler",
    "django_idempotency.recovery.Completed",
    "django_idempotency.recovery.Failed",
    "django_idempotency.recovery.Retry",
    "django_idempotency.tasks.recover_stale_records",
    "django_idempotency.tasks.purge_expired_records",
    "django_idempotency.tasks.BEAT_SCHEDULE",
    "django_idempotency.tasks.idempotent_task",
]
#: What SPEC fixes of ``request.idempotency``.
SPEC_CONTEXT_ATTRIBUTES = ("key", "tenant", "operation", "provider_key", "fencing_token")
SPEC_CONTEXT_METHODS = ("begin_external", "set_provider_operation")


@contextlib.contextmanager
def signals_sent(by_name: Mapping[str, Signal]) -> Iterator[SentSignals]:
    """Record (name, keyword arguments) of every send of these signals meanwhile."""
    log: SentSignals = []
    receivers = []
    for name, signal in by_name.items():

        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal")
            log.append((name, kwargs))

        signal.connect(receiver, weak=False)
        receivers.append((signal, receiver))
    try:
        yield log
    finally:
        for signal, receiver in receivers:
            signal.disconnect(receiver)


def post(
    client: APIClient, url: str, data: Any, key: str | None, **extra: Any
) -> _MonkeyPatchedResponse:
    """POST ``data`` as JSON, with ``key`` as the Idempotency-Key header unless None."""
    if key is not None:
        extra["HTTP_IDEMPOTENCY_KEY"] = key
    return client.post(url, data, format="json", **extra)


class TokenClient(APIClient):
    """An API client that authenticates with ``token``; ``user`` is the token's owner."""

    def __init__(self, token: Token, **credentials: str) -> None:
        super().__init__()
        self.user = token.user
        self.credentials(HTTP_AUTHORIZATION=f"Token {token.key}", **credentials)


def idempotency_of(request: HttpRequest) -> IdempotencyContext:
    """``request.idempotency``, typed: the package sets it at run time, so no stub declares it."""
    context = request.idempotency  # type: ignore[attr-defined]
    assert isinstance(context, IdempotencyContext), context
    return context


def raw_body(record: IdempotencyRecord) -> bytes:
    """The response body column as stored (PostgreSQL hands back a memoryview)."""
    assert record.response_body is not None, record
    return bytes(record.response_body)


def data_of(request: HttpRequest) -> dict[str, Any]:
    """A DRF request's parsed body, for views that take an object (JSON or a form)."""
    assert isinstance(request, Request), request
    data = request.data
    assert isinstance(data, dict), data
    return data


def masked_csrf_token(secret: str) -> str:
    """A form token for the CSRF cookie ``secret``, masked anew on each call as Django does."""
    request = HttpRequest()
    request.META["CSRF_COOKIE"] = secret
    return get_token(request)


# -- records routed by tenant (IDEMPOTENCY["DATABASE"] = None) --------------------------
#: The aliases the shard tests use (tests/settings.py defines the shards).
SHARD_TEST_ALIASES = ["default", "shard_a", "shard_b"]


def sharded(**more: Any) -> dict[str, Any]:
    """The suite's IDEMPOTENCY with the routers choosing the records' database per tenant."""
    from django.conf import settings

    return {
        **getattr(settings, "IDEMPOTENCY", {}),
        "DATABASE": None,
        "TENANT": "tests.testapp.shard_views.tenant_header",
        **more,
    }


@contextlib.contextmanager
def routed_by_tenant(**more: Any) -> Iterator[None]:
    """``sharded(**more)``, TenantShardRouter, and the shard views' URLconf."""
    from django.test import override_settings

    with override_settings(
        IDEMPOTENCY=sharded(**more),
        DATABASE_ROUTERS=["tests.testapp.routers.TenantShardRouter"],
        ROOT_URLCONF="tests.testapp.shard_urls",
    ):
        yield


def record_in(alias: str, **fields: Any) -> IdempotencyRecord:
    """A record saved in database ``alias``."""
    from tests.factories import RecordFactory

    record = RecordFactory.build(**fields)
    record.save(using=alias)
    return record


#: The repository, the working directory of the Python processes the tests start.
REPO = Path(__file__).resolve().parent.parent


def database_url() -> str:
    """The test database, as DATABASE_URL for tests/settings.py in another process."""
    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings['NAME']}"
    scheme = "postgres" if connection.vendor == "postgresql" else "mysql"
    password = f":{quote(settings['PASSWORD'], safe='')}" if settings["PASSWORD"] else ""
    host = f"{settings['HOST'] or '127.0.0.1'}:{settings['PORT'] or ''}".rstrip(":")
    return f"{scheme}://{quote(settings['USER'], safe='')}{password}@{host}/{settings['NAME']}"


def run_python(code: str, **environment: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python process set up like the test run, on its database."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={
            **os.environ,
            "DATABASE_URL": database_url(),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            **environment,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
