"""Retries that DRF refuses before the protected handler runs still get their replay.

DRF authenticates, checks permissions and throttles in ``APIView.initial()``,
and the claim (and so the stored outcome) is looked up after them, in the
protected handler. A permission class that reads what the first request
changed refuses its retry (pretix: the retry of ``DELETE /events/<slug>/``
gets 403, since the event is gone). The narrow path of ``drf.py``: when a
permission check denies an authenticated caller, the throttles run, then a
COMPLETED or FAILED record of the same tenant, operation and key, with a
matching fingerprint, created by the same principal, is replayed; else the
original 403 stands (docs/security.md, "Replays past a refused permission").

A view that rotates or revokes its caller's credential (pretix's device key
roll) opts in with ``credential_rotation``: for that window, a retry whose
authentication fails because the first request revoked its credential is
answered with the replay, which carries the new credential, when it
presents that same credential, key and input; otherwise DRF's 401.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.factories import UserFactory
from tests.testapp.models import Charge
from tests.testapp.refusal_views import PERMITTED

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.testapp.refusal_views"),
    pytest.mark.guarantees,  # rows of the behaviour table (docs/http.md)
]

State = IdempotencyRecord.State
REFUNDS = ["/mixin/charges/{pk}", "/method/charges/{pk}", "/viewset/charges/{pk}/refund/"]
KINDS = ["mixin", "method", "viewset-action"]


@pytest.fixture(autouse=True)
def _fresh_throttles() -> Iterator[None]:
    cache.clear()
    yield
    cache.clear()


def client_of(user: Any) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def charge_of(user: Any) -> Charge:
    return Charge.objects.create(tenant=f"user:{user.pk}", amount=10)


def refund(client: APIClient, url: str, key: str = "k1", amount: int = 10) -> Any:
    return client.post(url, {"amount": amount}, format="json", HTTP_IDEMPOTENCY_KEY=key)


@pytest.mark.parametrize("url", REFUNDS, ids=KINDS)
def test_a_retry_refused_by_a_permission_reading_what_the_first_changed_gets_the_replay(
    url: str,
) -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = url.format(pk=charge.pk)

    first = refund(client, url)
    retry = refund(client, url)

    assert first.status_code == 201
    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (201, "true")
    assert retry.content == first.content
    assert retry["Idempotency-Key"] == "k1"
    # Without a key, the same retry is what DRF refuses.
    assert client.post(url, {"amount": 10}, format="json").status_code == 403


@pytest.mark.parametrize("kind", ["mixin", "method"])
def test_code_after_drfs_checks_in_a_subclass_initial_never_runs_for_a_refused_retry(
    kind: str,
) -> None:
    """The replay answers the refusal where DRF would: nothing after the checks runs."""
    PERMITTED.clear()
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/audit-trail/{kind}/charges/{charge.pk}"

    first = refund(client, url)
    retry = refund(client, url)

    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (201, "true")
    assert retry.content == first.content
    assert [f"POST {url}"] == PERMITTED  # the first request only


def test_a_retry_refused_by_a_permission_gets_the_replay_in_the_optimistic_mode() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/optimistic/charges/{charge.pk}"

    first = refund(client, url)
    retry = refund(client, url)

    assert first.status_code == 201
    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (201, "true")
    assert retry.content == first.content
    assert IdempotencyRecord.objects.get().principal_digest is not None


def test_the_retry_of_a_delete_whose_permission_reads_the_deleted_row_gets_the_stored_204() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"

    first = client.delete(url, HTTP_IDEMPOTENCY_KEY="del-1")
    retry = client.delete(url, HTTP_IDEMPOTENCY_KEY="del-1")

    assert first.status_code == 204 and not Charge.objects.exists()
    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (204, "true")


@pytest.mark.parametrize(
    ("key", "amount"), [("k2", 10), ("k1", 11)], ids=["another-key", "other-input"]
)
def test_a_refused_request_with_another_key_or_other_input_gets_the_original_403(
    key: str, amount: int
) -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client, url)

    refused = refund(client, url, key=key, amount=amount)

    assert refused.status_code == 403
    assert refused.json()["detail"] == "You do not have permission to perform this action."
    assert "Idempotent-Replayed" not in refused


def test_another_principal_of_the_same_tenant_gets_the_original_403() -> None:
    """One tenant for the whole organisation: the replay goes only to the principal that sent it."""
    alice, bob = UserFactory.create(), UserFactory.create()
    charge = charge_of(alice)
    url = f"/organisation/charges/{charge.pk}"
    assert refund(client_of(alice), url).status_code == 201

    bobs = refund(client_of(bob), url)
    alices = refund(client_of(alice), url)

    assert (bobs.status_code, bobs.get("Idempotent-Replayed")) == (403, None)
    assert (alices.status_code, alices.get("Idempotent-Replayed")) == (201, "true")
    assert IdempotencyRecord.objects.get().tenant == "organisation:acme"


def test_the_principal_is_stored_as_a_keyed_digest() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    refund(client, f"/mixin/charges/{charge.pk}")

    stored = IdempotencyRecord.objects.get().principal_digest
    assert stored is not None and stored.count(":") == 1
    assert f"user:{user.pk}" not in stored
    assert hashlib.sha256(f"user:{user.pk}".encode()).hexdigest() not in stored


@pytest.mark.parametrize(
    "change",
    [
        {"state": State.CLAIMED},
        {"state": State.IN_PROGRESS},
        {"state": State.UNCERTAIN},
        {"tombstone": True},
        {"principal_digest": None},  # written by a release that stored no principal
    ],
    ids=["claimed", "in-progress", "uncertain", "tombstone", "no-principal"],
)
def test_only_a_finished_record_with_its_principal_is_replayed_past_a_refusal(
    change: dict[str, Any],
) -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client, url)
    IdempotencyRecord.objects.update(**change)

    assert refund(client, url).status_code == 403


def test_a_record_past_retention_is_not_replayed_past_a_refusal() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client, url)
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))

    assert refund(client, url).status_code == 403


def test_a_failed_record_is_replayed_past_a_refusal() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client, url)
    IdempotencyRecord.objects.update(
        state=State.FAILED,
        response_status=402,
        response_headers=[["Content-Type", "application/json"]],
        response_body=b'{"detail": "declined"}',
        response_sealed=False,  # written as plaintext here, whatever ENCRYPTION_KEYS says
    )

    retry = refund(client, url)

    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (402, "true")
    assert retry.content == b'{"detail": "declined"}'


def test_a_throttled_refused_retry_runs_no_sql_against_the_records() -> None:
    """DRF checks permissions before throttles; the narrow path throttles before its lookup."""
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/throttled/charges/{charge.pk}"
    assert refund(client, url).status_code == 201  # the one request a minute allowed

    with CaptureQueriesContext(connections["default"]) as queries:
        throttled = refund(client, url)

    assert throttled.status_code == 429
    assert not [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]


def test_a_refused_request_looks_the_record_up_with_one_statement() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client, url)

    with CaptureQueriesContext(connections["default"]) as queries:
        assert refund(client, url).status_code == 201
    on_records = [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]

    assert len(on_records) == 1 and on_records[0].startswith("SELECT"), on_records


def test_a_refused_retry_passing_two_wrapped_initials_is_looked_up_once() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/audited/charges/{charge.pk}"
    refund(client, url)

    with CaptureQueriesContext(connections["default"]) as queries:
        other_key = refund(client, url, key="k2")
    on_records = [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]
    retry = refund(client, url)

    assert other_key.status_code == 403 and len(on_records) == 1, on_records
    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (201, "true")


def test_a_body_drf_cannot_parse_keeps_the_original_403() -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client, url)

    refused = client.post(
        url, b"{not json", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k1"
    )

    assert refused.status_code == 403


def test_a_body_larger_than_the_protection_fingerprints_keeps_the_original_403(
    settings: Any,
) -> None:
    user = UserFactory.create()
    client, charge = client_of(user), charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client, url)
    settings.IDEMPOTENCY = {"MAX_FINGERPRINTED_BODY": 8}

    with CaptureQueriesContext(connections["default"]) as queries:
        refused = refund(client, url)

    assert refused.status_code == 403
    assert not [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]


def test_project_code_that_fails_for_a_refused_caller_keeps_the_original_403() -> None:
    """The tenant resolver assumes the permission checks passed: it raises for a refused caller.

    The narrow path runs it only to look for a replay; what it raises is no
    reason to answer a refused request with anything but the refusal.
    """
    outsider = UserFactory.create()  # in no organisation: refused, and no tenant
    charge = charge_of(outsider)

    refused = refund(client_of(outsider), f"/member/charges/{charge.pk}")

    assert (refused.status_code, refused.get("Idempotent-Replayed")) == (403, None)
    assert not IdempotencyRecord.objects.exists()


def test_an_anonymous_caller_gets_the_original_401() -> None:
    user = UserFactory.create()
    charge = charge_of(user)
    url = f"/mixin/charges/{charge.pk}"
    refund(client_of(user), url)

    with CaptureQueriesContext(connections["default"]) as queries:
        refused = refund(APIClient(), url)

    assert refused.status_code == 401
    assert not [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]


# -- Views that rotate the caller's credential (credential_rotation) ------------------------

ROTATIONS = ["/mixin/rotate", "/method/rotate"]
ROTATION_KINDS = ["mixin", "method"]


def token_client(user: Any) -> tuple[APIClient, str]:
    token, _ = Token.objects.get_or_create(user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client, token.key


def roll(client: APIClient, url: str, key: str = "roll-1", label: str = "till 3") -> Any:
    return client.post(url, {"label": label}, format="json", HTTP_IDEMPOTENCY_KEY=key)


@pytest.mark.parametrize("url", ROTATIONS, ids=ROTATION_KINDS)
def test_the_holder_of_the_rotated_credential_gets_the_replay_inside_the_window(
    url: str,
) -> None:
    client, old = token_client(UserFactory.create())

    first = roll(client, url)
    retry = roll(client, url)

    assert first.status_code == 201 and first.json()["token"] != old
    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (201, "true")
    assert retry.content == first.content  # the new credential, which the client never got
    assert retry["Idempotency-Key"] == "roll-1"


@pytest.mark.parametrize("url", ROTATIONS, ids=ROTATION_KINDS)
def test_the_holder_of_the_rotated_credential_gets_401_after_the_window(url: str) -> None:
    client, _ = token_client(UserFactory.create())
    roll(client, url)
    IdempotencyRecord.objects.update(created_at=timezone.now() - timedelta(minutes=5, seconds=1))

    retry = roll(client, url)

    assert retry.status_code == 401
    assert retry.json()["detail"] == "Invalid token."


@pytest.mark.parametrize(
    "change",
    ["another-credential", "changed-body", "another-key"],
)
def test_another_credential_a_changed_body_or_another_key_gets_401(change: str) -> None:
    client, _ = token_client(UserFactory.create())
    roll(client, "/mixin/rotate")
    if change == "another-credential":
        client.credentials(HTTP_AUTHORIZATION="Token " + "0" * 40)

    retry = roll(
        client,
        "/mixin/rotate",
        key="roll-2" if change == "another-key" else "roll-1",
        label="till 4" if change == "changed-body" else "till 3",
    )

    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (401, None)


def test_a_credential_no_authenticator_recognises_gets_the_replay_too() -> None:
    """An authenticator that ignores an unknown token: DRF's permission check answers 401."""
    client, _ = token_client(UserFactory.create())
    first = roll(client, "/quiet/rotate")
    retry = roll(client, "/quiet/rotate")

    assert (retry.status_code, retry.get("Idempotent-Replayed")) == (201, "true")
    assert retry.content == first.content


def test_a_view_that_does_not_opt_in_answers_401_and_keeps_no_credential() -> None:
    client, _ = token_client(UserFactory.create())
    assert roll(client, "/plain/rotate").status_code == 201

    with CaptureQueriesContext(connections["default"]) as queries:
        retry = roll(client, "/plain/rotate")

    assert retry.status_code == 401
    assert not [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]
    assert IdempotencyRecord.objects.get().credential_digest is None


def test_the_credential_is_stored_as_a_keyed_digest() -> None:
    client, old = token_client(UserFactory.create())
    roll(client, "/mixin/rotate")

    stored = IdempotencyRecord.objects.get().credential_digest
    assert stored is not None and stored.count(":") == 1
    for start in range(len(old) - 7):
        assert old[start : start + 8] not in stored
    assert hashlib.sha256(f"Token {old}".encode()).hexdigest() not in stored


def test_a_throttled_retry_with_a_rotated_credential_runs_no_sql_against_the_records() -> None:
    client, _ = token_client(UserFactory.create())
    first = roll(client, "/throttled/rotate")
    assert roll(client, "/throttled/rotate").content == first.content  # the one anonymous request

    with CaptureQueriesContext(connections["default"]) as queries:
        throttled = roll(client, "/throttled/rotate")

    assert throttled.status_code == 429
    assert not [q["sql"] for q in queries.captured_queries if "django_idempotency" in q["sql"]]


def test_an_unfinished_record_is_not_replayed_to_a_rotated_credential() -> None:
    client, _ = token_client(UserFactory.create())
    roll(client, "/mixin/rotate")
    IdempotencyRecord.objects.update(state=State.IN_PROGRESS)

    assert roll(client, "/mixin/rotate").status_code == 401


@pytest.mark.parametrize("window", [0, -1, timedelta(hours=1, seconds=1)])
def test_a_window_that_is_not_a_few_minutes_is_refused(window: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="credential_rotation"):
        idempotent(credential_rotation=window)


def test_two_records_of_one_credential_under_two_tenants_are_neither_replayed() -> None:
    """The credential names no tenant: with two candidates, which one is not its to say."""
    client, _ = token_client(UserFactory.create())
    roll(client, "/mixin/rotate")
    record = IdempotencyRecord.objects.get()
    record.pk, record.tenant = None, "another-tenant"
    record.save()

    assert roll(client, "/mixin/rotate").status_code == 401
