"""System checks for ``settings.IDEMPOTENCY``: one stable id per problem.

Ids are never reused. Retired ids stay listed here as comments.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import os
import re
import textwrap
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.utils import load_backend

from django_idempotency._store.routing import routed_record_databases
from django_idempotency.conf import DEFAULTS, as_timedelta, idempotency_settings, import_callable
from django_idempotency.models import KEY_MAX_LENGTH
from django_idempotency.scope import OPERATION_NAMES

if TYPE_CHECKING:
    from django_idempotency._routes import ProtectedURL

__all__ = [
    "check_atomic_requests",
    "check_celery_timeouts",
    "check_intent_databases_reach_the_records",
    "check_operations",
    "check_optimistic_views",
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
    if value is None:
        # The routers choose per request: they must let the records migrate somewhere.
        if not routed_record_databases():
            yield _error(
                23,
                "IDEMPOTENCY['DATABASE'] is None, but no database router lets "
                "IdempotencyRecord migrate to any alias in DATABASES: no database "
                "holds the records.",
                "Let allow_migrate() return True for app_label 'django_idempotency' on every "
                "alias db_for_write() may return for it (each shard), and False on replicas.",
            )
        return
    if not isinstance(value, str) or value not in settings.DATABASES:
        yield _error(
            8,
            f"IDEMPOTENCY['DATABASE'] = {value!r} is not an alias in DATABASES.",
            f"Use one of: {', '.join(sorted(settings.DATABASES))}, or None to let the "
            "database routers choose per request.",
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


def _check_operation_names(value: Any) -> Iterator[CheckMessage]:
    if value not in OPERATION_NAMES:
        yield _error(
            22,
            f"IDEMPOTENCY['OPERATION_NAMES'] = {value!r} is not one of "
            f"{', '.join(map(repr, OPERATION_NAMES))}.",
            "'pattern' (the default) names an operation by its route pattern, "
            "'normalised' writes the URL arguments as {name}, 'route_name' uses the "
            "URL's name. Changing it renames operations: drain unresolved records first "
            "(see the settings reference).",
        )


def _check_intent_databases(value: Any) -> Iterator[CheckMessage]:
    if not isinstance(value, Mapping) or not all(
        isinstance(records, str) and isinstance(intents, str) for records, intents in value.items()
    ):
        yield _error(
            30,
            f"IDEMPOTENCY['INTENT_DATABASES'] = {value!r} is not a dict of database aliases.",
            "Map the alias of the records to the alias whose connections write the intents "
            "of begin_external(), e.g. {'default': 'intents'}; {} for none.",
        )
        return
    for records, intents in value.items():
        unknown = [alias for alias in (records, intents) if alias not in settings.DATABASES]
        if unknown:
            yield _error(
                31,
                f"IDEMPOTENCY['INTENT_DATABASES'] maps {records!r} to {intents!r}, but "
                f"{' and '.join(map(repr, unknown))} is not an alias in DATABASES.",
                f"Use aliases of DATABASES: {', '.join(sorted(settings.DATABASES))}.",
            )
            continue
        yield from _intent_alias_mismatch(records, intents)


def _vendor(alias: str) -> str:
    """The kind of database of ``alias`` ("postgresql", "mysql"...), as its backend says."""
    engine = str(settings.DATABASES[alias].get("ENGINE", ""))
    try:
        return str(load_backend(engine).DatabaseWrapper.vendor)
    except (ImportError, ImproperlyConfigured, AttributeError):
        return engine


def _intent_alias_mismatch(records: str, intents: str) -> Iterator[CheckMessage]:
    """What the settings alone tell about two aliases that must reach one database.

    A pooler's database entry has a name of its own for the same database,
    so a different NAME (or host) proves nothing: the servers are asked by
    ``check --database`` (E032). Backends of different vendors are never one
    database; ENGINE paths may differ for one (PostGIS, a pooling wrapper).
    """
    vendor = _vendor(records)
    if _vendor(intents) != vendor:
        yield _error(
            33,
            f"IDEMPOTENCY['INTENT_DATABASES'] maps {records!r} to {intents!r}, whose database "
            "is of another kind: the intents must be written to the records' own database.",
            "Point the intents' alias at the same database, through a pool of its own.",
        )
    elif vendor == "sqlite":
        yield Warning(
            f"IDEMPOTENCY['INTENT_DATABASES'] maps {records!r}, a SQLite database: it is "
            "not used there.",
            hint="SQLite has one writer at a time, so begin_external() writes the intent in "
            "the view's transaction; there is no second connection to route.",
            id="django_idempotency.W010",
        )


def _check_tombstone_ttl(value: Any) -> Iterator[CheckMessage]:
    if value is not None and not _positive_duration(value):
        yield _error(
            35,
            f"IDEMPOTENCY['TOMBSTONE_TTL'] = {value!r} is neither None nor a positive duration.",
            "Give how long a late retry is refused after retention, as a datetime.timedelta "
            "or a number of seconds greater than zero; None keeps no tombstones.",
        )


#: The sinks IDEMPOTENCY["METRICS"] may name, and the module each needs.
_METRICS_SINKS = {"opentelemetry": "opentelemetry", "prometheus": "prometheus_client"}


def _check_metrics(value: Any) -> Iterator[CheckMessage]:
    sinks = (value,) if isinstance(value, str) else value
    if not isinstance(sinks, (list, tuple)) or not all(isinstance(s, str) for s in sinks):
        yield _error(
            37,
            f"IDEMPOTENCY['METRICS'] = {value!r} is not a tuple of sink names.",
            'Set it to ("opentelemetry",), ("prometheus",), both, or () for no metrics.',
        )
        return
    for sink in sinks:
        if sink not in _METRICS_SINKS:
            yield _error(
                37,
                f"IDEMPOTENCY['METRICS'] names {sink!r}, which is not a metrics sink.",
                f"The sinks are {', '.join(map(repr, _METRICS_SINKS))}.",
            )
        elif sink == "prometheus" and importlib.util.find_spec("prometheus_client") is None:
            # The OpenTelemetry API missing is no error: the default sink is
            # then a no-op, as it is without an SDK.
            yield _error(
                37,
                "IDEMPOTENCY['METRICS'] names 'prometheus', but prometheus_client is not "
                "installed.",
                'pip install "django-idempotency[prometheus]"',
            )


def _check_metrics_operations(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        yield _error(
            38,
            f"IDEMPOTENCY['METRICS_OPERATIONS'] = {value!r} is not a positive integer.",
            "Give the number of distinct operation names to label metrics with (100 by "
            "default); later ones are counted as 'other'.",
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
    "OPERATION_NAMES": _check_operation_names,
    "INTENT_DATABASES": _check_intent_databases,
    "TOMBSTONE_TTL": _check_tombstone_ttl,
    "ADVERTISE_RETENTION": _check_bool("ADVERTISE_RETENTION", 34),
    "METRICS": _check_metrics,
    "METRICS_OPERATIONS": _check_metrics_operations,
    "METRICS_TENANT": _check_bool("METRICS_TENANT", 39),
    "TRACING": _check_bool("TRACING", 40),
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
    configured = user_settings.get("DATABASE", "default")
    for alias in routed_record_databases() if configured is None else [configured]:
        messages.extend(_check_sqlite_transaction_mode(alias))
        messages.extend(_check_database_clock(alias))
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


def _check_database_clock(alias: Any) -> Iterator[CheckMessage]:
    database = settings.DATABASES.get(alias) if isinstance(alias, str) else None
    if database is None or not str(database.get("ENGINE", "")).startswith(
        "django.db.backends.mysql"
    ):
        return
    zone = (database.get("TIME_ZONE") or "UTC") if settings.USE_TZ else settings.TIME_ZONE
    if zone != "UTC":
        yield Warning(
            f"The idempotency records live in MySQL/MariaDB database {alias!r}, where Django "
            f"stores times of {zone!r}: leases and retention follow each app server's clock.",
            hint="Set USE_TZ=True and leave DATABASES[...]['TIME_ZONE'] unset: then the "
            "database's clock (UTC_TIMESTAMP) decides, and an app server whose clock drifts "
            "cannot take over a lease that is still running. Otherwise keep the hosts' "
            "clocks synchronised (NTP) well within the LEASE, or silence this warning if "
            "they are.",
            id="django_idempotency.W007",
        )


@register(Tags.urls)
def check_atomic_requests(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    # Only the records' database matters: the claim commits on its own
    # unless that database's request transaction is already open.
    configured = idempotency_settings.DATABASE
    every = routed_record_databases() if configured is None else [configured]
    atomic = {alias for alias in every if settings.DATABASES.get(alias, {}).get("ATOMIC_REQUESTS")}
    if not atomic or not getattr(settings, "ROOT_URLCONF", None):
        return []
    from django_idempotency._routes import protected_urls

    messages: list[CheckMessage] = []
    for url in protected_urls():
        exempt: set[str] = getattr(url.callback, "_non_atomic_requests", set())
        if all(alias in exempt for alias in atomic):
            continue
        messages.append(
            Warning(
                f"The view {url.view} at {url.route!r} is protected by @idempotent but "
                "runs inside ATOMIC_REQUESTS, so its claim commits only with the view, and "
                "begin_external() no longer commits the intent before the external call: a "
                "crash during the call leaves no record of it, and the retry calls the "
                "provider again.",
                hint="For an @api_view, put @transaction.non_atomic_requests above "
                "@api_view. For a class whose own dispatch() is overridden, decorate "
                "that dispatch with @transaction.non_atomic_requests. @idempotent then "
                "opens the view's transaction itself, after committing the claim.",
                obj=url.view,
                id="django_idempotency.W002",
            )
        )
    return messages


#: What an optimistic view must not call: duplicates may each run it.
_CALLS_OUT = frozenset(
    {"begin_external", "abegin_external", "set_provider_operation", "aset_provider_operation"}
)


@register(Tags.urls)
def check_optimistic_views(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """An ``optimistic=True`` handler whose own code calls ``begin_external()`` (E036).

    A look at the handler's source, not at what it calls: the refusal at run
    time (``ImproperlyConfigured``) covers the rest, but only once a request
    gets there.
    """
    if not getattr(settings, "ROOT_URLCONF", None):
        return []
    from django_idempotency._routes import protected_urls

    messages: list[CheckMessage] = []
    seen: set[tuple[str, str]] = set()
    for url in protected_urls():
        for handler in url.handlers:
            # Once per handler: a router's format-suffix route repeats it.
            if not handler.options.optimistic or (url.view, handler.handler) in seen:
                continue
            seen.add((url.view, handler.handler))
            calls = sorted(_calls_out(_handler_function(url, handler.handler)))
            if calls:
                messages.append(
                    _error(
                        36,
                        f"The view {url.view} ({handler.handler}) at {url.route!r} runs with "
                        f"optimistic=True but calls {', '.join(calls)}: concurrent duplicates "
                        "may each run an optimistic view, so a call outside the records' "
                        "database would be made once per duplicate (and the call is refused "
                        "at run time).",
                        "Drop optimistic=True from this view (the default mode commits the "
                        "intent before the call and runs the view once), or keep the view's "
                        "effects inside the records' database.",
                    )
                )
    return messages


def _handler_function(url: ProtectedURL, handler: str) -> Any:
    view_class = getattr(url.callback, "cls", getattr(url.callback, "view_class", None))
    function = getattr(view_class, handler, None) if isinstance(view_class, type) else None
    if function is None:
        function = url.callback
    from django_idempotency.decorators import IdempotentView

    # Under @api_view's closure, @idempotent (IdempotentView.view) and any
    # decorators (__wrapped__). Only @api_view's closure cell is followed:
    # a method calling super() has its class in one, and the class's source
    # is not the handler's.
    for _ in range(50):
        inner = getattr(function, "__wrapped__", None)
        if isinstance(function, IdempotentView):
            inner = function.view
        for cell in getattr(function, "__closure__", None) or () if inner is None else ():
            if isinstance(cell.cell_contents, IdempotentView):
                inner = cell.cell_contents
        if inner is None or inner is function:
            break
        function = inner
    return function


def _calls_out(function: Any) -> set[str]:
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return set()  # no source to read (a builtin, a generated function)
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in _CALLS_OUT
    }


@register(Tags.urls)
def check_operations(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Reconcilers without an operation (W004, W005); operations sharing a name (W006)."""
    if not getattr(settings, "ROOT_URLCONF", None):
        return []  # a worker's settings, say: no URL tells which operations exist
    from django_idempotency._routes import protected_urls
    from django_idempotency.recovery import reconciler_for, registered_operations

    style = idempotency_settings.OPERATION_NAMES
    urls = list(protected_urls())
    named = {url.operation(handler, style) for url in urls for handler in url.handlers}
    messages = list(_shared_names(urls, style))
    if None in named:
        # A callable operation= names its records per request: any name may be one.
        return messages
    for operation in registered_operations():
        # An idempotent_task's operation ("task ...") is in no URLconf, and
        # its module may be imported by workers only: not judged here.
        if operation not in named and not operation.startswith("task "):
            # Named by the reconciler, as W002 names the view.
            reconciler = _dotted(reconciler_for(operation))
            messages.append(_unknown_operation(operation, reconciler, urls, named, style))
    return messages


def _unknown_operation(
    operation: str, reconciler: str, urls: list[ProtectedURL], named: set[str | None], style: str
) -> CheckMessage:
    # The settings under which some protected view has this very name.
    others = [
        other
        for other in OPERATION_NAMES
        if other != style
        and any(
            url.operation(handler, other) == operation for url in urls for handler in url.handlers
        )
    ]
    if others:
        current = sorted(
            {
                repr(url.operation(handler, style))
                for url in urls
                for handler in url.handlers
                if any(url.operation(handler, other) == operation for other in others)
            }
        )
        under = " and ".join(repr(other) for other in others)
        # Kept on purpose while records of the old names drain, or written
        # for the wrong setting: either way never called for new records.
        return Warning(
            f"A reconciler is registered for {operation!r}, which is an operation name "
            f"under IDEMPOTENCY['OPERATION_NAMES'] = {under}, not under the current "
            f"{style!r}: records made from now on are named otherwise.",
            hint=f"Register it as {' or '.join(current)}. While switching settings, keep "
            "the old registration until no unresolved record carries the old name, "
            "then remove it.",
            obj=reconciler,
            id="django_idempotency.W005",
        )
    hint = f"Register it under a protected operation's name{_closest(operation, named)}."
    return Warning(
        f"A reconciler is registered for {operation!r}, but no view protected by "
        "@idempotent or IdempotentMixin has this operation, so it is never called.",
        hint=hint,
        obj=reconciler,
        id="django_idempotency.W004",
    )


def _dotted(function: object) -> str:
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{getattr(function, '__module__', '?')}.{name}"


def _closest(operation: str, named: set[str | None]) -> str:
    names = [name for name in named if name is not None]
    close = difflib.get_close_matches(operation, names, n=3)
    if not close:
        return " (none is close to this one; is its view in ROOT_URLCONF?)"
    return ", e.g. " + " or ".join(repr(name) for name in close)


def _shared_names(urls: list[ProtectedURL], style: str) -> Iterator[CheckMessage]:
    """Default names that two different views' handlers share (one key space, one reconciler)."""
    sharing: dict[str, set[tuple[str, str]]] = {}
    for url in urls:
        for handler in url.handlers:
            name = url.operation(handler, style)
            if name is not None and handler.options.operation is None:
                sharing.setdefault(name, set()).add((url.view, handler.handler))
    for name, handlers in sorted(sharing.items()):
        if len(handlers) > 1:
            views = ", ".join(f"{view} ({handler})" for view, handler in sorted(handlers))
            yield Warning(
                f"The operation name {name!r} is shared by {views}: their records share one "
                "key space and one reconciler.",
                hint="Give the URLs distinct names (or namespaces), or give one view "
                "operation=... of its own.",
                obj=name,
                id="django_idempotency.W006",
            )


#: The database a connection reached, as its server tells: the same answer
#: through a pooler's database entry as directly.
_IDENTITY = {
    "postgresql": "SELECT current_database(), (SELECT system_identifier FROM pg_control_system())",
    "mysql": "SELECT DATABASE(), @@hostname, @@port",
}


@register(Tags.database)
def check_intent_databases_reach_the_records(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """E032: an intents alias of INTENT_DATABASES that reaches another database.

    A database check: ``manage.py check --database <alias>`` and ``migrate``
    run it, with connections to both aliases.
    """
    mapping = getattr(settings, "IDEMPOTENCY", {})
    mapping = mapping.get("INTENT_DATABASES") if isinstance(mapping, Mapping) else None
    if not isinstance(mapping, Mapping):
        return []
    messages: list[CheckMessage] = []
    for records, intents in mapping.items():
        if records not in (databases or ()) or intents not in settings.DATABASES:
            continue
        if records == intents or records not in settings.DATABASES:
            continue
        reached = [_identity(alias) for alias in (records, intents)]
        if None in reached or reached[0] == reached[1]:
            continue
        messages.append(
            _error(
                32,
                f"IDEMPOTENCY['INTENT_DATABASES'] maps {records!r} to {intents!r}, but they "
                f"reach different databases ({reached[0]} and {reached[1]}).",
                "The intents of begin_external() must commit in the records' own table: "
                "point the intents' alias at the same database (a second pooler entry for "
                "it, say).",
            )
        )
    return messages


def _identity(alias: str) -> tuple[Any, ...] | None:
    """The database ``alias`` reaches, by its server's own account; None if it cannot tell."""
    from django.db import DatabaseError

    connection = connections.create_connection(alias)
    query = _IDENTITY.get(connection.vendor)
    if query is None:
        return None
    try:
        with connection.cursor() as cursor:
            cursor.execute(query)
            row = cursor.fetchone()
    except DatabaseError:
        return None  # unreachable, or pg_control_system() not allowed: no verdict
    finally:
        connection.close()
    return tuple(row) if row is not None else None


@register(Tags.compatibility)
def check_prometheus_directory(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W022: the Prometheus sink without (or with a missing) multiprocess directory."""
    sinks = getattr(settings, "IDEMPOTENCY", {}).get("METRICS", DEFAULTS["METRICS"])
    if "prometheus" not in ((sinks,) if isinstance(sinks, str) else sinks or ()):
        return []
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory and os.path.isdir(directory):
        return []
    problem = (
        "PROMETHEUS_MULTIPROC_DIR is not set"
        if not directory
        else f"PROMETHEUS_MULTIPROC_DIR names {directory!r}, which is not a directory"
    )
    return [
        Warning(
            f"IDEMPOTENCY['METRICS'] names 'prometheus', but {problem}: each process "
            "serves only its own counts, and a scrape reaches one gunicorn worker of several.",
            hint="Under gunicorn (or uWSGI) with several workers, set PROMETHEUS_MULTIPROC_DIR "
            "to a directory shared by every process before they start (docs/observability.md, "
            "Prometheus under gunicorn). A single process (runserver, one worker) needs "
            "none: silence this warning there.",
            id="django_idempotency.W022",
        )
    ]


@register(Tags.compatibility)
def check_celery_timeouts(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W020: a broker visibility timeout shorter than an idempotent task may run; W021:
    a task's time limit longer than its lease.

    Judged on Celery's current app (the project's, once its module is
    imported, as Django projects do in their package's ``__init__``) and the
    ``idempotent_task`` tasks imported by the time checks run (a task module
    that only workers import is judged by the worker instead: the first run
    of each task logs the same warnings). Silent without Celery.
    """
    try:
        from celery import current_app
    except ImportError:
        return []
    from django_idempotency._protection.task import (
        broker_visibility_timeout,
        idempotent_task_leases,
    )

    app: Any = current_app
    visibility = broker_visibility_timeout(app)
    leases = idempotent_task_leases()
    messages: list[CheckMessage] = []
    for name, task in sorted(app.tasks.items()):
        run = getattr(task.run, "__func__", task.run)
        if run not in leases:
            continue
        lease = leases[run] or idempotency_settings.LEASE
        limit = task.time_limit or app.conf.task_time_limit
        if limit is not None and timedelta(seconds=float(limit)) > lease:
            messages.append(
                Warning(
                    f"The idempotent task {name!r} may run for {float(limit):g}s (its time "
                    f"limit), longer than its lease ({lease.total_seconds():g}s): a "
                    "redelivery arriving after the lease takes over a body that is still "
                    "running.",
                    hint="Give idempotent_task(lease=...) at least the task's time_limit.",
                    obj=name,
                    id="django_idempotency.W021",
                )
            )
        longest = max(lease.total_seconds(), float(limit or 0))
        if visibility is not None and visibility < longest:
            messages.append(
                Warning(
                    "The broker delivers an unacknowledged message again after "
                    f"its visibility_timeout of {visibility:g}s, but the idempotent task "
                    f"{name!r} may run for {longest:g}s (its lease or time limit): a run "
                    "still going is delivered to a second worker, whose copy waits on "
                    "TaskInProgress retries, or takes the key over once the lease ran out.",
                    hint="Set CELERY_BROKER_TRANSPORT_OPTIONS = {'visibility_timeout': ...} "
                    "longer than every idempotent task's lease and time limit (Celery's "
                    "default is 3600 s on Redis).",
                    obj=name,
                    id="django_idempotency.W020",
                )
            )
    return messages
