"""The ``IDEMPOTENCY`` settings dict, read through a typed object.

Each setting is declared once, below, as an attribute of
``IdempotencySettings``: its default, how a value is normalised (which also
gives the attribute its type), the ids of the system checks that validate
it and one line of documentation. ``DEFAULTS``, the checks' list of known
settings and the reference in docs/settings.md
(``scripts/settings_reference.py``) are derived from these declarations.

Each attribute is resolved (defaults filled in, durations made timedeltas,
dotted paths imported) on first access and kept until ``settings.IDEMPOTENCY``
(or ``SECRET_KEY``, which the default ``DIGEST_KEYS`` follow) changes: Django
sends ``setting_changed`` for ``override_settings`` and the pytest-django
``settings`` fixture, and that clears what was kept. (Mutating
the dict in place at run time is not seen; nothing should.) Values are
validated by the system checks registered by ``checks.py``; here they are
only normalised.

Imports nothing from the package: every module may read its settings.
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
    from django.http import HttpRequest, HttpResponseBase

    from django_idempotency.responses import StoredResponse, Verdict

__all__ = [
    "DEFAULTS",
    "SETTINGS",
    "IdempotencySettings",
    "Setting",
    "TenantResolver",
    "as_timedelta",
    "idempotency_settings",
    "import_callable",
]

TenantResolver = Callable[["HttpRequest"], str]
Redactor = Callable[["StoredResponse"], "StoredResponse"]
#: An outcome policy (``outcomes.Outcome``): the view's response to its verdict.
OutcomePolicy = Callable[["HttpResponseBase"], "Verdict"]
#: The values of ``OPERATION_NAMES`` (``scope.OPERATION_NAMES`` lists them).
OperationNames = Literal["pattern", "normalised", "route_name"]
#: The values of ``MIDDLEWARE_KEYS``.
MiddlewareKeys = Literal["report", "required"]
#: What the generic checks know how to validate (see ``checks.py``); None:
#: the setting has a check of its own beside the feature it configures.
Kind = Literal["boolean", "duration"]
T = TypeVar("T")


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


class Setting(Generic[T]):
    """One key of ``IDEMPOTENCY``, declared once; read on an instance, its resolved value.

    The value is computed once per value of ``settings.IDEMPOTENCY``: every
    protected request reads about fifteen settings, and resolving each one
    anew (dict lookups with defaults, timedelta conversions, imports) was a
    measurable share of the request path.
    """

    name: str

    def __init__(
        self,
        default: Any,
        normalise: Callable[[Any], T],
        *,
        checks: tuple[str, ...],
        doc: str,
        kind: Kind | None = None,
        default_note: str = "",
    ) -> None:
        self.default = default
        self.normalise = normalise
        #: The ids (``E002``...) of the system checks that report a bad value.
        self.checks = checks
        #: The reference's line for this setting (Markdown).
        self.doc = doc
        self.kind = kind
        #: What the reference adds after the default, e.g. " (1 MiB)".
        self.default_note = default_note

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Setting[T]: ...

    @overload
    def __get__(self, instance: IdempotencySettings, owner: type | None = None) -> T: ...

    def __get__(
        self, instance: IdempotencySettings | None, owner: type | None = None
    ) -> T | Setting[T]:
        if instance is None:
            return self
        # The dict of the settings' current value: a change meanwhile
        # replaces it, so a value computed from the old one is not kept.
        resolved = instance.resolved
        try:
            value: T = resolved[self.name]
        except KeyError:
            value = resolved[self.name] = self.normalise(instance.value_of(self.name))
        return value


# Normalisers: the value as given (validated by the checks) to the typed value.


def _text(value: Any) -> str:
    return cast(str, value)


def _count(value: Any) -> int:
    return cast(int, value)


def _optional_alias(value: Any) -> str | None:
    # None: the routers choose per request (routing.database_for).
    return cast("str | None", value)


def _optional_duration(value: Any) -> timedelta | None:
    return None if value is None else as_timedelta(value)


def _names(value: Any) -> tuple[str, ...]:
    return tuple(value)


def _sinks(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value or ())


def _aliases(value: Any) -> Mapping[str, str]:
    return dict(value)


def _tenant(value: Any) -> TenantResolver:
    if isinstance(value, str):
        return import_callable(value, "TENANT")
    return cast(TenantResolver, value)


def _redactor(value: Any) -> Redactor | None:
    if isinstance(value, str):
        return import_callable(value, "REDACT")
    return cast("Redactor | None", value)


def _outcome(value: Any) -> OutcomePolicy | None:
    if isinstance(value, str):
        return import_callable(value, "OUTCOME")
    return cast("OutcomePolicy | None", value)


def _in_flight(value: Any) -> Literal["conflict", "wait"]:
    return cast(Literal["conflict", "wait"], value)


def _error_format(value: Any) -> Literal["drf", "problem"]:
    return cast(Literal["drf", "problem"], value)


def _middleware_keys(value: Any) -> MiddlewareKeys:
    return cast(MiddlewareKeys, value)


def _operation_names(value: Any) -> OperationNames:
    return cast(OperationNames, value)


def _as_bytes(secret: str | bytes) -> bytes:
    return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)


def _digest_keys(value: Any) -> tuple[tuple[str | None, bytes], ...]:
    """(version, secret) pairs, newest first.

    A version of None: the secret is ``SECRET_KEY`` or one of its fallbacks,
    whose version ``_store.digests`` derives from it (with the stored
    format's salt, which is the digests' to know).
    """
    if value is None:
        secrets = [django_settings.SECRET_KEY, *django_settings.SECRET_KEY_FALLBACKS]
        return tuple((None, _as_bytes(secret)) for secret in secrets)
    return tuple((str(version), _as_bytes(secret)) for version, secret in value)


class IdempotencySettings:
    """Typed access to ``settings.IDEMPOTENCY`` with the documented defaults."""

    def __init__(self) -> None:
        self.resolved: dict[str, Any] = {}

    @property  # always read anew: the system checks use it
    def user_settings(self) -> Mapping[str, Any]:
        value = getattr(django_settings, "IDEMPOTENCY", {})
        return value if isinstance(value, Mapping) else {}

    def value_of(self, name: str) -> Any:
        """The value of setting ``name`` as given, or its default."""
        return self.user_settings.get(name, DEFAULTS[name])

    HEADER = Setting(
        "Idempotency-Key",
        _text,
        checks=("E002",),
        doc="The request header carrying the key; echoed on executed and replayed responses.",
    )
    REQUIRED = Setting(
        True,
        bool,
        kind="boolean",
        checks=("E003",),
        doc="Refuse a protected request without a key (400 `idempotency_key_missing`). "
        "`False` runs it unprotected. Per view: `idempotent(required=...)`.",
    )
    MIDDLEWARE_KEYS = Setting(
        "report",
        _middleware_keys,
        checks=("E051",),
        doc="What `IdempotencyMiddleware` does with an unsafe request that sends no key, on a "
        'view it protects. `"report"`: the request runs unprotected, as without the middleware, '
        "and is counted (`idempotency_keyless_requests_total`) and logged with its client, so "
        'that you see who still sends none. `"required"`: it is refused with 400 '
        "`idempotency_key_missing`. A request with a key is protected in both. Views with "
        "`@idempotent` or `IdempotentMixin` follow their own `required` (and `REQUIRED`). See "
        "[The middleware](middleware.md#rolling-out-keys).",
    )
    MIDDLEWARE_PLAIN_VIEW_PREFIXES = Setting(
        (),
        _names,
        checks=("E052",),
        doc='The URL path prefixes (`"/api/"`, each starting with `/`) under which '
        "`IdempotencyMiddleware` protects plain Django views too; DRF views are protected "
        "wherever they are routed. `()`: no plain view is, so the admin, login and HTML forms "
        "stay as they are. Matched against the path the URLconf resolves (without "
        "`SCRIPT_NAME`). See [The middleware](middleware.md#plain-django-views).",
    )
    KEY_MAX_LENGTH = Setting(
        255,
        _count,
        checks=("E004",),
        doc="Longest accepted key, 1 to 255 (the column size).",
    )
    TTL = Setting(
        timedelta(hours=24),
        as_timedelta,
        kind="duration",
        checks=("E005", "E014"),
        doc="Retention: how long an outcome is replayed, counted from when it was stored. "
        "Per view: `idempotent(ttl=...)`. See [Choosing TTL and lease](ttl-and-lease.md).",
    )
    LEASE = Setting(
        timedelta(minutes=2),
        as_timedelta,
        kind="duration",
        checks=("E006", "E014"),
        doc="How long an owner holds a record before a duplicate request or recovery may "
        "take it over.",
    )
    TENANT = Setting(
        "django_idempotency.scope.default_tenant",
        _tenant,
        checks=("E007",),
        doc="A callable, or the dotted path to one, taking the request and returning the "
        "tenant as a string. See [Tenants](#tenants).",
    )
    DATABASE = Setting(
        "default",
        _optional_alias,
        checks=("E008", "E023"),
        doc="Database alias of the record table. It must be the database your protected "
        "views write to, so that their writes and the outcome commit together. See "
        "[Multiple databases](databases.md). `None`: your database routers choose the alias "
        "per request, `db_for_write(IdempotencyRecord, tenant=..., operation=..., "
        "request=...)`, so that each tenant's records live with its data (shards); the view "
        "learns it as `request.idempotency.database`. See [Databases: routing records with "
        "the tenant's data](shards.md).",
    )
    IN_FLIGHT = Setting(
        "conflict",
        _in_flight,
        checks=("E009",),
        doc='A duplicate of a running request gets 409 at once. `"wait"`: it waits up to '
        "`IN_FLIGHT_WAIT` for the first to finish and replays its outcome, else 409. Views "
        "with `optimistic=True` always wait on the database whatever this says: their "
        "record's INSERT up to `IN_FLIGHT_WAIT` on PostgreSQL, their own statements as the "
        "connection's `lock_timeout` allows.",
    )
    IN_FLIGHT_WAIT = Setting(
        timedelta(seconds=10),
        as_timedelta,
        kind="duration",
        checks=("E010",),
        doc='Bound of the `"wait"` mode, and of every wait of a request on another '
        "session's lock on its record (then 409 with Retry-After): on PostgreSQL the "
        "transaction-local `lock_timeout` of the claim, of the takeover of an abandoned claim "
        "(also on MySQL/MariaDB, in whole seconds) and of an `optimistic` view's record "
        "INSERT (and of the DELETE of an expired record it replaces), how long a request "
        "waits on another's record not committed yet; and the "
        "`idle_in_transaction_session_timeout` (at least 1 s) of recovery's takeover, so "
        "that a recovery worker cut off from the database mid-takeover never holds a "
        "record's row longer ([partitions](fleet.md#a-partition)).",
    )
    FAIL_OPEN = Setting(
        False,
        bool,
        kind="boolean",
        checks=("E011",),
        doc="When the record store cannot be reached, run the view unprotected (logging a "
        "warning) instead of answering 503.",
    )
    STORED_HEADERS = Setting(
        (),
        _names,
        checks=("E012",),
        doc="Response headers stored and replayed besides `Content-Type` and `Location`, "
        'e.g. `["ETag"]`. A list or tuple of header names.',
    )
    MAX_STORED_BODY = Setting(
        1024 * 1024,
        _count,
        checks=("E013",),
        default_note=" (1 MiB)",
        doc="Largest response body stored, in bytes. See [Stored responses](responses.md).",
    )
    OUTCOME = Setting(
        None,
        _outcome,
        checks=("E041",),
        default_note=": `outcomes.standard`",
        doc="The project's outcome policy: which answers are stored, which release the claim, "
        "which leave the record UNCERTAIN, for every view keyed by the `Idempotency-Key` "
        "header that chooses none (`outcome=`). A callable, or its dotted path, given the "
        "view's finished response and returning a `Verdict`, such as "
        "`outcomes.by_status({...})`. Views whose key comes from elsewhere (`key=`, "
        "webhooks) keep `outcomes.webhook` unless they choose their own. See "
        "[Outcome policies](responses.md#outcome-policies).",
    )
    ERROR_FORMAT = Setting(
        "drf",
        _error_format,
        checks=("E015",),
        doc='`"drf"`: refusals are raised for your `EXCEPTION_HANDLER` (`{"detail", '
        '"code"}`). `"problem"`: RFC 9457 `application/problem+json`. See '
        "[Errors](errors.md).",
    )
    PROBLEM_TYPE_BASE = Setting(
        "https://django-idempotency.readthedocs.io/en/latest/errors/#",
        _text,
        checks=("E016",),
        doc="Prefix of each problem's `type` URI; the error code follows it. Point it at "
        "your own API documentation if you publish one.",
    )
    REDACT = Setting(
        None,
        _redactor,
        checks=("E017",),
        doc="A callable (or dotted path) receiving the `StoredResponse` (status, headers, "
        "body) about to be stored and returning what to store instead: strip card numbers, "
        "tokens, personal data. The first answer is the view's own; replays carry what was "
        "kept. See [Security](security.md).",
    )
    ENCRYPTION_KEYS = Setting(
        (),
        _names,
        checks=("E018",),
        doc='Fernet keys (`cryptography`, `pip install "django-idempotency[encryption]"`), '
        "newest first: the first encrypts stored headers and bodies (the headers also when "
        "the body was not stored), every key decrypts. Rotate by putting a new key first, "
        "running `manage.py idempotency_rotate_keys`, then removing the old one; the same "
        "command encrypts responses stored before the keys were set.",
    )
    DIGEST_KEYS = Setting(
        None,
        _digest_keys,
        checks=("E021",),
        default_note=": one secret derived from `SECRET_KEY`, then one from each of "
        "`SECRET_KEY_FALLBACKS`",
        doc="The secrets of the keyed digests (HMAC-SHA256) stored as fingerprints and "
        "provider keys, newest first, as `[(version, secret), ...]`: a version of 1 to 16 "
        "letters, digits, `_`, `.` or `-` that never changes for its secret, and a secret of "
        "at least 32 characters. New digests use the first; fingerprints are compared under "
        "every one listed. See [Digest keys](#digest-keys).",
    )
    MAX_FINGERPRINTED_BODY = Setting(
        2_621_440,
        _count,
        checks=("E019",),
        default_note=" (Django's `DATA_UPLOAD_MAX_MEMORY_SIZE` default)",
        doc="Largest declared body (Content-Length) of a protected request; larger ones are "
        "refused with 413 `idempotency_body_too_large` before anything is parsed or claimed. "
        "Every request whose `Content-Type` is `multipart/*` is exempt, not only "
        "`multipart/form-data` uploads: see "
        "[idempotency_body_too_large](errors.md#idempotency_body_too_large).",
    )
    OPERATION_NAMES = Setting(
        "pattern",
        _operation_names,
        checks=("E022",),
        doc='How a protected view\'s default operation name is written: `"pattern"`, the '
        "method plus the URL route pattern (`PATCH api/orders/(?P<pk>[^/.]+)`); "
        '`"normalised"`, with the URL arguments as `{name}` (`PATCH api/orders/{pk}`); '
        '`"route_name"`, with the URL\'s name and namespaces (`PATCH orders-detail`). Choose '
        "it when you start: changing it renames operations under a running system. See "
        "[Operation names](#operation-names).",
    )
    INTENT_DATABASES = Setting(
        {},
        _aliases,
        checks=("E030", "E031", "E032", "E033", "W010"),
        doc="For each records' alias (`DATABASE`, or each alias your router sends records "
        "to), the alias whose connections write what must commit while the view's "
        "transaction is still open: the intent of `begin_external()`, "
        "`set_provider_operation()` and `renew_lease()` inside the view. `{}`: a second "
        "connection to the records' alias itself. Behind PgBouncer in transaction pooling, "
        "map it to a second PgBouncer entry of the same database, a pool of its own, or the "
        "pool deadlocks when it is no larger than the concurrent external calls. The mapped "
        "alias must reach the same database. Its connections are opened per thread and "
        "closed when the protected view is done. See [PgBouncer](pgbouncer.md).",
    )
    TOMBSTONE_TTL = Setting(
        None,
        _optional_duration,
        checks=("E035", "W023"),
        default_note=": no tombstones",
        doc="How long a key stays refused after its record's retention (`expires_at`) has "
        "passed: a retry of the same request then gets 422 `idempotency_key_expired` instead "
        "of running again, one of other input 422 `idempotency_key_reused`. The purge drops "
        "the stored response and keeps the record's scope and fingerprint (a tombstone) "
        "until `expires_at` plus `TOMBSTONE_TTL`, then deletes it. `None`: past retention a "
        "key starts a new operation. A storage decision, off by default; a project that "
        "registers reconcilers (it calls providers) is asked to make it (W023) until the key "
        "is set, to a duration or to `None`. See [Expired keys](ttl-and-lease.md#expired-keys).",
    )
    ADVERTISE_RETENTION = Setting(
        False,
        bool,
        kind="boolean",
        checks=("E034",),
        doc="Put `Idempotency-Key-Expires-In: <seconds>` on every response whose outcome is "
        "stored: how long a retry with the same key still gets it (the retention on a first "
        "execution, what is left on a replay). See "
        "[Advertising retention](http.md#advertising-retention).",
    )
    METRICS = Setting(
        ("opentelemetry",),
        _sinks,
        checks=("E037", "W022"),
        doc='Where the package\'s metrics go: `"opentelemetry"` (the OpenTelemetry API: a '
        "no-op until your project configures an SDK, and when the API is not installed), "
        '`"prometheus"` (`prometheus_client`, `pip install "django-idempotency[prometheus]"`, '
        "across gunicorn's workers with `PROMETHEUS_MULTIPROC_DIR`), both, or `()` for none. "
        "See [Observability](observability.md).",
    )
    METRICS_OPERATIONS = Setting(
        100,
        _count,
        checks=("E038",),
        doc="The most distinct `operation` label values one process uses, a ceiling for a "
        "project with more protected operations than its metrics backend should hold: later "
        'ones are counted under `"other"` (and logged once). Whatever it is, only operation '
        "names written in the code are labels, the same in every process (a route's, a "
        "literal `operation=`, a task's, a reconciler's); names a callable makes per request "
        'are always `"other"`. See [Labels](observability.md#labels).',
    )
    METRICS_TENANT = Setting(
        False,
        bool,
        kind="boolean",
        checks=("E039",),
        doc="Label the request counter with the tenant too. Only where tenants are few: "
        "every tenant is a time series of its own. Keys are never labels.",
    )
    TRACING = Setting(
        True,
        bool,
        kind="boolean",
        checks=("E040",),
        doc="Spans for the claim, the view, the completion, `begin_external()` and replays, "
        "through the OpenTelemetry API (a no-op without it or without an SDK). See "
        "[Observability](observability.md#traces).",
    )


#: Every setting, in the reference's order.
SETTINGS: tuple[Setting[Any], ...] = tuple(
    value for value in vars(IdempotencySettings).values() if isinstance(value, Setting)
)
DEFAULTS: Mapping[str, Any] = {setting.name: setting.default for setting in SETTINGS}

idempotency_settings = IdempotencySettings()


#: Settings that resolved values depend on (the default DIGEST_KEYS).
_WATCHED = frozenset({"IDEMPOTENCY", "SECRET_KEY", "SECRET_KEY_FALLBACKS"})


def _forget_resolved(*, setting: str, **kwargs: Any) -> None:
    if setting in _WATCHED:
        idempotency_settings.resolved = {}


setting_changed.connect(_forget_resolved, dispatch_uid="django_idempotency.conf")
