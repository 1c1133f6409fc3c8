"""Guarantees that real-project configurations put at risk (tests/configurations/).

Each test runs in every cell of the matrix where its database applies; the
ones about one configuration's own feature (``only_under``) are skipped in
the others. The behaviour table itself is proven by the other ``guarantees``
modules, run in every cell too.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from django.apps import AppConfig
from django.db import connections
from django.test import Client, TestCase
from django.test.client import MULTIPART_CONTENT
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from django_idempotency import _store as store
from django_idempotency._store.database_time import DatabaseNow
from django_idempotency.fingerprint import fingerprint
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import stale_records
from django_idempotency.scope import Scope
from django_idempotency.testing import assert_protected
from tests import configurations
from tests.testapp.models import Charge
from tests.utils import TokenClient, post

pytestmark = pytest.mark.guarantees

URL = "/api-view/charges"
State = IdempotencyRecord.State


# -- daylight-saving change under USE_TZ=False (first: the clock is running) -----------

#: The spring-forward change in New York that configuration dst-naive starts before.
SPRING_FORWARD = datetime(2027, 3, 14, 2, 0)


def _wait_until_local(moment: datetime, at_most: float = 90.0) -> None:
    deadline = time.monotonic() + at_most
    while datetime.now() < moment:
        assert time.monotonic() < deadline, f"the local clock never reached {moment}"
        time.sleep(0.2)


@pytest.mark.only_under("dst-naive")
@pytest.mark.django_db(transaction=True)
def test_a_lease_taken_before_spring_forward_still_runs_after_it(api: APIClient) -> None:
    """Local wall-clock time jumps an hour; the two minutes of the lease do not."""
    assert datetime.now() < SPRING_FORWARD, (
        f"the test started after the change ({datetime.now()}): faketime's moment "
        f"({configurations.DST_MOMENT}) leaves too little time before it"
    )
    post(api, URL, {"amount": 100}, "dst-1")
    # The owner is still running its view: a claim with a two-minute lease,
    # written by the store itself (a takeover of the record by recovery). On
    # PostgreSQL the lease is the database's, whose clock faketime leaves alone:
    # there the jump of this process's clock must change nothing at all.
    IdempotencyRecord.objects.update(state=State.CLAIMED, lease_expires_at=DatabaseNow())
    assert store.take_over_next_stale(lease=timedelta(minutes=2), using="default") is not None
    claimed_at = time.monotonic()

    _wait_until_local(SPRING_FORWARD.replace(hour=3))
    assert time.monotonic() - claimed_at < 100, "the lease may really have run out by now"

    stale = [record.key for record in stale_records(limit=10)]
    retry = post(api, URL, {"amount": 100}, "dst-1")

    # Neither recovery nor a retry may take over: 2 minutes have not passed.
    assert (stale, retry.status_code) == ([], 409), "a lease that still runs was taken over"
    assert Charge.objects.count() == 1


# -- conditional writes, whatever signal receivers a project connects ------------------


@pytest.mark.django_db(transaction=True)
def test_a_release_is_one_conditional_delete_whatever_the_receivers() -> None:
    """A stale owner must never delete a record another worker took over meanwhile.

    Only a single ``DELETE ... WHERE fencing_token = ...`` is safe: a SELECT
    followed by a DELETE by primary key (what ``QuerySet.delete()`` does as
    soon as a delete receiver is connected) lets a takeover in between.
    """
    scope = Scope(tenant="anonymous", operation="POST release", key=f"k-{uuid.uuid4()}")
    held = store.claim(
        scope, fingerprint({}), ttl=timedelta(hours=1), lease=timedelta(minutes=2), using="default"
    )
    assert held is not None

    with CaptureQueriesContext(connections["default"]) as queries:
        assert store.release(held)

    statements = [query["sql"] for query in queries.captured_queries]
    deletes = [sql for sql in statements if sql.lstrip().upper().startswith("DELETE")]
    assert len(deletes) == 1 and "fencing_token" in deletes[0], statements
    assert not any(sql.lstrip().upper().startswith("SELECT") for sql in statements), statements
    assert not IdempotencyRecord.objects.filter(pk=held.record_id).exists()


@pytest.mark.only_under("delete-signals")
def test_the_audit_apps_receivers_are_connected_without_a_sender() -> None:
    from django.db.models.signals import post_delete, pre_delete

    from tests.configurations.audit import apps as audit

    assert pre_delete.has_listeners(IdempotencyRecord)
    assert post_delete.has_listeners(IdempotencyRecord)
    assert audit.AuditConfig.name in {config.name for config in _app_configs()}


def _app_configs() -> list[AppConfig]:
    from django.apps import apps

    return list(apps.get_app_configs())


# -- the documented pytest-django and TestCase use, under any transaction settings ------


@pytest.mark.django_db
def test_assert_protected_leaves_a_django_db_tests_transaction_usable() -> None:
    assert_protected(APIClient(), URL, {"amount": 5})

    assert Charge.objects.count() == 1


class AssertProtectedInATestCase(TestCase):
    def test_assert_protected_leaves_the_test_cases_transaction_usable(self) -> None:
        assert_protected(APIClient(), URL, {"amount": 5})

        assert Charge.objects.count() == 1


# -- plain views with CSRF enforced ---------------------------------------------------


@pytest.mark.urls("tests.configurations.forms")
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("multipart", [True, False], ids=["multipart", "urlencoded"])
def test_a_form_post_with_a_csrf_token_runs_once_and_replays(multipart: bool) -> None:
    client = Client(enforce_csrf_checks=True)
    token = client.get("/forms/csrf-token").json()["token"]
    fields = {"amount": "5", "note": "form", "csrfmiddlewaretoken": token}
    data: dict[str, str] | str = fields
    content_type = MULTIPART_CONTENT
    if not multipart:
        data = "&".join(f"{name}={value}" for name, value in fields.items())
        content_type = "application/x-www-form-urlencoded"

    first = client.post("/forms/charges", data, content_type, HTTP_IDEMPOTENCY_KEY="form-1")
    retry = client.post("/forms/charges", data, content_type, HTTP_IDEMPOTENCY_KEY="form-1")

    assert first.status_code == 201, first.content
    assert retry.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert Charge.objects.count() == 1


# -- one configuration's own feature ----------------------------------------------------


@pytest.mark.only_under("browsable-api")
@pytest.mark.django_db(transaction=True)
def test_a_browser_client_runs_once_and_gets_its_replay(api: APIClient) -> None:
    html = {"HTTP_ACCEPT": "text/html"}
    first = post(api, URL, {"amount": 5}, "html-1", **html)
    retry = post(api, URL, {"amount": 5}, "html-1", **html)

    assert first.status_code == 201
    assert first["Content-Type"].startswith("text/html")
    assert retry.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert Charge.objects.count() == 1


@pytest.mark.only_under("uuid-user")
@pytest.mark.django_db(transaction=True)
def test_token_users_with_uuid_keys_are_tenants_of_their_own(
    client_for: Callable[..., TokenClient],
) -> None:
    from django.contrib.auth import get_user_model

    assert get_user_model()._meta.pk.get_internal_type() == "UUIDField"
    alice, bob = client_for(), client_for()
    first = post(alice, URL, {"amount": 5}, "shared")
    replay = post(alice, URL, {"amount": 5}, "shared")
    other = post(bob, URL, {"amount": 5}, "shared")

    assert first.status_code == replay.status_code == other.status_code == 201
    assert replay["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in other
    assert Charge.objects.count() == 2


@pytest.mark.only_under("encryption")
@pytest.mark.django_db(transaction=True)
def test_stored_bodies_are_sealed_at_rest(api: APIClient) -> None:
    first = post(api, URL, {"amount": 987654321}, "sealed-1")
    replay = post(api, URL, {"amount": 987654321}, "sealed-1")

    raw = IdempotencyRecord.objects.values_list("response_body", flat=True).get()
    assert raw is not None
    assert b"987654321" not in bytes(raw)
    assert replay.content == first.content
