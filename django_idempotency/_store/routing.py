"""Which database holds a record: one alias, or the tenant's, from the routers.

``IDEMPOTENCY["DATABASE"]`` names one alias (``"default"`` unless set), or
is ``None``: then the routers pick the alias per request, given the scope as
hints, so that the records live with the tenant's own rows (a shard per
tenant). The routers are asked once per request, and that alias then serves
the claim, the view's transaction and the completion: a record is read and
written only where it was first written. Everything that walks all records
(recovery, the purge, key rotation, the admin) walks ``record_databases()``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import DatabaseError, router

from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpRequest

    from django_idempotency.scope import Scope


logger = logging.getLogger("django_idempotency")


class UnknownRecordDatabase(ValueError):
    """An alias was asked for that holds no idempotency records."""


def database_for(scope: Scope, *, request: HttpRequest | None = None, **hints: Any) -> str:
    """The alias holding ``scope``'s record: ``DATABASE``, or the routers' choice.

    With ``DATABASE = None`` this calls ``router.db_for_write(IdempotencyRecord,
    tenant=..., operation=..., request=..., **hints)``: call it once per
    request or task, and use its answer for every write of that run.
    """
    configured = idempotency_settings.DATABASE
    if configured is not None:
        return configured
    from django_idempotency.models import IdempotencyRecord

    alias = router.db_for_write(
        IdempotencyRecord,
        tenant=scope.tenant,
        operation=scope.operation,
        request=request,
        **hints,
    )
    if alias not in routed_record_databases():
        # Else a raw "relation does not exist" (or records nobody sweeps).
        raise ImproperlyConfigured(
            f"The routers put the idempotency record of tenant {scope.tenant!r} in "
            f"{alias!r}, where they do not let IdempotencyRecord migrate "
            f"(allow_migrate), so recovery and the purge would never see it. The databases "
            f"that hold records: {', '.join(routed_record_databases()) or 'none'}."
        )
    return alias


def record_databases() -> list[str]:
    """The aliases that hold records, in ``DATABASES`` order.

    ``[DATABASE]`` when it is set; with ``DATABASE = None``, every alias the
    routers let ``IdempotencyRecord`` migrate to
    (``router.allow_migrate_model``).
    """
    configured = idempotency_settings.DATABASE
    return [configured] if configured is not None else routed_record_databases()


def routed_record_databases() -> list[str]:
    """The aliases the routers let ``IdempotencyRecord`` migrate to.

    Less the aliases that are other names of a records database, which
    would be swept twice: the intents' pools (``INTENT_DATABASES``) and
    test mirrors (``TEST["MIRROR"]``). Many routers allow every migration.
    Asked once per value of the settings involved (every request checks
    its routed alias against it).
    """
    return list(_routed_record_databases())


@functools.cache
def _routed_record_databases() -> tuple[str, ...]:
    from django_idempotency.models import IdempotencyRecord

    other_names = set(_intent_aliases())
    return tuple(
        alias
        for alias, database in settings.DATABASES.items()
        if alias not in other_names
        and not (database.get("TEST") or {}).get("MIRROR")
        and router.allow_migrate_model(alias, IdempotencyRecord)
    )


def _forget_routed(*, setting: str, **kwargs: Any) -> None:
    if setting in {"DATABASES", "DATABASE_ROUTERS", "IDEMPOTENCY"}:
        _routed_record_databases.cache_clear()


setting_changed.connect(_forget_routed, dispatch_uid="django_idempotency._store.routing")


def _intent_aliases() -> list[str]:
    """The intents' aliases that are not records aliases themselves (``{"a": "a"}`` is none)."""
    try:
        intents = idempotency_settings.INTENT_DATABASES.items()
        return [str(target) for source, target in intents if target != source]
    except (TypeError, ValueError, AttributeError):  # not a mapping: check E030 says so
        return []


def records_database_named(alias: str | None) -> list[str]:
    """``[alias]`` if it holds records; ``None``: all of them (``--database`` of the commands).

    Raises:
        UnknownRecordDatabase: ``alias`` holds no records.
    """
    every = record_databases()
    if alias is None:
        return every
    if alias not in every:
        known = "" if alias in settings.DATABASES else " (it is not in DATABASES)"
        raise UnknownRecordDatabase(
            f"{alias!r} holds no idempotency records{known}; those that do: "
            f"{', '.join(every) or 'none'}."
        )
    return [alias]


def sweep(aliases: list[str], work: Callable[[str], object]) -> None:
    """``work(alias)`` on each records database; one that fails stops none of the others.

    A shard that is down (or was never migrated) must not keep recovery or
    the purge from the rest. Each failure is logged with its alias; once all
    were tried, the first is raised again, naming its database, so that the
    run still fails visibly (a command's exit status, a task's state).
    """
    failures: list[tuple[str, DatabaseError]] = []
    for alias in aliases:
        try:
            work(alias)
        except DatabaseError as exc:
            logger.exception("Records database %r failed; going on with the others.", alias)
            failures.append((alias, exc))
    if failures:
        alias, first = failures[0]
        failed = ", ".join(repr(name) for name, _ in failures)
        first.add_note(f"django-idempotency: records database {alias!r} failed ({failed} in all).")
        raise first
