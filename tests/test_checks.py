"""System checks: every invalid setting has a stable id."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_idempotency.checks import check_atomic_requests, check_settings


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
        ({"ENCRYPTION_KEYS": "one-key"}, "E018"),
        ({"ENCRYPTION_KEYS": ["not a fernet key"]}, "E018"),
        ({"MAX_FINGERPRINTED_BODY": 0}, "E019"),
        ({"SINGLE_TRANSACTION": "yes"}, "E020"),
    ],
)
def test_invalid_value_is_reported_with_its_id(settings_value: Any, expected: str) -> None:
    assert ids(settings_value) == [f"django_idempotency.{expected}"]


def test_every_error_carries_a_hint() -> None:
    from django.test import override_settings

    with override_settings(IDEMPOTENCY={"HEADER": 1, "TTL": -1, "IN_FLIGHT": "?"}):
        messages = check_settings()
    assert len(messages) == 3
    assert all(message.hint for message in messages)


@pytest.mark.django_db  # Django 6.1's check command also runs database checks
def test_checks_run_with_django_check_command(settings: Any) -> None:
    settings.IDEMPOTENCY = {"IN_FLIGHT": "sometimes"}
    with pytest.raises(SystemCheckError, match=r"django_idempotency\.E009"):
        call_command("check")


def test_api_view_under_atomic_requests_is_warned_about(atomic_requests: None) -> None:
    warnings = check_atomic_requests()
    flagged = sorted(str(message.msg).split("'")[1] for message in warnings)

    assert {message.id for message in warnings} == {"django_idempotency.W002"}
    # The exempted @api_view and the class-based views are not flagged; a
    # class overriding dispatch() loses the exemption and is.
    assert flagged == [
        "api-view/by-ref/<uuid:ref>",
        "api-view/charges",
        "api-view/external",
        "api-view/fields",
        "api-view/optional",
        "api-view/probe",
        "api-view/single",
        "cbv/own-dispatch",
    ]


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
