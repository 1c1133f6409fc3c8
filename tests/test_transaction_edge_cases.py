"""Transactions at their edges: Django's own database errors in a view, a
success rolled back on another database, a contention 409 inside a caller's
transaction, a connection lost at COMMIT.

The views are this module's own (``pytest.mark.urls``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.urls import path
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord
from tests.sessions import key_held_by_an_open_transaction
from tests.testapp.models import Charge
from tests.utils import idempotency_of, post

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.test_transaction_edge_cases"),
]
State = IdempotencyRecord.State


# --- views -------------------------------------------------------------------


@api_view(["POST"])
@idempotent
def save_that_matches_no_row(request: Request) -> Response:
    """A common view bug: saving with update_fields a row deleted meanwhile.

    Django itself raises ``DatabaseError("Save with update_fields did not
    affect any rows.")``: no driver error behind it, and the store is fine.
    """
    charge = Charge.objects.create(tenant="t", amount=1)
    Charge.objects.filter(pk=charge.pk).delete()  # "meanwhile"
    charge.amount = 2
    charge.save(update_fields=["amount"])
    return Response({"id": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def query_after_a_swallowed_integrity_error(request: Request) -> Response:
    """The habit of defect 2, followed by one more query: TransactionManagementError."""
    charge = Charge.objects.create(tenant="t", amount=1)
    try:  # noqa: SIM105
        Charge.objects.create(pk=charge.pk, tenant="duplicate", amount=0)
    except IntegrityError:
        pass
    Charge.objects.count()  # Django: TransactionManagementError
    return Response({"id": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def swallow_on_the_other_database(request: Request) -> Response:
    """Defect 2 on a second ATOMIC_REQUESTS database (records on "default")."""
    charge = Charge.objects.using("other").create(tenant="t", amount=1)
    try:  # noqa: SIM105
        Charge.objects.using("other").create(pk=charge.pk, tenant="duplicate", amount=0)
    except IntegrityError:
        pass
    return Response({"id": charge.pk}, status=201)


@api_view(["POST"])
@idempotent
def read_then_call_out(request: Request) -> Response:
    """Reads (the snapshot is taken), then begins an external call, then writes."""
    Charge.objects.count()
    idempotency_of(request).begin_external()
    charge = Charge.objects.create(tenant="t", amount=1)
    return Response({"id": charge.pk}, status=201)


urlpatterns = [
    path("no-row", save_that_matches_no_row),
    path("after-swallow", query_after_a_swallowed_integrity_error),
    path("other-db", swallow_on_the_other_database),
    path("external", read_then_call_out),
]


# --- a view's own DatabaseError is the view's, not a store outage ------------


def test_a_django_database_error_in_the_view_is_a_500_not_store_unavailable(
    api: APIClient,
) -> None:
    """A DatabaseError Django raises itself (no driver error behind it) is the
    view's bug, not a lost connection: never 503 "store unavailable" ("not run",
    retry later), which the retry would hit again and again."""
    api.raise_request_exception = False
    response = post(api, "/no-row", {"amount": 1}, "k")

    assert response.status_code == 500, (response.status_code, response.content)


def test_a_query_after_a_swallowed_integrity_error_is_a_500_not_store_unavailable(
    api: APIClient,
) -> None:
    api.raise_request_exception = False
    response = post(api, "/after-swallow", {"amount": 1}, "k")

    assert response.status_code == 500, (response.status_code, response.content)


# --- a success rolled back on another ATOMIC_REQUESTS database --------------


@pytest.fixture
def other_atomic_database() -> Iterator[None]:
    """A second alias with ATOMIC_REQUESTS (the same PostgreSQL test database)."""
    settings_dict = {**connections["default"].settings_dict, "ATOMIC_REQUESTS": True}
    connections.settings["other"] = settings_dict
    # Made from "default" so that the test case's guard of undeclared aliases
    # lets it connect; it is a connection of its own all the same.
    other = connections.create_connection("default")
    other.settings_dict = settings_dict
    connections["other"] = other
    try:
        yield
    finally:
        connections["other"].close()
        del connections["other"]
        del connections.settings["other"]


@pytest.mark.postgres
def test_a_success_rolled_back_on_another_atomic_requests_database_is_not_stored(
    api: APIClient, other_atomic_database: None
) -> None:
    """Writes on another ATOMIC_REQUESTS database commit in a transaction of
    their own: a success whose writes roll back there is a 500, never stored."""
    api.raise_request_exception = False
    first = post(api, "/other-db", {"amount": 1}, "k")
    assert first.status_code == 500

    record = IdempotencyRecord.objects.first()
    stored_success = record is not None and record.state == State.COMPLETED
    assert not (stored_success and not Charge.objects.exists()), (
        first.status_code,
        record and record.state,
        Charge.objects.count(),
    )


# --- a contention 409 inside a caller's transaction on PostgreSQL -----------


@pytest.mark.postgres
def test_a_contention_409_leaves_a_callers_transaction_usable(api: APIClient) -> None:
    """In a caller's PostgreSQL transaction the claim runs in a savepoint: its
    lock timeout leaves the caller's transaction usable (a refusal must not
    poison a transaction it did not open)."""
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '200ms'")
            with key_held_by_an_open_transaction("POST no-row"):
                response = post(api, "/no-row", {"amount": 1}, "k")
            assert response.status_code == 409
            Charge.objects.count()  # the caller's next query
    finally:
        connection.close()


# --- the connection lost during a COMMIT ---------------------------------------
