"""Resolved settings: kept between requests, dropped when IDEMPOTENCY changes."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.test import override_settings

from django_idempotency.conf import idempotency_settings


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
