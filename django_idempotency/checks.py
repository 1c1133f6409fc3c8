"""System checks for ``settings.IDEMPOTENCY`` and the protected views: one stable id per problem.

Each check lives beside what it guards (``_store/checks.py``,
``_protection/checks.py``, ``_observability/checks.py``,
``_middleware/checks.py``, ``_view_checks.py``); this module registers them (``apps.ready`` imports
it) and checks what every setting shares: that ``IDEMPOTENCY`` is a dict
(E001) of known keys (W001), and the booleans and durations, from their
declarations in ``conf.py``.

Ids are never reused. Retired ids stay listed here as comments.
"""

# Retired ids:
# E020: IDEMPOTENCY["SINGLE_TRANSACTION"] was not a boolean (the setting went
#       with the single-transaction mode).

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register

from django_idempotency import _view_checks
from django_idempotency._checks import Validator, error, positive_duration
from django_idempotency._middleware import checks as middleware
from django_idempotency._observability import checks as observability
from django_idempotency._protection import checks as protection
from django_idempotency._store import checks as store
from django_idempotency.conf import SETTINGS, Setting

__all__ = [
    "check_atomic_requests",
    "check_celery_timeouts",
    "check_intent_databases_reach_the_records",
    "check_middleware",
    "check_operations",
    "check_optimistic_views",
    "check_prometheus_directory",
    "check_settings",
    "check_tombstones",
]


def _check_boolean(setting: Setting[Any], value: Any) -> Iterator[CheckMessage]:
    if not isinstance(value, bool):
        yield error(
            int(setting.checks[0][1:]),
            f"IDEMPOTENCY[{setting.name!r}] = {value!r} is not a boolean.",
            f"Set IDEMPOTENCY[{setting.name!r}] to True or False.",
        )


def _check_duration(setting: Setting[Any], value: Any) -> Iterator[CheckMessage]:
    if not positive_duration(value):
        yield error(
            int(setting.checks[0][1:]),
            f"IDEMPOTENCY[{setting.name!r}] = {value!r} is not a positive duration.",
            "Give a datetime.timedelta or a number of seconds greater than zero.",
        )


_VALIDATORS: Mapping[str, Validator] = {
    **protection.VALIDATORS,
    **store.VALIDATORS,
    **observability.VALIDATORS,
    **middleware.VALIDATORS,
}
_BY_KIND = {"boolean": _check_boolean, "duration": _check_duration}


def _validate(setting: Setting[Any], value: Any) -> Iterator[CheckMessage]:
    if setting.kind is not None:
        return _BY_KIND[setting.kind](setting, value)
    return _VALIDATORS[setting.name](value)


#: Settings of the development snapshots that are gone, and what to do instead.
REMOVED_SETTINGS = {
    "SINGLE_TRANSACTION": (
        "It was removed in 1.0.0rc1 with the single-transaction mode: remove the key. "
        "The default mode runs the view once per key; optimistic=True writes one row, "
        "in the view's own transaction."
    ),
}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    user_settings = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user_settings, Mapping):
        return [
            error(
                1,
                f"IDEMPOTENCY must be a dict, not {type(user_settings).__name__}.",
                "Set IDEMPOTENCY = {...} with the keys listed in the settings reference.",
            )
        ]
    known = [setting.name for setting in SETTINGS]
    messages: list[CheckMessage] = [
        Warning(
            f"IDEMPOTENCY[{name!r}] is not a setting of django-idempotency.",
            hint=REMOVED_SETTINGS.get(
                name, f"Known settings: {', '.join(known)}. Check the spelling."
            ),
            id="django_idempotency.W001",
        )
        for name in sorted(set(user_settings) - set(known))
    ]
    for setting in SETTINGS:
        messages.extend(_validate(setting, user_settings.get(setting.name, setting.default)))
    across = chain(protection.CONFIGURATION_CHECKS, store.CONFIGURATION_CHECKS)
    for check in across:
        messages.extend(check(user_settings))
    return messages


check_atomic_requests = register(Tags.urls)(_view_checks.check_atomic_requests)
check_optimistic_views = register(Tags.urls)(_view_checks.check_optimistic_views)
check_operations = register(Tags.urls)(_view_checks.check_operations)
check_intent_databases_reach_the_records = register(Tags.database)(
    store.check_intent_databases_reach_the_records
)
# Only where several processes serve, which runserver, migrate and cron's
# commands are not: Django's deployment checks (``check --deploy``).
check_prometheus_directory = register(Tags.compatibility, deploy=True)(
    observability.check_prometheus_directory
)


@register(Tags.compatibility)
def check_tombstones(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W023: reconcilers are registered (the project calls providers), TOMBSTONE_TTL unset."""
    # Reconcilers are registered in AppConfig.ready(): all of them by now.
    from django_idempotency.recovery import registered_operations

    user_settings = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user_settings, Mapping):
        return []  # E001's to report
    return list(store.check_late_retries(user_settings, registered_operations()))


check_celery_timeouts = register(Tags.compatibility)(protection.check_celery_timeouts)
check_middleware = register(Tags.compatibility)(middleware.check_middleware)
