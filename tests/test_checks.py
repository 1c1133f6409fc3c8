"""System checks: every invalid setting has a stable id."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.checks import CheckMessage
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.views import APIView

from django_idempotency import idempotent, recovery
from django_idempotency.checks import (
    check_atomic_requests,
    check_operations,
    check_optimistic_views,
    check_settings,
    check_tombstones,
)
from django_idempotency.drf import IdempotentMixin
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed
from tests.testapp.models import Charge


def ids(value: Any) -> list[str | None]:
    from django.test import override_settings

    with override_settings(IDEMPOTENCY=value):
        return [message.id for message in check_settings()]


def test_defaults_pass() -> None:
    assert ids({}) == []


def test_a_complete_valid_configuration_passes() -> None:
    assert (
        ids(
            {
                "HEADER": "Idempotency-Key",
                "REQUIRED": False,
                "KEY_MAX_LENGTH": 64,
                "TTL": timedelta(days=2),
                "LEASE": 30,
                "TENANT": "django_idempotency.scope.default_tenant",
                "DATABASE": "default",
                "IN_FLIGHT": "wait",
                "IN_FLIGHT_WAIT": 2.5,
                "FAIL_OPEN": True,
                "STORED_HEADERS": ["ETag", "X-Request-Cost"],
                "MAX_STORED_BODY": 0,
            }
        )
        == []
    )


@pytest.mark.parametrize(
    ("settings_value", "expected"),
    [
        ("not a dict", "E001"),
        ({"HEDAER": "x"}, "W001"),  # spellchecker:disable-line
        ({"HEADER": "Bad Header"}, "E002"),
        ({"HEADER": ""}, "E002"),
        ({"REQUIRED": "yes"}, "E003"),
        ({"KEY_MAX_LENGTH": 0}, "E004"),
        ({"KEY_MAX_LENGTH": 256}, "E004"),
        ({"KEY_MAX_LENGTH": True}, "E004"),
        ({"TTL": 0}, "E005"),
        ({"TTL": "1 day"}, "E005"),
        ({"LEASE": timedelta(seconds=-1)}, "E006"),
        ({"TENANT": "no.such.module.resolver"}, "E007"),
        ({"TENANT": 42}, "E007"),
        ({"DATABASE": "missing"}, "E008"),
        ({"IN_FLIGHT": "block"}, "E009"),
        ({"IN_FLIGHT_WAIT": -1}, "E010"),
        ({"FAIL_OPEN": 1}, "E011"),
        ({"STORED_HEADERS": "ETag"}, "E012"),
        ({"STORED_HEADERS": ["ok", "not ok"]}, "E012"),
        ({"MAX_STORED_BODY": -1}, "E013"),
        ({"TTL": 60, "LEASE": 120}, "E014"),
        ({"ERROR_FORMAT": "rfc7807"}, "E015"),
        ({"PROBLEM_TYPE_BASE": None}, "E016"),
        ({"REDACT": "no.such.hook"}, "E017"),
        ({"REDACT": 42}, "E017"),
        ({"OUTCOME": "no.such.policy"}, "E041"),
        ({"OUTCOME": "standard"}, "E041"),
        ({"ENCRYPTION_KEYS": "one-key"}, "E018"),
        ({"ENCRYPTION_KEYS": ["not a fernet key"]}, "E018"),
        ({"MAX_FINGERPRINTED_BODY": 0}, "E019"),
        # Gone with the single-transaction mode: an unknown key now (E020 is retired).
        ({"SINGLE_TRANSACTION": True}, "W001"),
        ({"OPERATION_NAMES": "route-name"}, "E022"),
        ({"OPERATION_NAMES": None}, "E022"),
        ({"INTENT_DATABASES": "default"}, "E030"),
        ({"INTENT_DATABASES": {"default": 1}}, "E030"),
        ({"INTENT_DATABASES": {"default": "missing"}}, "E031"),
        ({"INTENT_DATABASES": {"missing": "default"}}, "E031"),
    ],
)
def test_invalid_value_is_reported_with_its_id(settings_value: Any, expected: str) -> None:
    assert ids(settings_value) == [f"django_idempotency.{expected}"]


@pytest.mark.parametrize(
    ("settings_value", "expected"),
    [
        ("not a dict", "E001"),
        ({"METRICS": 5}, "E037"),
        ({"METRICS": True}, "E037"),
    ],
)
def test_an_invalid_setting_is_reported_by_the_registered_checks_without_a_crash(
    settings_value: Any, expected: str
) -> None:
    """What ``manage.py check`` runs: every check registered with the settings' tag.

    (The warnings about Celery tasks other tests registered name their task.)
    """
    from django.core.checks import run_checks
    from django.test import override_settings

    with override_settings(IDEMPOTENCY=settings_value):
        messages = run_checks(tags=["compatibility"])
    # The demo app's reconcilers make W023 ask for a decision on TOMBSTONE_TTL.
    about_settings = [m for m in messages if m.obj is None and m.id != "django_idempotency.W023"]
    assert [m.id for m in about_settings if str(m.id).startswith("django_idempotency.")] == [
        f"django_idempotency.{expected}"
    ]


def test_every_check_is_registered_with_its_tag() -> None:
    from django.core.checks import registry

    from django_idempotency import checks

    tags = {
        "check_settings": "compatibility",
        "check_prometheus_directory": "compatibility",
        "check_celery_timeouts": "compatibility",
        "check_atomic_requests": "urls",
        "check_optimistic_views": "urls",
        "check_operations": "urls",
        "check_intent_databases_reach_the_records": "database",
        "check_tombstones": "compatibility",
        "check_middleware": "compatibility",
    }
    assert set(tags) == set(checks.__all__)
    registered = registry.registry.registered_checks | registry.registry.deployment_checks
    for name, tag in tags.items():
        check = getattr(checks, name)
        assert check in registered
        assert tag in getattr(check, "tags", ())


def test_the_missing_prometheus_directory_is_a_deployment_check_only(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W022 printed on every command that runs the checks (cron's recover each
    minute, migrate) where no directory is needed: a single process, or a
    command. It matters where several workers serve: ``check --deploy``.
    """
    from django.core.checks import run_checks

    settings.IDEMPOTENCY = {"METRICS": ("prometheus",)}
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)

    every_command = [m.id for m in run_checks()]
    deploying = [m.id for m in run_checks(include_deployment_checks=True)]

    assert "django_idempotency.W022" not in every_command
    assert "django_idempotency.W022" in deploying


def test_each_declared_setting_is_checked_by_one_validator() -> None:
    from django_idempotency._middleware import checks as middleware
    from django_idempotency._observability import checks as observability
    from django_idempotency._protection import checks as protection
    from django_idempotency._store import checks as store
    from django_idempotency.conf import SETTINGS

    own = [
        *protection.VALIDATORS,
        *store.VALIDATORS,
        *observability.VALIDATORS,
        *middleware.VALIDATORS,
    ]
    assert len(own) == len(set(own))
    assert set(own) == {setting.name for setting in SETTINGS if setting.kind is None}


def test_a_setting_removed_before_the_first_release_says_so_and_what_to_do() -> None:
    from django.test import override_settings

    misspelt = "HEDAER"  # spellchecker:disable-line
    with override_settings(IDEMPOTENCY={"SINGLE_TRANSACTION": True, misspelt: "x"}):
        hints = {message.msg: message.hint or "" for message in check_settings()}

    removed = hints["IDEMPOTENCY['SINGLE_TRANSACTION'] is not a setting of django-idempotency."]
    assert "removed in 1.0.0rc1" in removed and "optimistic=True" in removed
    assert "spelling" not in removed
    assert "spelling" in hints[f"IDEMPOTENCY[{misspelt!r}] is not a setting of django-idempotency."]


def test_every_error_carries_a_hint() -> None:
    from django.test import override_settings

    with override_settings(IDEMPOTENCY={"HEADER": 1, "TTL": -1, "IN_FLIGHT": "?"}):
        messages = check_settings()
    assert len(messages) == 3
    assert all(message.hint for message in messages)


# Django 6.1's check command also runs database checks, on every alias.
@pytest.mark.django_db(databases="__all__")
def test_checks_run_with_django_check_command(settings: Any) -> None:
    settings.IDEMPOTENCY = {"IN_FLIGHT": "sometimes"}
    with pytest.raises(SystemCheckError, match=r"django_idempotency\.E009"):
        call_command("check")


def test_api_view_under_atomic_requests_is_warned_about(atomic_requests: None) -> None:
    warnings = check_atomic_requests()
    flagged = sorted(str(message.msg).split("'")[1] for message in warnings)

    assert {message.id for message in warnings} == {"django_idempotency.W002"}
    # The exempted @api_view and the class-based views are not flagged; a
    # class overriding dispatch() loses the exemption and is. adrf's
    # @api_view is no more exempt than DRF's (Django refuses it then).
    assert flagged == [
        "adrf/function",
        "api-view/by-ref/<uuid:ref>",
        "api-view/charges",
        "api-view/external",
        "api-view/fields",
        "api-view/optimistic",
        "api-view/optional",
        "api-view/probe",
        "api-view/provider-charge",
        "api-view/steps",
        "cbv/own-dispatch",
        "keyed/body-digest",
        "keyed/body-field",
        "keyed/body-field-standard",
        "keyed/delivery-header",
        "optimistic/notes",
        "optimistic/orders",
        "optimistic/orders-default",
        "parsed/upload",
        "policy/by-status",
    ]


def test_atomic_requests_warning_names_the_view_and_the_uncommitted_intent(
    atomic_requests: None,
) -> None:
    by_route = {str(message.msg).split("'")[1]: message for message in check_atomic_requests()}
    function_view, class_view = by_route["api-view/external"], by_route["cbv/own-dispatch"]

    assert function_view.obj == "tests.testapp.views.api_view_external_call"
    assert class_view.obj == "tests.testapp.views.OwnDispatchView"
    assert "The view tests.testapp.views.OwnDispatchView at 'cbv/own-dispatch'" in class_view.msg
    assert "begin_external() no longer commits the intent before the external call" in (
        class_view.msg
    )
    assert "<locals>" not in str(class_view) + str(function_view)


def test_no_atomic_requests_no_warning() -> None:
    assert check_atomic_requests() == []


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_sqlite_without_immediate_transactions_is_warned_about(settings: Any) -> None:
    settings.DATABASES = {
        **settings.DATABASES,
        "deferred": {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.sqlite3"},
        "immediate": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": "y.sqlite3",
            "OPTIONS": {"transaction_mode": "IMMEDIATE"},
        },
    }
    assert ids({"DATABASE": "deferred"}) == ["django_idempotency.W003"]
    assert ids({"DATABASE": "immediate"}) == []


# -- reconcilers and operation names (W004, W005, W006) --------------------------------


@pytest.fixture
def reconcilers(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Register reconcilers for these operation names alone, for one test.

    The registry is emptied first: the demo app's reconciler for
    ``POST v1/payments`` has no operation in the suite's URLconf.
    """
    monkeypatch.setattr(recovery, "_reconcilers", {})

    def register(*operations: str) -> None:
        for operation in operations:

            def settle(record: IdempotencyRecord) -> Completed:
                return Completed(status=200)

            recovery.register_reconciler(operation)(settle)

    return register


@pytest.mark.parametrize("idempotency", [{}, {"TTL": 3600, "LEASE": 60}])
def test_reconcilers_without_a_decision_on_tombstones_are_warned_about(
    reconcilers: Callable[..., None], idempotency: dict[str, Any], settings: Any
) -> None:
    """A project that calls providers runs a late retry again once its record is purged."""
    settings.IDEMPOTENCY = idempotency
    reconcilers("POST api-view/external", "task tests.payout")

    [warning] = check_tombstones()

    assert warning.id == "django_idempotency.W023"
    assert "2 operations" in str(warning.msg) and "runs it again" in str(warning.msg)
    assert "TOMBSTONE_TTL" in str(warning.hint) and " bytes " in str(warning.hint)


@pytest.mark.parametrize(
    "idempotency",
    [
        {"TOMBSTONE_TTL": timedelta(days=30)},
        {"TOMBSTONE_TTL": None},  # decided: no tombstones
        {"TOMBSTONE_TTL": "a month"},  # E035 speaks
        "not a dict",  # E001 speaks
    ],
)
def test_a_decision_on_tombstones_silences_the_warning(
    reconcilers: Callable[..., None], idempotency: Any, settings: Any
) -> None:
    settings.IDEMPOTENCY = idempotency
    reconcilers("POST api-view/external")

    assert check_tombstones() == []


def test_without_reconcilers_tombstones_are_not_asked_about(
    reconcilers: Callable[..., None], settings: Any
) -> None:
    settings.IDEMPOTENCY = {}
    reconcilers()

    assert check_tombstones() == []


# Django 6.1's check command also runs database checks, on every alias.
@pytest.mark.django_db(databases="__all__")
def test_manage_py_check_asks_about_tombstones(
    reconcilers: Callable[..., None], settings: Any
) -> None:
    settings.IDEMPOTENCY = {}
    reconcilers("POST api-view/external")
    output = StringIO()

    call_command("check", stdout=output, stderr=output)

    assert "django_idempotency.W023" in output.getvalue()


def warnings_of(check: Callable[[], list[CheckMessage]]) -> list[tuple[str, str, str]]:
    return [(str(m.id), str(m.msg), str(m.hint)) for m in check()]


@pytest.mark.urls("tests.testapp.operation_urls")
def test_a_reconciler_for_no_protected_operation_is_warned_about(
    reconcilers: Callable[..., None],
) -> None:
    reconcilers("POST api/order")

    [(id_, message, hint)] = warnings_of(check_operations)

    assert id_ == "django_idempotency.W004"
    assert "registered for 'POST api/order'" in message
    assert "never called" in message
    assert "'POST api/orders'" in hint  # the closest real operation


@pytest.mark.urls("tests.testapp.operation_urls")
def test_the_warning_names_the_reconciler_function(reconcilers: Callable[..., None]) -> None:
    reconcilers("PATCH orders/{pk}")

    [warning] = check_operations()

    assert warning.obj == "tests.test_checks.reconcilers.<locals>.register.<locals>.settle"


@pytest.mark.urls("tests.testapp.operation_urls")
@pytest.mark.parametrize(
    ("style", "operations"),
    [
        ("pattern", ["PATCH api/orders/(?P<pk>[^/.]+)", "POST api/orders/(?P<pk>[^/.]+)/pay"]),
        ("normalised", ["PATCH api/orders/{pk}", "DELETE tenant/{tenant}/plain/{pk}"]),
        ("route_name", ["PATCH orders-detail", "PATCH tenant:v2:orders-detail"]),
    ],
)
def test_reconcilers_of_protected_operations_pass(
    settings: Any, reconcilers: Callable[..., None], style: str, operations: list[str]
) -> None:
    settings.IDEMPOTENCY = {"OPERATION_NAMES": style}
    reconcilers(*operations, "POST nowhere")

    # Only the reconciler of no operation is reported.
    assert [(m.id, m.msg.split("'")[1]) for m in check_operations()] == [
        ("django_idempotency.W004", "POST nowhere")
    ]


def test_a_reconciler_for_an_explicit_operation_passes(reconcilers: Callable[..., None]) -> None:
    reconcilers("charge-by-fields", "mixin-selected", "POST api-view/external", "POST nowhere")

    assert [(m.id, m.msg.split("'")[1]) for m in check_operations()] == [
        ("django_idempotency.W004", "POST nowhere")
    ]


@pytest.mark.urls("tests.testapp.operation_urls")
@pytest.mark.parametrize(
    ("style", "registered", "current"),
    [
        ("normalised", "PATCH api/orders/(?P<pk>[^/.]+)", "PATCH api/orders/{pk}"),
        ("route_name", "PATCH api/orders/(?P<pk>[^/.]+)", "PATCH orders-detail"),
        ("pattern", "PATCH orders-detail", "PATCH api/orders/(?P<pk>[^/.]+)"),
    ],
)
def test_a_reconciler_under_another_styles_name_is_warned_about(
    settings: Any, reconcilers: Callable[..., None], style: str, registered: str, current: str
) -> None:
    settings.IDEMPOTENCY = {"OPERATION_NAMES": style}
    reconcilers(registered)

    [(id_, message, hint)] = warnings_of(check_operations)

    assert id_ == "django_idempotency.W005"
    assert f"not under the current {style!r}" in message
    assert repr(current) in hint
    assert "keep the old registration until no unresolved record" in hint


@pytest.mark.urls("tests.testapp.operation_urls")
def test_a_reconciler_for_a_task_is_not_judged_against_the_urlconf(
    reconcilers: Callable[..., None],
) -> None:
    """A task's records reach their reconciler (after begin_external()); no URL names them."""
    reconcilers("task shop.tasks.ship_order", "POST nowhere")

    assert [(m.id, m.msg.split("'")[1]) for m in check_operations()] == [
        ("django_idempotency.W004", "POST nowhere")
    ]


def test_a_callable_operation_keeps_any_reconciler_from_being_judged(
    settings: Any, reconcilers: Callable[..., None]
) -> None:
    reconcilers("answer for acme")

    settings.ROOT_URLCONF = "tests.testapp.operation_urls"
    assert [message.id for message in check_operations()] == ["django_idempotency.W004"]
    # A callable may give its records any name, this one included.
    settings.ROOT_URLCONF = "tests.testapp.dynamic_operation_urls"
    assert check_operations() == []


@pytest.mark.urls("tests.testapp.shared_name_urls")
def test_two_views_sharing_a_route_name_are_warned_about(
    settings: Any, reconcilers: Callable[..., None]
) -> None:
    assert check_operations() == []  # their patterns differ

    settings.IDEMPOTENCY = {"OPERATION_NAMES": "route_name"}
    [(id_, message, _)] = [
        warning for warning in warnings_of(check_operations) if "'POST answers'" in warning[1]
    ]

    assert id_ == "django_idempotency.W006"
    assert "tests.testapp.operation_urls.AnswerView (post)" in message
    assert "tests.testapp.operation_urls.api_view_answer (post)" in message


# Django 6.1's check command also runs database checks, on every alias.
@pytest.mark.django_db(databases="__all__")
@pytest.mark.urls("tests.testapp.operation_urls")
def test_manage_py_check_reports_a_reconciler_without_an_operation(
    reconcilers: Callable[..., None],
) -> None:
    reconcilers("PATCH api/order/(?P<pk>[^/.]+)")
    output = StringIO()

    call_command("check", stdout=output, stderr=output)

    assert "django_idempotency.W004" in output.getvalue()
    assert "'PATCH api/orders/(?P<pk>[^/.]+)'" in output.getvalue()


def test_a_project_without_urls_is_not_judged(
    settings: Any, reconcilers: Callable[..., None], atomic_requests: None
) -> None:
    reconcilers("POST nowhere")
    assert [message.id for message in check_operations()] == ["django_idempotency.W004"]

    del settings.ROOT_URLCONF  # a Celery worker's settings, say

    assert check_operations() == []
    assert check_atomic_requests() == []


@pytest.mark.urls("tests.testapp.operation_urls")
def test_a_name_shared_by_two_other_styles_is_said_to_be_both(
    settings: Any, reconcilers: Callable[..., None]
) -> None:
    # A route without arguments: its pattern name is its normalised name too.
    settings.IDEMPOTENCY = {"OPERATION_NAMES": "route_name"}
    reconcilers("POST api/orders")

    [(id_, message, hint)] = warnings_of(check_operations)

    assert id_ == "django_idempotency.W005"
    assert "OPERATION_NAMES'] = 'pattern' and 'normalised', not under" in message
    assert "'POST orders-list'" in hint


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_mysql_records_with_naive_times_are_warned_about(settings: Any) -> None:
    mysql = {"ENGINE": "django.db.backends.mysql", "NAME": "records"}
    settings.DATABASES = {**settings.DATABASES, "mysql": mysql}
    settings.USE_TZ = False
    settings.TIME_ZONE = "America/New_York"
    assert ids({"DATABASE": "mysql"}) == ["django_idempotency.W007"]
    settings.TIME_ZONE = "UTC"  # naive UTC: UTC_TIMESTAMP(6) is right
    assert ids({"DATABASE": "mysql"}) == []
    settings.USE_TZ = True
    assert ids({"DATABASE": "mysql"}) == []
    settings.DATABASES = {
        **settings.DATABASES,
        "mysql": {**mysql, "TIME_ZONE": "America/New_York"},
    }
    assert ids({"DATABASE": "mysql"}) == ["django_idempotency.W007"]


# -- INTENT_DATABASES (E030 to E033, W010) ----------------------------------------------


def _alias_like_default(**changes: Any) -> dict[str, Any]:
    from copy import deepcopy

    from django.db import connections

    return {**deepcopy(connections["default"].settings_dict), **changes}


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_intent_databases_on_another_engine_or_on_sqlite(settings: Any) -> None:
    engine = settings.DATABASES["default"]["ENGINE"]
    other = next(
        name
        for name in ("django.db.backends.postgresql", "django.db.backends.mysql")
        if name != engine
    )
    settings.DATABASES = {
        **settings.DATABASES,
        "elsewhere": _alias_like_default(ENGINE=other),
        "same": _alias_like_default(),
    }
    assert ids({"INTENT_DATABASES": {"default": "elsewhere"}}) == ["django_idempotency.E033"]
    expected = ["django_idempotency.W010"] if engine.endswith("sqlite3") else []
    assert ids({"INTENT_DATABASES": {"default": "same"}}) == expected


@pytest.mark.postgres
@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_an_intents_alias_reaching_another_database_is_an_error(
    settings: Any, monkeypatch: pytest.MonkeyPatch, django_db_blocker: Any
) -> None:
    """E032 asks both servers which database they are: names alone prove nothing (PgBouncer)."""
    from django.db import connection, connections

    from django_idempotency.checks import check_intent_databases_reach_the_records

    if connection.vendor != "postgresql":
        pytest.skip("asks PostgreSQL which database a connection reached")
    # Databases every server has, so that no test database is needed.
    aliases = {
        "records": _alias_like_default(NAME="postgres"),
        "same": _alias_like_default(NAME="postgres"),
        "elsewhere": _alias_like_default(NAME="template1"),
    }
    for alias, values in aliases.items():
        monkeypatch.setitem(connections.settings, alias, values)
    settings.DATABASES = {**settings.DATABASES, **aliases}

    def check(intents: str, databases: list[str]) -> list[str | None]:
        settings.IDEMPOTENCY = {"INTENT_DATABASES": {"records": intents}}
        with django_db_blocker.unblock():
            messages = check_intent_databases_reach_the_records(databases=databases)
        return [message.id for message in messages]

    assert check("same", ["records"]) == []
    assert check("elsewhere", ["records"]) == ["django_idempotency.E032"]
    # Only for the databases asked about (``check --database``, ``migrate``).
    assert check("elsewhere", ["default"]) == []


# Check E036 on optimistic handlers whose own code calls out.
#
# This module is its own URLconf: every view here calls ``begin_external()``
# (or its async form) in its own code, so E036 must name each one, and none
# of the views that stay in the database.


@csrf_exempt
@idempotent(optimistic=True)
def plain_django_view(request: HttpRequest) -> JsonResponse:
    key = request.idempotency.begin_external()  # type: ignore[attr-defined]
    return JsonResponse({"key": key}, status=201)


@idempotent(optimistic=True)
async def async_view(request: HttpRequest) -> JsonResponse:
    key = await request.idempotency.abegin_external()  # type: ignore[attr-defined]
    return JsonResponse({"key": key}, status=201)


class MixinView(IdempotentMixin, APIView):
    idempotency_optimistic = True

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.idempotency.begin_external()  # type: ignore[attr-defined]
        return Response({"key": key}, status=201)


class MixinViewSet(IdempotentMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    idempotency_optimistic = True
    queryset = Charge.objects.all()

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        key = request.idempotency.begin_external()  # type: ignore[attr-defined]
        return Response({"key": key}, status=201)


class QuietView(IdempotentMixin, APIView):
    idempotency_optimistic = True

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return Response(status=201)


router = SimpleRouter()
router.register("viewset", MixinViewSet, basename="calls-out-viewset")

urlpatterns = [
    path("plain", plain_django_view),
    path("async", async_view),
    path("mixin", MixinView.as_view()),
    path("quiet", QuietView.as_view()),
    *router.urls,
]


def _named() -> set[str]:
    return {message.msg.split(" at ")[0] for message in check_optimistic_views()}


@pytest.mark.urls(__name__)
@pytest.mark.parametrize(
    "view",
    [
        f"The view {__name__}.plain_django_view",
        f"The view {__name__}.async_view",
        f"The view {__name__}.MixinView (post)",
        f"The view {__name__}.MixinViewSet (create)",
    ],
)
def test_e036_names_every_optimistic_handler_that_calls_out(view: str) -> None:
    named = _named()
    assert any(name.startswith(view) for name in named), named
    assert not any("QuietView" in name for name in named), named
