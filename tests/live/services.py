"""Whether the real services the live tests need are there, and what to do if not.

Locally a missing PostgreSQL skips the test with a clear reason. In CI,
which sets ``IDEMPOTENCY_REQUIRE_SERVICES=1``, it fails instead: a suite
that silently skips its real-database proof proves nothing.
"""

from __future__ import annotations

import os

import pytest

POSTGRES_URL_ENV = "IDEMPOTENCY_TEST_POSTGRES_URL"
DEFAULT_POSTGRES_URL = "postgres://postgres@127.0.0.1:5432/test"
REDIS_URL_ENV = "IDEMPOTENCY_TEST_REDIS_URL"
#: A database number of its own, away from db 0 (the demo project's default
#: broker); the live tests also give each run its own queue name.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/11"
REQUIRE_SERVICES_ENV = "IDEMPOTENCY_REQUIRE_SERVICES"


def postgres_url() -> str:
    """The server (and a database on it to connect to) given for the live tests.

    By default the server of the suite's own DATABASE_URL, so that the
    PostgreSQL pass of ``runtests.py`` runs them against the server it tests.
    """
    suite_url = os.environ.get("DATABASE_URL", "")
    if suite_url.startswith(("postgres://", "postgresql://")):
        return os.environ.get(POSTGRES_URL_ENV) or suite_url
    return os.environ.get(POSTGRES_URL_ENV) or DEFAULT_POSTGRES_URL


def services_required() -> bool:
    return os.environ.get(REQUIRE_SERVICES_ENV) == "1"


def redis_url() -> str:
    """The Redis database the live Celery tests use as broker and result backend."""
    return os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def unavailable(service: str, reason: str, variable: str | None = None) -> None:
    """Skip (locally) or fail (``IDEMPOTENCY_REQUIRE_SERVICES=1``) the running test.

    ``variable``: the environment variable that names the server.
    """
    if services_required():
        pytest.fail(
            f"{service} is required ({REQUIRE_SERVICES_ENV}=1) but unavailable: {reason}",
            pytrace=False,
        )
    if variable is None:
        variable = REDIS_URL_ENV if service == "Redis" else POSTGRES_URL_ENV
    pytest.skip(
        f"{service} unavailable ({reason}); set {variable} to a reachable server, "
        f"or {REQUIRE_SERVICES_ENV}=1 to make this a failure"
    )


def require_postgres() -> str:
    """Return the PostgreSQL URL if the server answers; else skip or fail the test."""
    url = postgres_url()
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        unavailable("PostgreSQL", f"psycopg is not installed: {exc}")
        raise  # unreachable: skip/fail raise
    problem = None
    try:
        with psycopg.connect(url, connect_timeout=3, autocommit=True) as connection:
            connection.execute("SELECT 1")
    except psycopg.Error as exc:
        problem = " ".join(str(exc).split()) or type(exc).__name__
    if problem is not None:  # outside the except block: no chained traceback
        unavailable("PostgreSQL", f"cannot connect to {_redacted(url)}: {problem}")
    return url


def require_redis(url: str | None = None, variable: str = REDIS_URL_ENV) -> str:
    """Return the Redis URL if the server answers PING; else skip or fail the test.

    By default the crash tests' broker; ``url`` and ``variable`` name another.
    """
    url = url or redis_url()
    problem = None
    try:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except ImportError as exc:  # pragma: no cover - the celery extra installs it
        problem = f"the redis client is not installed: {exc}"
    except Exception as exc:  # any failure means "not reachable"
        problem = " ".join(str(exc).split()) or type(exc).__name__
    if problem is not None:
        unavailable("Redis", f"cannot use {_redacted(url)}: {problem}", variable)
    return url


def _redacted(url: str) -> str:
    """The URL without a password, for messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
