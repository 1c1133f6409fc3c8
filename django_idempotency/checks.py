"""System checks for ``settings.IDEMPOTENCY``: one stable id per problem.

Ids are never reused. Retired ids stay listed here as comments.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import DEFAULTS, as_timedelta, idempotency_settings, import_callable
from django_idempotency.models import KEY_MAX_LENGTH

__all__ = [
    "check_atomic_requests",
    "check_settings",
]

_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def _error(id_: int, msg: str, hint: str) -> Error:
    return Error(msg, hint=hint, id=f"django_idempotency.E{id_:03d}")


def _is_duration(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or isinstance(
        value, timedelta
    )


def _positive_duration(value: Any) -> bool:
    return _is_duration(value) and as_timedelta(value) > timedelta(0)


def _check_header(value: Any) -> Iterator[CheckMessage]:
    if not isinstance(value, str) or not _HEADER_NAME.match(value):
        yield _error(
            2,
            f"IDEMPOTENCY['HEADER'] = {value!r} is not a valid HTTP header name.",
            "Use a header name such as 'Idempotency-Key' (letters, digits and '-').",
        )


def _check_bool(name: str, id_: int) -> Callable[[Any], Iterator[CheckMessage]]:
    def check(value: Any) -> Iterator[CheckMessage]:
        if not isinstance(value, bool):
            yield _error(
                id_,
                f"IDEMPOTENCY[{name!r}] = {value!r} is not a boolean.",
                f"Set IDEMPOTENCY[{name!r}] to True or False.",
            )

    return check


def _check_key_max_length(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= KEY_MAX_LENGTH:
        yield _error(
            4,
            f"IDEMPOTENCY['KEY_MAX_LENGTH'] = {value!r} is not an integer from 1 to "
            f"{KEY_MAX_LENGTH}.",
            f"The key column holds {KEY_MAX_LENGTH} characters; Stripe documents 255.",
        )


def _check_duration(name: str, id_: int) -> Callable[[Any], Iterator[CheckMessage]]:
    def check(value: Any) -> Iterator[CheckMessage]:
        if not _positive_duration(value):
            yield _error(
                id_,
                f"IDEMPOTENCY[{name!r}] = {value!r} is not a positive duration.",
                "Give a datetime.timedelta or a number of seconds greater than zero.",
            )

    return check


def _check_tenant(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, str):
        try:
            import_callable(value, "TENANT")
        except ImproperlyConfigured as exc:
            yield _error(
                7,
                str(exc),
                "Give a callable taking the request and returning the tenant as a "
                "string, or its dotted import path.",
            )
    elif not callable(value):
        yield _error(
            7,
            f"IDEMPOTENCY['TENANT'] = {value!r} is neither callable nor a dotted path.",
            "Give a callable taking the request and returning the tenant as a string, "
            "or its dotted import path.",
        )


def _check_database(value: Any) -> Iterator[CheckMessage]:
    if value not in settings.DATABASES:
        yield _error(
            8,
            f"IDEMPOTENCY['DATABASE'] = {value!r} is not an alias in DATABASES.",
            f"Use one of: {', '.join(sorted(settings.DATABASES))}.",
        )


def _check_in_flight(value: Any) -> Iterator[CheckMessage]:
    if value not in ("conflict", "wait"):
        yield _error(
            9,
            f"IDEMPOTENCY['IN_FLIGHT'] = {value!r} is not 'conflict' or 'wait'.",
            "'conflict' answers 409 at once; 'wait' waits up to IN_FLIGHT_WAIT for "
            "the first request to finish, then replays its response.",
        )


def _check_stored_headers(value: Any) -> Iterator[CheckMessage]:
    if (
        isinstance(value, str)
        or not isinstance(value, (list, tuple))
        or not all(isinstance(name, str) and _HEADER_NAME.match(name) for name in value)
    ):
        yield _error(
            12,
            f"IDEMPOTENCY['STORED_HEADERS'] = {value!r} is not a list of header names.",
            "List further response headers to store and replay, e.g. ['ETag'].",
        )


def _check_max_stored_body(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        yield _error(
            13,
            f"IDEMPOTENCY['MAX_STORED_BODY'] = {value!r} is not a number of bytes.",
            "Give a non-negative integer; bodies larger than this are not stored.",
        )


def _check_error_format(value: Any) -> Iterator[CheckMessage]:
    if value not in ("drf", "problem"):
        yield _error(
            15,
            f"IDEMPOTENCY['ERROR_FORMAT'] = {value!r} is not 'drf' or 'problem'.",
            '\'drf\' raises refusals for your EXCEPTION_HANDLER ({"detail", "code"}); '
            "'problem' answers with RFC 9457 application/problem+json.",
        )


def _check_problem_type_base(value: Any) -> Iterator[CheckMessage]:
    if not isinstance(value, str):
        yield _error(
            16,
            f"IDEMPOTENCY['PROBLEM_TYPE_BASE'] = {value!r} is not a string.",
            "Give the URI that, followed by an error code, documents the error.",
        )


def _check_redact(value: Any) -> Iterator[CheckMessage]:
    if value is None:
        return
    if isinstance(value, str):
        try:
            import_callable(value, "REDACT")
        except ImproperlyConfigured as exc:
            yield _error(17, str(exc), "Give a callable (or its dotted path), or None.")
    elif not callable(value):
        yield _error(
            17,
            f"IDEMPOTENCY['REDACT'] = {value!r} is not callable.",
            "Give a callable taking the StoredResponse to store and returning what to keep.",
        )


def _check_encryption_keys(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        yield _error(
            18,
            f"IDEMPOTENCY['ENCRYPTION_KEYS'] = {value!r} is not a list of Fernet keys.",
            "Give a list, newest key first: ['<Fernet.generate_key()>', ...], or [].",
        )
        return
    if not value:
        return
    try:
        from cryptography.fernet import Fernet
    except ImportError:
        yield _error(
            18,
            "IDEMPOTENCY['ENCRYPTION_KEYS'] is set but cryptography is not installed.",
            'pip install "django-idempotency[encryption]"',
        )
        return
    for index, key in enumerate(value):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            yield _error(
                18,
                f"IDEMPOTENCY['ENCRYPTION_KEYS'][{index}] is not a Fernet key.",
                "Generate one with cryptography.fernet.Fernet.generate_key().",
            )


_DIGEST_VERSION = re.compile(r"^[A-Za-z0-9_.-]{1,16}$")
#: Fewer bytes than a SHA-256 digest would make the secret the weak link.
_DIGEST_SECRET_MIN_LENGTH = 32


def _digest_keys_problem(value: Any) -> str | None:
    if not isinstance(value, (list, tuple)) or not value:
        return f"= {value!r} is not a non-empty list of (version, secret) pairs."
    versions: set[str] = set()
    for index, entry in enumerate(value):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            return f"[{index}] is not a (version, secret) pair."
        version, secret = entry
        if not isinstance(version, str) or not _DIGEST_VERSION.match(version):
            return f"[{index}] has the version {version!r}, not 1 to 16 of [A-Za-z0-9_.-]."
        if version in versions:
            return f"[{index}] repeats the version {version!r}."
        versions.add(version)
        if not isinstance(secret, (str, bytes)) or len(secret) < _DIGEST_SECRET_MIN_LENGTH:
            return f"[{index}] has a secret shorter than {_DIGEST_SECRET_MIN_LENGTH} characters."
    return None


def _check_digest_keys(value: Any) -> Iterator[CheckMessage]:
    if value is None:  # derived from SECRET_KEY and SECRET_KEY_FALLBACKS
        return
    problem = _digest_keys_problem(value)
    if problem is not None:
        yield _error(
            21,
            f"IDEMPOTENCY['DIGEST_KEYS']{problem}",
            "Give [(version, secret), ...], newest first: a version of up to 16 letters, "
            "digits, '_', '.' or '-' that never changes for its secret, and a random "
            "secret of at least 32 characters. Keep a replaced secret listed for TTL. "
            "Or leave DIGEST_KEYS unset to derive it from SECRET_KEY.",
        )


def _check_max_fingerprinted_body(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        yield _error(
            19,
            f"IDEMPOTENCY['MAX_FINGERPRINTED_BODY'] = {value!r} is not a positive number of bytes.",
            "Protected requests with a larger body are refused with 413.",
        )


_CHECKS: Mapping[str, Callable[[Any], Iterator[CheckMessage]]] = {
    "HEADER": _check_header,
    "REQUIRED": _check_bool("REQUIRED", 3),
    "KEY_MAX_LENGTH": _check_key_max_length,
    "TTL": _check_duration("TTL", 5),
    "LEASE": _check_duration("LEASE", 6),
    "TENANT": _check_tenant,
    "DATABASE": _check_database,
    "IN_FLIGHT": _check_in_flight,
    "IN_FLIGHT_WAIT": _check_duration("IN_FLIGHT_WAIT", 10),
    "FAIL_OPEN": _check_bool("FAIL_OPEN", 11),
    "STORED_HEADERS": _check_stored_headers,
    "MAX_STORED_BODY": _check_max_stored_body,
    "ERROR_FORMAT": _check_error_format,
    "PROBLEM_TYPE_BASE": _check_problem_type_base,
    "SINGLE_TRANSACTION": _check_bool("SINGLE_TRANSACTION", 20),
    "REDACT": _check_redact,
    "ENCRYPTION_KEYS": _check_encryption_keys,
    "DIGEST_KEYS": _check_digest_keys,
    "MAX_FINGERPRINTED_BODY": _check_max_fingerprinted_body,
}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    user_settings = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user_settings, Mapping):
        return [
            _error(
                1,
                f"IDEMPOTENCY must be a dict, not {type(user_settings).__name__}.",
                "Set IDEMPOTENCY = {...} with the keys listed in the settings reference.",
            )
        ]
    messages: list[CheckMessage] = []
    for name in sorted(set(user_settings) - set(DEFAULTS)):
        messages.append(
            Warning(
                f"IDEMPOTENCY[{name!r}] is not a setting of django-idempotency.",
                hint=f"Known settings: {', '.join(DEFAULTS)}. Check the spelling.",
                id="django_idempotency.W001",
            )
        )
    for name, check in _CHECKS.items():
        messages.extend(check(user_settings.get(name, DEFAULTS[name])))
    ttl = user_settings.get("TTL", DEFAULTS["TTL"])
    lease = user_settings.get("LEASE", DEFAULTS["LEASE"])
    if (
        _positive_duration(ttl)
        and _positive_duration(lease)
        and as_timedelta(ttl) < as_timedelta(lease)
    ):
        messages.append(
            _error(
                14,
                "IDEMPOTENCY['TTL'] is shorter than IDEMPOTENCY['LEASE'].",
                "Retention must outlast the lease, or a record could be forgotten "
                "while its request still runs. Raise TTL or lower LEASE.",
            )
        )
    messages.extend(_check_sqlite_transaction_mode(user_settings.get("DATABASE", "default")))
    return messages


def _check_sqlite_transaction_mode(alias: Any) -> Iterator[CheckMessage]:
    database = settings.DATABASES.get(alias) if isinstance(alias, str) else None
    if (
        database is not None
        and database.get("ENGINE") == "django.db.backends.sqlite3"
        and str(database.get("OPTIONS", {}).get("transaction_mode", "")).upper() != "IMMEDIATE"
    ):
        yield Warning(
            f"The idempotency records live in SQLite database {alias!r}, whose "
            "transactions are DEFERRED.",
            hint="Set DATABASES[...]['OPTIONS']['transaction_mode'] = 'IMMEDIATE' (and a "
            "'timeout'): a deferred transaction that reads before it writes fails with "
            "'database is locked' when a concurrent request commits meanwhile.",
            id="django_idempotency.W003",
        )


def _url_callbacks(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    from django.urls import URLPattern, URLResolver

    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _url_callbacks(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), entry.callback


def _is_protected(view: Any) -> bool:
    """Whether a URL's callback runs an ``@idempotent`` handler for some method."""
    from django_idempotency.drf import protection_of

    view_class = getattr(view, "cls", getattr(view, "view_class", None))
    if not isinstance(view_class, type):
        return False
    # A viewset routes methods to actions; other views to same-named handlers.
    routes = {method: method for method in ("post", "put", "patch", "delete")}
    routes.update(getattr(view, "actions", None) or {})
    return any(
        protection_of(view_class, handler, method) is not None for method, handler in routes.items()
    )


@register(Tags.urls)
def check_atomic_requests(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    # Only the records' database matters: the claim commits on its own
    # unless that database's request transaction is already open.
    records = idempotency_settings.DATABASE
    if not settings.DATABASES.get(records, {}).get("ATOMIC_REQUESTS"):
        return []
    atomic = [records]
    from django.urls import get_resolver

    messages: list[CheckMessage] = []
    for route, callback in _url_callbacks(get_resolver().url_patterns):
        exempt: set[str] = getattr(callback, "_non_atomic_requests", set())
        if not all(alias in exempt for alias in atomic) and _is_protected(callback):
            messages.append(
                Warning(
                    f"The view at {route!r} is protected by @idempotent but runs inside "
                    "ATOMIC_REQUESTS, so its claim commits only with the view.",
                    hint="For an @api_view, put @transaction.non_atomic_requests above "
                    "@api_view. For a class whose own dispatch() is overridden, decorate "
                    "that dispatch with @transaction.non_atomic_requests. @idempotent then "
                    "opens the view's transaction itself, after committing the claim.",
                    obj=callback,
                    id="django_idempotency.W002",
                )
            )
    return messages
