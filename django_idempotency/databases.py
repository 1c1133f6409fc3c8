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

from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import router

from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpRequest

    from django_idempotency.scope import Scope

__all__ = [
    "UnknownRecordDatabase",
    "database_for",
    "record_databases",
    "records_database_named",
    "routed_record_databases",
]


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

    return router.db_for_write(
        IdempotencyRecord,
        tenant=scope.tenant,
        operation=scope.operation,
        request=request,
        **hints,
    )


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
    """
    from django_idempotency.models import IdempotencyRecord

    other_names = set(_intent_aliases())
    return [
        alias
        for alias, database in settings.DATABASES.items()
        if alias not in other_names
        and not (database.get("TEST") or {}).get("MIRROR")
        and router.allow_migrate_model(alias, IdempotencyRecord)
    ]


def _intent_aliases() -> list[str]:
    try:
        return [str(alias) for alias in idempotency_settings.INTENT_DATABASES.values()]
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
        raise UnknownRecordDatabase(
            f"{alias!r} holds no idempotency records; those that do: {', '.join(every) or 'none'}."
        )
    return [alias]
