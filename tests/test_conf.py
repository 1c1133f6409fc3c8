"""Resolved settings: kept between requests, dropped when IDEMPOTENCY changes."""

from __future__ import annotations

import importlib.util
import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings
from rest_framework.test import APIClient

from django_idempotency.conf import DEFAULTS, SETTINGS, idempotency_settings
from django_idempotency.models import IdempotencyRecord
from tests.utils import post


def test_resolved_values_follow_every_change_of_the_setting() -> None:
    before = (idempotency_settings.HEADER, idempotency_settings.TTL)
    assert "HEADER" in idempotency_settings.resolved  # kept once read

    changed = {**getattr(settings, "IDEMPOTENCY", {}), "HEADER": "X-Request-Key", "TTL": 90}
    with override_settings(IDEMPOTENCY=changed):
        during = (idempotency_settings.HEADER, idempotency_settings.TTL)
    after = (idempotency_settings.HEADER, idempotency_settings.TTL)

    assert during == ("X-Request-Key", timedelta(seconds=90))
    assert after == before


def test_a_resolved_dotted_path_is_imported_once() -> None:
    with override_settings(IDEMPOTENCY={"TENANT": "django_idempotency.scope.default_tenant"}):
        first = idempotency_settings.TENANT
        assert idempotency_settings.TENANT is first
        assert first.__name__ == "default_tenant"


def test_a_setting_read_on_the_class_is_its_descriptor() -> None:
    assert type(idempotency_settings).TTL.name == "TTL"


def test_the_settings_reference_is_the_one_the_declarations_give() -> None:
    script = Path(__file__).resolve().parent.parent / "scripts" / "settings_reference.py"
    spec = importlib.util.spec_from_file_location("settings_reference", script)
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    page = reference.PAGE.read_text()

    assert reference.page_with_reference(page) == page, "run `make settings-reference`"
    # And the comparison can fail: a changed declaration changes the page.
    HEADER = type(idempotency_settings).HEADER
    original = HEADER.doc
    HEADER.doc = "Another description."
    try:
        assert reference.page_with_reference(page) != page
    finally:
        HEADER.doc = original


def test_defaults_and_the_typed_settings_come_from_one_declaration_each() -> None:
    names = [setting.name for setting in SETTINGS]
    assert len(names) == len(set(names))
    assert dict(DEFAULTS) == {setting.name: setting.default for setting in SETTINGS}
    with override_settings(IDEMPOTENCY={}):
        for setting in SETTINGS:
            assert getattr(idempotency_settings, setting.name) == setting.normalise(setting.default)


def test_every_declared_setting_names_the_checks_that_report_it() -> None:
    assert all(setting.checks and setting.doc for setting in SETTINGS)
    assert all(
        re.fullmatch(r"[EW]\d{3}", check) for setting in SETTINGS for check in setting.checks
    )


def test_the_default_digest_keys_follow_secret_key_and_its_fallbacks() -> None:
    with override_settings(SECRET_KEY="k" * 50, SECRET_KEY_FALLBACKS=["f" * 50], IDEMPOTENCY={}):
        # No version: _store.digests derives it from the secret.
        assert idempotency_settings.DIGEST_KEYS == ((None, b"k" * 50), (None, b"f" * 50))
    with override_settings(IDEMPOTENCY={"DIGEST_KEYS": [("v1", "s" * 40)]}):
        given: object = idempotency_settings.DIGEST_KEYS
        assert given == (("v1", b"s" * 40),)


# --- what a protected view decides once, per value of the settings -------------------------

CHARGES = "/api-view/charges"


@pytest.mark.django_db(transaction=True)
def test_a_views_plan_follows_every_change_of_the_settings(api: APIClient) -> None:
    """A view's key header, echo, requirement, retention and retention header are resolved
    once (its plan) and again at the first request after IDEMPOTENCY changed."""
    before = post(api, CHARGES, {"amount": 1}, "plan-before")  # the plan is made here
    changed = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "HEADER": "X-Request-Key",
        "ADVERTISE_RETENTION": True,
        "TTL": 90,
    }
    with override_settings(IDEMPOTENCY=changed):
        during = api.post(CHARGES, {"amount": 1}, format="json", HTTP_X_REQUEST_KEY="plan-during")
        old_header = post(api, CHARGES, {"amount": 1}, "plan-old-header")
        with override_settings(IDEMPOTENCY={**changed, "REQUIRED": False}):
            keyless = post(api, CHARGES, {"amount": 1}, None)
    after = post(api, CHARGES, {"amount": 1}, "plan-after")

    assert (before.status_code, before["Idempotency-Key"]) == (201, "plan-before")
    assert "Idempotency-Key-Expires-In" not in before
    assert (during.status_code, during["X-Request-Key"]) == (201, "plan-during")
    assert "Idempotency-Key" not in during
    assert during["Idempotency-Key-Expires-In"] == "90"
    assert old_header.status_code == 400  # no X-Request-Key: the key is missing
    assert keyless.status_code == 201 and not IdempotencyRecord.objects.filter(key="").exists()
    assert (after.status_code, after["Idempotency-Key"]) == (201, "plan-after")
    assert "Idempotency-Key-Expires-In" not in after
    assert "X-Request-Key" not in after


@pytest.mark.django_db(transaction=True)
def test_a_routes_default_operation_name_follows_a_change_of_its_naming_style(
    api: APIClient,
) -> None:
    """The name of a route's operation is judged once per route and style, not per request."""
    post(api, "/api-view/by-ref/0b8e5a1c-0a5b-4d3e-9a8c-2b9f6a1d7e44", {"amount": 1}, "named-1")
    with override_settings(IDEMPOTENCY={"OPERATION_NAMES": "normalised"}):
        post(api, "/api-view/by-ref/0b8e5a1c-0a5b-4d3e-9a8c-2b9f6a1d7e44", {"amount": 1}, "named-2")
    post(api, "/api-view/by-ref/0b8e5a1c-0a5b-4d3e-9a8c-2b9f6a1d7e44", {"amount": 1}, "named-3")

    operations = dict(IdempotencyRecord.objects.values_list("key", "operation"))
    assert operations["named-1"] == operations["named-3"] != operations["named-2"]
    assert "{" in operations["named-2"] and "{" not in operations["named-1"]
