"""The ``IDEMPOTENCY`` settings dict, read through a typed object.

Every attribute is read from ``django.conf.settings`` on each access, so
``override_settings`` works in tests. Values are validated by the system
checks in ``checks.py``; here they are only normalised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal, cast

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from django.http import HttpRequest

    from django_idempotency.responses import StoredResponse

TenantResolver = Callable[["HttpRequest"], str]

DEFAULTS: Mapping[str, Any] = {
    "HEADER": "Idempotency-Key",
    "REQUIRED": True,
    "KEY_MAX_LENGTH": 255,
    "TTL": timedelta(hours=24),
    "LEASE": timedelta(minutes=2),
    "TENANT": "django_idempotency.scope.default_tenant",
    "DATABASE": "default",
    "IN_FLIGHT": "conflict",
    "IN_FLIGHT_WAIT": timedelta(seconds=10),
    "FAIL_OPEN": False,
    "STORED_HEADERS": (),
    "MAX_STORED_BODY": 1024 * 1024,
    "SINGLE_TRANSACTION": False,
    "ERROR_FORMAT": "drf",
    "REDACT": None,
    "ENCRYPTION_KEYS": (),
    "MAX_FINGERPRINTED_BODY": 2_621_440,
    "PROBLEM_TYPE_BASE": "https://django-idempotency.readthedocs.io/en/latest/errors/#",
}


def as_timedelta(value: timedelta | float) -> timedelta:
    """Durations may be given as a ``timedelta`` or as seconds."""
    if isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


@lru_cache(maxsize=32)
def import_callable(path: str, setting: str) -> Callable[..., Any]:
    try:
        imported = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"IDEMPOTENCY[{setting!r}] = {path!r} could not be imported: {exc}"
        ) from exc
    if not callable(imported):
        raise ImproperlyConfigured(f"IDEMPOTENCY[{setting!r}] = {path!r} is not callable.")
    return cast(Callable[..., Any], imported)


class IdempotencySettings:
    """Typed access to ``settings.IDEMPOTENCY`` with the documented defaults."""

    @property
    def user_settings(self) -> Mapping[str, Any]:
        value = getattr(django_settings, "IDEMPOTENCY", {})
        return value if isinstance(value, Mapping) else {}

    def _get(self, name: str) -> Any:
        return self.user_settings.get(name, DEFAULTS[name])

    @property
    def HEADER(self) -> str:
        return cast(str, self._get("HEADER"))

    @property
    def REQUIRED(self) -> bool:
        return bool(self._get("REQUIRED"))

    @property
    def KEY_MAX_LENGTH(self) -> int:
        return cast(int, self._get("KEY_MAX_LENGTH"))

    @property
    def TTL(self) -> timedelta:
        return as_timedelta(self._get("TTL"))

    @property
    def LEASE(self) -> timedelta:
        return as_timedelta(self._get("LEASE"))

    @property
    def TENANT(self) -> TenantResolver:
        value = self._get("TENANT")
        if isinstance(value, str):
            return import_callable(value, "TENANT")
        return cast(TenantResolver, value)

    @property
    def DATABASE(self) -> str:
        return cast(str, self._get("DATABASE"))

    @property
    def IN_FLIGHT(self) -> Literal["conflict", "wait"]:
        return cast(Literal["conflict", "wait"], self._get("IN_FLIGHT"))

    @property
    def IN_FLIGHT_WAIT(self) -> timedelta:
        return as_timedelta(self._get("IN_FLIGHT_WAIT"))

    @property
    def FAIL_OPEN(self) -> bool:
        return bool(self._get("FAIL_OPEN"))

    @property
    def STORED_HEADERS(self) -> tuple[str, ...]:
        return tuple(self._get("STORED_HEADERS"))

    @property
    def MAX_STORED_BODY(self) -> int:
        return cast(int, self._get("MAX_STORED_BODY"))

    @property
    def REDACT(self) -> Callable[[StoredResponse], StoredResponse] | None:
        value = self._get("REDACT")
        if isinstance(value, str):
            return import_callable(value, "REDACT")
        return cast("Callable[[StoredResponse], StoredResponse] | None", value)

    @property
    def ENCRYPTION_KEYS(self) -> tuple[str, ...]:
        return tuple(self._get("ENCRYPTION_KEYS"))

    @property
    def MAX_FINGERPRINTED_BODY(self) -> int:
        return cast(int, self._get("MAX_FINGERPRINTED_BODY"))

    @property
    def SINGLE_TRANSACTION(self) -> bool:
        return bool(self._get("SINGLE_TRANSACTION"))

    @property
    def ERROR_FORMAT(self) -> Literal["drf", "problem"]:
        return cast(Literal["drf", "problem"], self._get("ERROR_FORMAT"))

    @property
    def PROBLEM_TYPE_BASE(self) -> str:
        return cast(str, self._get("PROBLEM_TYPE_BASE"))


idempotency_settings = IdempotencySettings()
