"""Resolved settings: kept between requests, dropped when IDEMPOTENCY changes."""

from __future__ import annotations

import importlib.util
import re
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.test import override_settings

from django_idempotency.conf import DEFAULTS, SETTINGS, idempotency_settings


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
