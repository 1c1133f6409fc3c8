"""External calls: the intent commits before the call; a failure after it is UNCERTAIN."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.models import F
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.context import derive_provider_key
from django_idempotency.models import IdempotencyRecord
from django_idempotency.scope import Scope
from tests.testapp.models import Charge
from tests.testapp.views import ViewFailure
from tests.utils import post

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.guarantees,
    pytest.mark.not_under(
        "repeatable-read",
        reason="begin_external() is refused above READ COMMITTED on PostgreSQL "
        "(IsolationNotSupported; tests/test_isolation.py)",
        databases=("postgres",),
    ),
]
URL = "/api-view/external"
State = IdempotencyRecord.State
OPERATION = "POST api-view/external"


@pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view claims inside the request transaction (W002)",
)
def test_intent_commits_before_the_call_while_the_view_transaction_is_open(
    api: APIClient,
) -> None:
    body = post(api, URL, {"amount": 1}, "k").json()
    provider_key = derive_provider_key(Scope("anonymous", OPERATION, "k"))

    assert body["provider_key"] == provider_key
    if connection.vendor == "sqlite":
        # One writer at a time: the intent is written in the view's transaction.
        assert body["committed_after_begin"] == "CLAIMED "
    else:
        assert body["committed_after_begin"] == f"IN_PROGRESS {provider_key}"
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.provider_key) == (State.COMPLETED, provider_key)


def test_provider_operation_id_is_stored(api: APIClient) -> None:
    post(api, URL, {"amount": 1, "provider_id": "ch_123"}, "k")
    assert IdempotencyRecord.objects.get().provider_operation_id == "ch_123"


@pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view claims inside the request transaction (W002): an "
    "exception rolls the intent back with it (docs/guarantees.md)",
)
@pytest.mark.parametrize("then", ["raise", 500, 503, 429])
def test_a_failure_after_begin_external_leaves_the_record_uncertain(
    api: APIClient, then: Any
) -> None:
    api.raise_request_exception = False
    uncertain: list[Any] = []
    receiver = lambda sender, **kwargs: uncertain.append(kwargs["reason"])  # noqa: E731
    signals.record_uncertain.connect(receiver)
    try:
        first = post(api, URL, {"amount": 1, "then": then, "provider_id": "ch_1"}, "k")
        retry = post(api, URL, {"amount": 1, "then": then, "provider_id": "ch_1"}, "k")
    finally:
        signals.record_uncertain.disconnect(receiver)

    assert first.status_code == (500 if then == "raise" else then)
    assert retry.status_code == 503
    assert retry.json()["code"] == "idempotency_outcome_uncertain"
    record = IdempotencyRecord.objects.get()
    assert record.state == State.UNCERTAIN
    assert record.provider_operation_id == "ch_1"
    assert record.lease_owner == ""
    # The view's own writes rolled back; the record stays for a reconciler.
    assert Charge.objects.count() == 0
    assert uncertain == ["exception" if then == "raise" else then]


def test_provider_key_is_deterministic_and_scoped() -> None:
    one = derive_provider_key(Scope("user:1", OPERATION, "k"))
    assert one == derive_provider_key(Scope("user:1", OPERATION, "k"))
    others = {
        derive_provider_key(Scope("user:2", OPERATION, "k")),
        derive_provider_key(Scope("user:1", "POST other", "k")),
        derive_provider_key(Scope("user:1", OPERATION, "k2")),
    }
    assert one not in others and len(others) == 3


def test_a_retry_after_a_released_claim_keeps_the_provider_key(api: APIClient) -> None:
    """The provider must recognise every attempt at the operation as one."""
    api.raise_request_exception = False
    first = post(api, URL, {"amount": 1}, "k").json()["provider_key"]
    IdempotencyRecord.objects.all().delete()  # released (say, by a reconciler)
    assert post(api, URL, {"amount": 1}, "k").json()["provider_key"] == first


def test_begin_external_can_hold_the_lease_for_a_long_call(api: APIClient) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from django_idempotency import _store as store
    from django_idempotency.context import IdempotencyContext

    post(api, URL, {"amount": 1}, "k")
    IdempotencyRecord.objects.update(state=State.CLAIMED)
    record = IdempotencyRecord.objects.get()
    held = store.Claim(
        record.pk, record.fencing_token, Scope("anonymous", OPERATION, "k"), "default"
    )

    IdempotencyContext(held).begin_external(lease=timedelta(minutes=30))

    record.refresh_from_db()
    assert record.lease_expires_at is not None
    assert record.lease_expires_at > timezone.now() + timedelta(minutes=29)


@pytest.mark.not_under(
    "atomic-requests",
    reason="a non-exempt @api_view claims inside the request transaction (W002)",
)
def test_a_stale_owner_cannot_begin_an_external_call(
    api: APIClient, caplog: pytest.LogCaptureFixture
) -> None:
    def take_over(sender: Any, scope: Any, **kwargs: Any) -> None:
        IdempotencyRecord.objects.filter(key=scope.key).update(fencing_token=F("fencing_token") + 1)

    signals.request_claimed.connect(take_over)
    try:
        response = post(api, URL, {"amount": 1}, "k")
    finally:
        signals.request_claimed.disconnect(take_over)

    assert response.status_code == 409
    record = IdempotencyRecord.objects.get()
    assert (record.state, record.provider_key) == (State.CLAIMED, "")
    assert Charge.objects.count() == 0
    assert "begin_external" in caplog.text


def test_inside_a_callers_transaction_the_intent_joins_it(api: APIClient) -> None:
    from django.db import transaction

    with transaction.atomic():
        assert post(api, URL, {"amount": 1}, "k").status_code == 201
        assert IdempotencyRecord.objects.get().state == State.COMPLETED


def test_renew_lease_extends_the_lease(api: APIClient) -> None:
    from django_idempotency import _store as store
    from django_idempotency.context import IdempotencyContext

    post(api, URL, {"amount": 1}, "k")
    IdempotencyRecord.objects.update(state=State.CLAIMED)
    record = IdempotencyRecord.objects.get()
    before = record.lease_expires_at
    held = store.Claim(
        record.pk, record.fencing_token, Scope("anonymous", OPERATION, "k"), "default"
    )

    IdempotencyContext(held).renew_lease()

    record.refresh_from_db()
    assert record.lease_expires_at is not None
    assert before is None or record.lease_expires_at > before
    IdempotencyRecord.objects.update(fencing_token=F("fencing_token") + 1)
    from django_idempotency.exceptions import StaleOwner

    with pytest.raises(StaleOwner):
        IdempotencyContext(held).renew_lease()


def test_view_failure_class_is_what_the_test_view_raises() -> None:
    assert issubclass(ViewFailure, RuntimeError)


def test_the_second_connection_is_one_of_the_alias_intent_databases_names(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """INTENT_DATABASES: made from the mapped alias's settings, closed after the view.

    Behind PgBouncer that alias is a pool of its own; tests/live/test_pgbouncer.py
    shows the intents committing through it, and the deadlock without it.
    """
    from copy import deepcopy

    from django.db import connections, transaction

    from django_idempotency._store import close_independent_connections, commit_now_alias

    intents = {**deepcopy(connections["default"].settings_dict), "CONN_MAX_AGE": 7}
    monkeypatch.setitem(connections.settings, "intents", intents)
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "INTENT_DATABASES": {"default": "intents"},
    }
    assert commit_now_alias("default") == "default"  # autocommit: the alias itself
    with transaction.atomic():
        alias = commit_now_alias("default")
        try:
            if connection.vendor == "sqlite":
                assert alias == "default"  # one writer: the intent joins the view's transaction
            else:
                assert alias != "default"
                assert connections[alias].alias == "intents"
                assert connections[alias].settings_dict["CONN_MAX_AGE"] == 7
        finally:
            close_independent_connections()
    if alias != "default":
        from django.utils.connection import ConnectionDoesNotExist

        with pytest.raises(ConnectionDoesNotExist):
            connections[alias]  # closed and unregistered
