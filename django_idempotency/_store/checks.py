"""System checks of the store's settings: where the records live and how they are sealed.

``DATABASE`` and the routers (E008, E023), the record databases' SQLite
transaction mode (W003) and MySQL clock (W007), ``INTENT_DATABASES``
(E030, E031, E033, W010, and the database check E032), the encryption and
digest keys (E018, E021), ``REDACT`` (E017) and ``TOMBSTONE_TTL`` (E035,
and W023 with the reconcilers). Registered by ``django_idempotency.checks``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Warning
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.utils import load_backend

from django_idempotency._checks import ConfigurationCheck, Validator, error, positive_duration
from django_idempotency._store.routing import routed_record_databases
from django_idempotency.conf import DEFAULTS, import_callable


def _check_database(value: Any) -> Iterator[CheckMessage]:
    if value is None:
        # The routers choose per request: they must let the records migrate somewhere.
        if not routed_record_databases():
            yield error(
                23,
                "IDEMPOTENCY['DATABASE'] is None, but no database router lets "
                "IdempotencyRecord migrate to any alias in DATABASES: no database "
                "holds the records.",
                "Let allow_migrate() return True for app_label 'django_idempotency' on every "
                "alias db_for_write() may return for it (each shard), and False on replicas.",
            )
        return
    if not isinstance(value, str) or value not in settings.DATABASES:
        yield error(
            8,
            f"IDEMPOTENCY['DATABASE'] = {value!r} is not an alias in DATABASES.",
            f"Use one of: {', '.join(sorted(settings.DATABASES))}, or None to let the "
            "database routers choose per request.",
        )


def _check_redact(value: Any) -> Iterator[CheckMessage]:
    if value is None:
        return
    if isinstance(value, str):
        try:
            import_callable(value, "REDACT")
        except ImproperlyConfigured as exc:
            yield error(17, str(exc), "Give a callable (or its dotted path), or None.")
    elif not callable(value):
        yield error(
            17,
            f"IDEMPOTENCY['REDACT'] = {value!r} is not callable.",
            "Give a callable taking the StoredResponse to store and returning what to keep.",
        )


def _check_encryption_keys(value: Any) -> Iterator[CheckMessage]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        yield error(
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
        yield error(
            18,
            "IDEMPOTENCY['ENCRYPTION_KEYS'] is set but cryptography is not installed.",
            'pip install "django-idempotency[encryption]"',
        )
        return
    for index, key in enumerate(value):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            yield error(
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
        yield error(
            21,
            f"IDEMPOTENCY['DIGEST_KEYS']{problem}",
            "Give [(version, secret), ...], newest first: a version of up to 16 letters, "
            "digits, '_', '.' or '-' that never changes for its secret, and a random "
            "secret of at least 32 characters. Keep a replaced secret listed for TTL. "
            "Or leave DIGEST_KEYS unset to derive it from SECRET_KEY.",
        )


def _check_intent_databases(value: Any) -> Iterator[CheckMessage]:
    if not isinstance(value, Mapping) or not all(
        isinstance(records, str) and isinstance(intents, str) for records, intents in value.items()
    ):
        yield error(
            30,
            f"IDEMPOTENCY['INTENT_DATABASES'] = {value!r} is not a dict of database aliases.",
            "Map the alias of the records to the alias whose connections write the intents "
            "of begin_external(), e.g. {'default': 'intents'}; {} for none.",
        )
        return
    for records, intents in value.items():
        unknown = [alias for alias in (records, intents) if alias not in settings.DATABASES]
        if unknown:
            yield error(
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
        yield error(
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
    if value is not None and not positive_duration(value):
        yield error(
            35,
            f"IDEMPOTENCY['TOMBSTONE_TTL'] = {value!r} is neither None nor a positive duration.",
            "Give how long a late retry is refused after retention, as a datetime.timedelta "
            "or a number of seconds greater than zero; None keeps no tombstones.",
        )


VALIDATORS: Mapping[str, Validator] = {
    "DATABASE": _check_database,
    "REDACT": _check_redact,
    "ENCRYPTION_KEYS": _check_encryption_keys,
    "DIGEST_KEYS": _check_digest_keys,
    "INTENT_DATABASES": _check_intent_databases,
    "TOMBSTONE_TTL": _check_tombstone_ttl,
}


def _check_record_databases(user_settings: Mapping[str, Any]) -> Iterator[CheckMessage]:
    configured = user_settings.get("DATABASE", DEFAULTS["DATABASE"])
    for alias in routed_record_databases() if configured is None else [configured]:
        yield from _check_sqlite_transaction_mode(alias)
        yield from _check_database_clock(alias)


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


CONFIGURATION_CHECKS: tuple[ConfigurationCheck, ...] = (_check_record_databases,)

#: What a tombstone keeps on PostgreSQL, heap and indexes, measured by
#: benchmarks/tombstone_size.py: 846 bytes for a payment's record (one
#: provider call and its id); docs/ttl-and-lease.md gives the other figures.
TOMBSTONE_BYTES = 850


def check_late_retries(
    user_settings: Mapping[str, Any], reconciled: Sequence[str]
) -> Iterator[CheckMessage]:
    """W023: operations that call providers, and no decision on ``TOMBSTONE_TTL``.

    ``reconciled``: the operations with a reconciler, which is how a project
    says it calls providers. Keeping tombstones is a storage decision, so it
    stays off by default; left unset, it is asked for once, and an explicit
    ``None`` is the answer "no tombstones".
    """
    if not reconciled or "TOMBSTONE_TTL" in user_settings:
        return
    operations = "1 operation" if len(reconciled) == 1 else f"{len(reconciled)} operations"
    yield Warning(
        f"Reconcilers are registered for {operations} (the project calls "
        "providers), but IDEMPOTENCY['TOMBSTONE_TTL'] is not set: once a record's "
        "retention (TTL) has ended and the purge deleted it, a late retry of the same key "
        "and body runs it again (a second payment).",
        hint="Set IDEMPOTENCY['TOMBSTONE_TTL'] (timedelta(days=30), say) to refuse such "
        "retries with 422 idempotency_key_expired for that long; each tombstone keeps about "
        f"{TOMBSTONE_BYTES} bytes on PostgreSQL. Or set it to None to keep none (a late "
        "retry then runs again): see the settings reference, TOMBSTONE_TTL.",
        id="django_idempotency.W023",
    )


#: The database a connection reached, as its server tells: the same answer
#: through a pooler's database entry as directly.
_IDENTITY = {
    "postgresql": "SELECT current_database(), (SELECT system_identifier FROM pg_control_system())",
    "mysql": "SELECT DATABASE(), @@hostname, @@port",
}


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
            error(
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
