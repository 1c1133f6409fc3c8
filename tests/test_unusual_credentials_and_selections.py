"""Credentials the default tenant cannot tell apart, and admin selections too
large for one action or missing what the action's page showed."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from rest_framework.authentication import BaseAuthentication
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency import idempotent
from django_idempotency._admin.actions import MAX_RECORDS_PER_ACTION
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory
from tests.test_admin import CHANGELIST, staff, stuck_record
from tests.test_tenant_isolation import _call
from tests.utils import idempotency_of

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State


# --- default_tenant: authenticated clients that end up sharing a tenant ---------


class ClaimsAuthentication(BaseAuthentication):
    """A stateless JWT-style authentication: the auth object is the token's claims.

    Like many JWT setups for machine clients, it authenticates a client, not a
    user: ``request.user`` stays anonymous and ``request.auth`` is a dict of
    claims (no ``pk``, no ``user_id`` attribute).
    """

    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        subject = request.headers.get("X-Client")
        return None if subject is None else (AnonymousUser(), {"sub": subject})


@api_view(["POST"])
@authentication_classes([ClaimsAuthentication])
@permission_classes([])
@idempotent(operation="POST tenant-echo")
def claims_view(request: Request) -> Response:
    claims = request.auth
    assert isinstance(claims, dict), claims
    return Response({"tenant": idempotency_of(request).tenant, "sub": claims["sub"]}, status=201)


def test_two_authenticated_clients_without_a_pk_never_share_one_tenant() -> None:
    # Both were "anonymous": client B was handed client A's stored answer.
    # The default tenant cannot tell them apart, so it says so, at once.
    with pytest.raises(ImproperlyConfigured, match=r'IDEMPOTENCY\["TENANT"\]'):
        _call(claims_view, "order-1", HTTP_X_CLIENT="client-a")
    assert not IdempotencyRecord.objects.exists()


@dataclass(frozen=True)
class StatelessUser:
    """An authenticated user object built from a token, not from the database."""

    username: str
    pk: Any = None
    is_authenticated: bool = True
    is_active: bool = True


class StatelessUserAuthentication(BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        name = request.headers.get("X-Client")
        return None if name is None else (StatelessUser(name), None)


@api_view(["POST"])
@authentication_classes([StatelessUserAuthentication])
@permission_classes([])
@idempotent(operation="POST tenant-echo")
def stateless_user_view(request: Request) -> Response:
    return Response({"tenant": idempotency_of(request).tenant}, status=201)


def test_authenticated_users_without_a_primary_key_are_not_one_user_none_tenant() -> None:
    with pytest.raises(ImproperlyConfigured, match="StatelessUser"):
        _call(stateless_user_view, "order-1", HTTP_X_CLIENT="alice")
    assert "user:None" not in IdempotencyRecord.objects.values_list("tenant", flat=True)


@dataclass(frozen=True)
class AccessToken:
    """django-oauth-toolkit's AccessToken for a client-credentials grant, in shape.

    A model (pk), no user (``user_id`` None), the application it was issued to;
    it expires (10 hours by default) and the client gets a new one.
    """

    pk: int
    application_id: int
    user_id: Any = None


class ClientCredentialsAuthentication(BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        token = request.headers.get("X-Token")
        return None if token is None else (None, AccessToken(pk=int(token), application_id=7))


@api_view(["POST"])
@authentication_classes([ClientCredentialsAuthentication])
@permission_classes([])
@idempotent(operation="POST tenant-echo")
def client_credentials_view(request: Request) -> Response:
    return Response({"tenant": idempotency_of(request).tenant}, status=201)


def test_a_retry_after_the_client_refreshes_its_access_token_replays() -> None:
    first = _call(client_credentials_view, "charge-1", HTTP_X_TOKEN="100")
    # The token expired; the client's library fetched a new one and retried.
    retry = _call(client_credentials_view, "charge-1", HTTP_X_TOKEN="101")

    assert first.status_code == 201
    # A tenant per token would run the operation again: the application is the client.
    assert retry.get("Idempotent-Replayed") == "true"


# --- the admin: "Select all" then an action -------------------------------------


def _apply_data(page: Any, action: str, **form: Any) -> dict[str, Any]:
    """What the action page's form posts back, field for field (its template)."""
    data: dict[str, Any] = {"action": action, "apply": "1", "_selected_action": [], **form}
    for record in page.context["records"]:
        data["_selected_action"].append(record.pk)
        data[f"token-{record.pk}"] = record.fencing_token
        data[f"state-{record.pk}"] = record.state
    return data


def test_mark_failed_on_more_records_than_one_action_takes_says_so_and_changes_nothing() -> None:
    # "Select all 400 stuck records" (the changelist's select_across), then
    # Mark failed: the confirmation page carries three fields per record, and
    # Django refused the POST (DATA_UPLOAD_MAX_NUMBER_FIELDS, 1,000) with 400.
    for _ in range(MAX_RECORDS_PER_ACTION + 100):
        stuck_record(key=str(uuid.uuid4()))
    client = staff("mark_failed")

    answer = client.post(
        CHANGELIST + "?state=stuck",
        {"action": "mark_failed", "select_across": "1", "_selected_action": ["1"]},
        follow=True,
    )

    assert answer.status_code == 200
    assert f"Select at most {MAX_RECORDS_PER_ACTION} records" in answer.content.decode()
    assert not IdempotencyRecord.objects.filter(state=State.FAILED).exists()


def test_mark_failed_on_all_stuck_records_selected_across_pages_can_be_applied() -> None:
    for _ in range(MAX_RECORDS_PER_ACTION):
        stuck_record(key=str(uuid.uuid4()))
    client = staff("mark_failed")

    page = client.post(
        CHANGELIST + "?state=stuck",
        {"action": "mark_failed", "select_across": "1", "_selected_action": ["1"]},
    )
    assert page.status_code == 200
    assert len(page.context["records"]) == MAX_RECORDS_PER_ACTION

    applied = client.post(
        CHANGELIST + "?state=stuck",
        _apply_data(page, "mark_failed", status="410", body='{"detail": "gone"}'),
    )

    assert applied.status_code in (200, 302), applied.status_code
    assert IdempotencyRecord.objects.filter(state=State.FAILED).count() == MAX_RECORDS_PER_ACTION


def test_an_apply_without_the_pages_token_fields_is_skipped_like_a_hand_made_token() -> None:
    # the admin's input rule: a value no page of ours sends is skipped. A token
    # field that is absent is no less hand-made than one that is garbled,
    # yet it is read as "the record as it is now": the compare-and-set on
    # what the operator saw is bypassed.
    record = stuck_record(fencing_token=5)
    client = staff("release")

    answer = client.post(
        CHANGELIST,
        {
            "action": "release",
            "_selected_action": [record.pk],
            "apply": "1",
            "reexecute": "on",
        },
        follow=True,
    )

    assert answer.status_code == 200
    assert IdempotencyRecord.objects.filter(pk=record.pk).exists()


def test_release_confirmation_of_a_select_across_counts_the_records_it_released() -> None:
    # _report() counts the selection from the POSTed checkboxes; with
    # select_across (one checkbox posted) the message is wrong.
    records = [RecordFactory.create(state=State.CLAIMED, key=str(uuid.uuid4())) for _ in range(3)]
    for record in records:
        record.lease_expires_at = timezone.now() - timedelta(minutes=1)
        record.save()
    client = staff("release")

    answer = client.post(
        CHANGELIST,
        {
            "action": "release",
            "select_across": "1",
            "_selected_action": [records[0].pk],
            "apply": "1",
            "reexecute": "on",
            # What the confirmation page showed, for each record.
            **{f"token-{record.pk}": record.fencing_token for record in records},
            **{f"state-{record.pk}": record.state for record in records},
        },
        follow=True,
    )

    text = answer.content.decode()
    assert not IdempotencyRecord.objects.exists()
    assert "3 records were released" in text
    assert "skipped" not in text
