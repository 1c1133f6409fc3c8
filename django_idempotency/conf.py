"""The ``IDEMPOTENCY`` settings dict, read through a typed object.

Each attribute is resolved (defaults filled in, durations made timedeltas,
dotted paths imported) on first access and kept until ``settings.IDEMPOTENCY``
(or ``SECRET_KEY``, which the default ``DIGEST_KEYS`` follow) changes: Django
sends ``setting_changed`` for ``override_settings`` and the pytest-django
``settings`` fixture, and that clears what was kept. (Mutating
the dict in place at run time is not seen; nothing should.) Values are
validated by the system checks in ``checks.py``; here they are only
normalised.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, cast, overload

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from django.http import HttpRequest

    from django_idempotency.responses import StoredResponse
    from django_idempotency.scope import OperationNames

__all__ = [
    "DEFAULTS",
    "IdempotencySettings",
    "TenantResolver",
    "as_timedelta",
    "idempotency_settings",
    "import_callable",
]

TenantResolver = Callable[["HttpRequest"], str]
T = TypeVar("T")

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
    #: None: one secret derived from SECRET_KEY, then one per SECRET_KEY_FALLBACKS.
    "DIGEST_KEYS": None,
    "MAX_FINGERPRINTED_BODY": 2_621_440,
    "PROBLEM_TYPE_BASE": "https://django-idempotency.readthedocs.io/en/latest/errors/#",
    #: How default operation names are written; see scope.operation_name.
    "OPERATION_NAMES": "pattern",
    #: {records alias: alias of the connections that commit at once while the
    #: view's transaction is open}; {}: a second connection to the same alias.
    "INTENT_DATABASES": {},
    #: None: no tombstones; a key past retention starts a new operation.
    "TOMBSTONE_TTL": None,
    #: Whether protected responses say how long their outcome is still kept
    #: (``responses.RETENTION_HEADER``).
    "ADVERTISE_RETENTION": False,
    #: Where metrics go: "opentelemetry" (the API; a no-op without an SDK)
    #: and/or "prometheus" (prometheus_client); () for none. See metrics.py.
    "METRICS": ("opentelemetry",),
    #: Distinct ``operation`` values a process labels metrics with; later
    #: ones are counted as "other", so a route with ids in it cannot flood
    #: the metrics backend.
    "METRICS_OPERATIONS": 100,
    #: Whether the request counter is labelled with the tenant too.
    "METRICS_TENANT": False,
    #: Spans for the claim, the view, the completion, begin_external() and
    #: replays, through the OpenTelemetry API (tracing.py).
    "TRACING": True,
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


def _as_bytes(secret: str | bytes) -> bytes:
    return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)


class _resolved(Generic[T]):  # lower case: a decorator, like @property
    """A read-only property computed once per value of ``settings.IDEMPOTENCY``.

    Every protected request reads about fifteen settings; resolving each one
    anew (dict lookups with defaults, timedelta conversions, imports) was a
    measurable share of the request path.
    """

    def __init__(self, compute: Callable[[IdempotencySettings], T]) -> None:
        self.compute = compute
        self.name = compute.__name__
        self.__doc__ = compute.__doc__

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> _resolved[T]: ...

    @overload
    def __get__(self, instance: IdempotencySettings, owner: type | None = None) -> T: ...

    def __get__(
        self, instance: IdempotencySettings | None, owner: type | None = None
    ) -> T | _resolved[T]:
        if instance is None:
            return self
        # The dict of the settings' current value: a change meanwhile
        # replaces it, so a value computed from the old one is not kept.
        resolved = instance.resolved
        try:
            value: T = resolved[self.name]
        except KeyError:
            value = resolved[self.name] = self.compute(instance)
        return value


class IdempotencySettings:
    """Typed access to ``settings.IDEMPOTENCY`` with the documented defaults."""

    def __init__(self) -> None:
        self.resolved: dict[str, Any] = {}

    @property  # always read anew: the system checks use it
    def user_settings(self) -> Mapping[str, Any]:
        value = getattr(django_settings, "IDEMPOTENCY", {})
        return value if isinstance(value, Mapping) else {}

    def _get(self, name: str) -> Any:
        return self.user_settings.get(name, DEFAULTS[name])

    @_resolved
    def HEADER(self) -> str:
        return cast(str, self._get("HEADER"))

    @_resolved
    def REQUIRED(self) -> bool:
        return bool(self._get("REQUIRED"))

    @_resolved
    def KEY_MAX_LENGTH(self) -> int:
        return cast(int, self._get("KEY_MAX_LENGTH"))

    @_resolved
    def TTL(self) -> timedelta:
        return as_timedelta(self._get("TTL"))

    @_resolved
    def LEASE(self) -> timedelta:
        return as_timedelta(self._get("LEASE"))

    @_resolved
    def TENANT(self) -> TenantResolver:
        value = self._get("TENANT")
        if isinstance(value, str):
            return import_callable(value, "TENANT")
        return cast(TenantResolver, value)

    @_resolved
    def DATABASE(self) -> str | None:
        # None: the routers choose per request (databases.database_for).
        return cast("str | None", self._get("DATABASE"))

    @_resolved
    def IN_FLIGHT(self) -> Literal["conflict", "wait"]:
        return cast(Literal["conflict", "wait"], self._get("IN_FLIGHT"))

    @_resolved
    def IN_FLIGHT_WAIT(self) -> timedelta:
        return as_timedelta(self._get("IN_FLIGHT_WAIT"))

    @_resolved
    def FAIL_OPEN(self) -> bool:
        return bool(self._get("FAIL_OPEN"))

    @_resolved
    def STORED_HEADERS(self) -> tuple[str, ...]:
        return tuple(self._get("STORED_HEADERS"))

    @_resolved
    def MAX_STORED_BODY(self) -> int:
        return cast(int, self._get("MAX_STORED_BODY"))

    @_resolved
    def REDACT(self) -> Callable[[StoredResponse], StoredResponse] | None:
        value = self._get("REDACT")
        if isinstance(value, str):
            return import_callable(value, "REDACT")
        return cast("Callable[[StoredResponse], StoredResponse] | None", value)

    @_resolved
    def ENCRYPTION_KEYS(self) -> tuple[str, ...]:
        return tuple(self._get("ENCRYPTION_KEYS"))

    @_resolved
    def DIGEST_KEYS(self) -> tuple[tuple[str, bytes], ...]:
        """(version, secret) pairs, newest first; the default follows SECRET_KEY."""
        value = self._get("DIGEST_KEYS")
        if value is None:
            from django_idempotency._store.digests import default_version

            secrets = [django_settings.SECRET_KEY, *django_settings.SECRET_KEY_FALLBACKS]
            encoded = [_as_bytes(secret) for secret in secrets]
            return tuple((default_version(secret), secret) for secret in encoded)
        return tuple((str(version), _as_bytes(secret)) for version, secret in value)

    @_resolved
    def MAX_FINGERPRINTED_BODY(self) -> int:
        return cast(int, self._get("MAX_FINGERPRINTED_BODY"))

    @_resolved
    def SINGLE_TRANSACTION(self) -> bool:
        return bool(self._get("SINGLE_TRANSACTION"))

    @_resolved
    def ERROR_FORMAT(self) -> Literal["drf", "problem"]:
        return cast(Literal["drf", "problem"], self._get("ERROR_FORMAT"))

    @_resolved
    def PROBLEM_TYPE_BASE(self) -> str:
        return cast(str, self._get("PROBLEM_TYPE_BASE"))

    @_resolved
    def OPERATION_NAMES(self) -> OperationNames:
        return cast("OperationNames", self._get("OPERATION_NAMES"))

    @_resolved
    def INTENT_DATABASES(self) -> Mapping[str, str]:
        return dict(self._get("INTENT_DATABASES"))

    @_resolved
    def TOMBSTONE_TTL(self) -> timedelta | None:
        """How long a purged record's scope and fingerprint are kept; ``None``: not at all."""
        value = self._get("TOMBSTONE_TTL")
        return None if value is None else as_timedelta(value)

    @_resolved
    def ADVERTISE_RETENTION(self) -> bool:
        return bool(self._get("ADVERTISE_RETENTION"))

    @_resolved
    def METRICS(self) -> tuple[str, ...]:
        value = self._get("METRICS")
        return (value,) if isinstance(value, str) else tuple(value or ())

    @_resolved
    def METRICS_OPERATIONS(self) -> int:
        return cast(int, self._get("METRICS_OPERATIONS"))

    @_resolved
    def METRICS_TENANT(self) -> bool:
        return bool(self._get("METRICS_TENANT"))

    @_resolved
    def TRACING(self) -> bool:
        return bool(self._get("TRACING"))


idempotency_settings = IdempotencySettings()


#: Settings that resolved values depend on (the default DIGEST_KEYS).
_WATCHED = frozenset({"IDEMPOTENCY", "SECRET_KEY", "SECRET_KEY_FALLBACKS"})


def _forget_resolved(*, setting: str, **kwargs: Any) -> None:
    if setting in _WATCHED:
        idempotency_settings.resolved = {}


setting_changed.connect(_forget_resolved, dispatch_uid="django_idempotency.conf")
