"""``IdempotencyMiddleware`` protects Django Ninja operations that protect nothing themselves.

Through the real Django test client (and Django's ASGI handler, for an
``async def`` operation) and the URLconf of
``tests.testapp.ninja_middleware_urls``: the claim after Ninja's
authentication, the report-only rollout and the required mode,
``idempotent_exempt``, an operation's own ``@idempotent`` (protected
once), anonymous requests, ATOMIC_REQUESTS, and what lists the protected
operations (the checks' names, ``idempotency_routes``, Ninja's schema).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings as django_settings
from django.core.management import call_command
from django.db import connections
from django.test import AsyncClient, Client

from django_idempotency._routes import protected_operations
from django_idempotency._store.digests import tenant_digest
from django_idempotency._view_checks import check_atomic_requests
from django_idempotency.models import IdempotencyRecord
from tests.telemetry import Readings, installed
from tests.testapp.models import Charge
from tests.testapp.ninja_api import API_KEYS

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
BASE = tuple(django_settings.MIDDLEWARE)
KEY = API_KEYS[0]
ORDERS = "/ninja-mw/orders"


def configure(settings: Any, **idempotency: Any) -> None:
    settings.MIDDLEWARE = [*BASE, MIDDLEWARE]
    settings.ROOT_URLCONF = "tests.testapp.ninja_middleware_urls"
    settings.IDEMPOTENCY = idempotency


@pytest.fixture(autouse=True)
def middleware(settings: Any) -> None:
    """The middleware last in MIDDLEWARE, report-only."""
    configure(settings)


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=False)


def post(
    client: Client, url: str, key: str | None, *, api_key: str | None = KEY, amount: int = 5
) -> Any:
    headers = {} if api_key is None else {"X-API-Key": api_key}
    if key is not None:
        headers["Idempotency-Key"] = key
    body = json.dumps({"amount": amount})
    return client.post(url, body, content_type="application/json", headers=headers)


def records() -> list[tuple[str, str]]:
    return sorted(IdempotencyRecord.objects.values_list("operation", "state"))


@pytest.fixture
def counted() -> Callable[..., float]:
    """How much an instrument's matching points rose since the test began."""
    reader, _ = installed()
    before = Readings(reader)
    return lambda name, **labels: (
        Readings(reader).value(name, **labels) - before.value(name, **labels)
    )


def test_a_keyed_request_is_claimed_after_ninjas_authentication_and_replayed(
    client: Client,
) -> None:
    first = post(client, ORDERS, "order-1")
    retry = post(client, ORDERS, "order-1")
    other_body = post(client, ORDERS, "order-1", amount=6)
    unauthenticated = post(client, ORDERS, "order-2", api_key="not-a-key")

    assert first.status_code == 201 and first["Idempotency-Key"] == "order-1"
    assert retry.content == first.content and retry["Idempotent-Replayed"] == "true"
    assert (other_body.status_code, other_body.json()["code"]) == (422, "idempotency_key_reused")
    assert unauthenticated.status_code == 401  # before any claim
    assert Charge.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.operation, record.tenant) == (
        "POST ninja-mw/orders",
        f"auth:{tenant_digest(KEY)}",
    )


def test_every_unsafe_operation_is_protected(client: Client) -> None:
    first, retry = (
        client.put(
            "/ninja-mw/orders/7",
            json.dumps({"amount": 5}),
            content_type="application/json",
            headers={"X-API-Key": KEY, "Idempotency-Key": "put-1"},
        )
        for _ in range(2)
    )

    assert first.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert records() == [("PUT ninja-mw/orders/<int:pk>", State.COMPLETED)]


def test_a_keyless_request_runs_unprotected_is_counted_and_names_its_client(
    client: Client, counted: Callable[..., float], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="django_idempotency.middleware")
    post(client, ORDERS, "order-1")  # the operation is protected from here on

    responses = [post(client, ORDERS, None) for _ in range(2)]

    assert [response.status_code for response in responses] == [201, 201]
    assert Charge.objects.count() == 3
    assert records() == [("POST ninja-mw/orders", State.COMPLETED)]  # the keyed one's
    assert counted("idempotency.keyless_requests", operation="POST ninja-mw/orders") == 2
    [line, _] = [
        r.getMessage() for r in caplog.records if r.name == "django_idempotency.middleware"
    ]
    # Named as its records' tenant would be: the API key's keyed digest, never the key.
    assert f"sent by auth:{tenant_digest(KEY)}" in line
    assert KEY not in caplog.text


def test_in_required_mode_a_keyless_request_is_refused_the_way_ninja_answers_errors(
    client: Client, settings: Any
) -> None:
    configure(settings, MIDDLEWARE_KEYS="required")

    refused = post(client, ORDERS, None)
    listed = client.get(ORDERS, headers={"X-API-Key": KEY})

    assert (refused.status_code, refused.json()["code"]) == (400, "idempotency_key_missing")
    assert refused["Content-Type"] == "application/json; charset=utf-8"
    assert listed.status_code == 200  # safe methods are never protected
    assert Charge.objects.count() == 0


def test_switching_to_required_keys_applies_to_operations_protected_already(
    client: Client, settings: Any
) -> None:
    post(client, ORDERS, "order-1")  # protected from here on, keys optional
    configure(settings, MIDDLEWARE_KEYS="required")

    assert post(client, ORDERS, None).status_code == 400


def test_an_exempt_operation_is_left_alone(client: Client, settings: Any) -> None:
    configure(settings, MIDDLEWARE_KEYS="required")

    keyless = post(client, "/ninja-mw/exempt", None)
    keyed = post(client, "/ninja-mw/exempt", "exempt-1")
    again = post(client, "/ninja-mw/exempt", "exempt-1")

    assert (keyless.status_code, keyed.status_code, again.status_code) == (201, 201, 201)
    assert "Idempotent-Replayed" not in again
    assert records() == []


def test_an_operation_with_its_own_decorator_keeps_its_options_and_is_claimed_once(
    client: Client, settings: Any
) -> None:
    configure(settings, MIDDLEWARE_KEYS="required")

    keyless = post(client, "/ninja-mw/own", None)  # its own required=False
    first = post(client, "/ninja-mw/own", "own-1")
    retry = post(client, "/ninja-mw/own", "own-1")

    assert (keyless.status_code, first.status_code) == (201, 201)
    assert retry["Idempotent-Replayed"] == "true"
    assert records() == [("ninja order with its own options", State.COMPLETED)]


def test_anonymous_requests_are_left_alone_without_a_tenant(client: Client) -> None:
    first = post(client, "/ninja-mw/open", "shared-key", api_key=None)
    second = post(client, "/ninja-mw/open", "shared-key", api_key=None)

    assert "Idempotent-Replayed" not in second
    assert (first.status_code, second.status_code) == (201, 201)
    assert Charge.objects.count() == 2 and records() == []


def test_anonymous_requests_are_protected_where_the_project_sets_a_tenant(
    client: Client, settings: Any
) -> None:
    configure(settings, TENANT=lambda request: request.headers.get("X-Device", "unknown"))

    post(client, "/ninja-mw/open", "k", api_key=None)
    retry = client.post(
        "/ninja-mw/open",
        json.dumps({"amount": 5}),
        content_type="application/json",
        headers={"Idempotency-Key": "k"},
    )

    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().tenant == "unknown"


# The test's own database access runs in asgiref's sync thread, whose
# connection is closed each time (PostgreSQL would not drop the test
# database while that thread still holds a session).
@sync_to_async
def charges_and_states() -> tuple[int, list[str]]:
    try:
        states = list(IdempotencyRecord.objects.values_list("state", flat=True))
        return Charge.objects.count(), states
    finally:
        connections.close_all()


async def test_an_async_operation_is_protected_through_asgi() -> None:
    client = AsyncClient()
    headers = {"X-API-Key": KEY, "Idempotency-Key": "async-1"}
    body = json.dumps({"amount": 5})

    first, retry = [
        await client.post(
            "/ninja-mw/async-orders", body, content_type="application/json", headers=headers
        )
        for _ in range(2)
    ]

    assert first.status_code == 201
    assert retry.content == first.content and retry["Idempotent-Replayed"] == "true"
    assert await charges_and_states() == (1, [State.COMPLETED])


@pytest.mark.usefixtures("atomic_requests")
def test_under_atomic_requests_the_claim_commits_before_the_operation_runs(
    client: Client,
) -> None:
    response = post(client, "/ninja-mw/probe", "probe-1")

    # Another connection sees the claim while the operation runs: committed.
    assert response.json() == {"record_states": [State.CLAIMED], "in_atomic_block": True}


# -- what lists the protected operations ---------------------------------------------------


def test_the_checks_and_metrics_know_the_operations_the_middleware_protects(
    settings: Any,
) -> None:
    names = protected_operations()

    assert {
        "POST ninja-mw/orders",
        "PUT ninja-mw/orders/<int:pk>",
        "POST ninja-mw/async-orders",
        "ninja order with its own options",
    } <= names
    assert "POST ninja-mw/exempt" not in names
    settings.DATABASES["default"]["ATOMIC_REQUESTS"] = True
    try:
        warned = {str(message.obj) for message in check_atomic_requests()}
    finally:
        settings.DATABASES["default"]["ATOMIC_REQUESTS"] = False
    # Its own @idempotent's included (W002 names it without the middleware:
    # test_ninja.py): the middleware exempts every Ninja URL with a protected operation.
    assert warned == set()


def test_idempotency_routes_says_what_protects_each_ninja_operation() -> None:
    out = StringIO()
    call_command("idempotency_routes", stdout=out)
    text = out.getvalue()

    blocks = {block.split("  (")[0]: block for block in text.split("\n\n")}
    assert (
        "protected by the middleware, operation POST ninja-mw/orders" in blocks["ninja-mw/orders"]
    )
    assert "not protected: idempotent_exempt" in blocks["ninja-mw/exempt"]
    assert (
        "protected by @idempotent, operation ninja order with its own options"
        in (blocks["ninja-mw/own"])
    )
    # One route per path, however many operations (and URL patterns) Ninja gives it.
    assert text.count("\nninja-mw/orders  (") == 1


def test_ninjas_schema_documents_the_operations_from_the_first_request_on(
    client: Client,
) -> None:
    schema = client.get("/ninja-mw/openapi.json").json()  # the process's first request, maybe

    headers = [
        parameter["name"]
        for parameter in schema["paths"]["/ninja-mw/orders"]["post"]["parameters"]
        if parameter["in"] == "header"
    ]
    assert headers == ["Idempotency-Key"]
    assert "409" in schema["paths"]["/ninja-mw/orders"]["post"]["responses"]
    assert "parameters" not in schema["paths"]["/ninja-mw/exempt"]["post"] or not [
        p for p in schema["paths"]["/ninja-mw/exempt"]["post"]["parameters"] if p["in"] == "header"
    ]


def test_with_required_keys_ninjas_schema_requires_the_key_only_where_a_keyless_request_is_refused(
    client: Client, settings: Any
) -> None:
    """Without TENANT an anonymous request runs unprotected where Ninja lets one in (auth=None)."""
    configure(settings, MIDDLEWARE_KEYS="required")
    settings.ROOT_URLCONF = "tests.testapp.ninja_required_keys_urls"
    paths = client.get("/ninja-required/openapi.json").json()["paths"]

    def key_header(path: str) -> dict[str, Any]:
        (header,) = [
            parameter
            for parameter in paths[path]["post"]["parameters"]
            if parameter["in"] == "header" and parameter["name"] == "Idempotency-Key"
        ]
        return dict(header)

    note = "Requests without authentication are not protected"
    assert key_header("/ninja-required/open")["required"] is False
    assert note in key_header("/ninja-required/open")["description"]
    assert key_header("/ninja-required/keyed")["required"] is True
    assert note not in key_header("/ninja-required/keyed")["description"]
    # What the server does: the anonymous keyless request runs, the keyed client's is refused.
    assert post(client, "/ninja-required/open", None, api_key=None).status_code == 201
    refused = post(client, "/ninja-required/keyed", None)
    assert (refused.status_code, refused.json()["code"]) == (400, "idempotency_key_missing")
