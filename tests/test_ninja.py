"""Django Ninja operations protected by ``django_idempotency.ninja``, through real Ninja APIs.

The APIs are tests/testapp/ninja_api.py, served by their own URLconf
(tests.testapp.ninja_urls). Their operations authenticate with an API key
(``X-API-Key``), which Ninja's authentication returns as a string.
"""

from __future__ import annotations

import json
import sys
import threading
import types
from collections.abc import Callable, Iterator
from io import StringIO
from typing import Any

import ninja
import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client, RequestFactory
from django.urls import URLPattern, path
from ninja import NinjaAPI, Router

from django_idempotency import recovery
from django_idempotency._ninja.answers import refusal_response
from django_idempotency._observability.labels import OTHER, operation_label
from django_idempotency._protection.flow import Options
from django_idempotency._routes import protected_operations
from django_idempotency._store.digests import tenant_digest
from django_idempotency._view_checks import check_atomic_requests, check_operations
from django_idempotency.exceptions import IdempotencyRefusal, RequestInProgress
from django_idempotency.models import IdempotencyRecord
from django_idempotency.ninja import idempotent, protect_view
from django_idempotency.recovery import Completed
from tests.factories import TokenFactory
from tests.testapp import ninja_api
from tests.testapp.models import Charge

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.urls("tests.testapp.ninja_urls"),
]

State = IdempotencyRecord.State
KEY_A, KEY_B = ninja_api.API_KEYS
URL = "/ninja/charges"


def post(
    client: Client,
    url: str,
    body: dict[str, Any],
    key: str | None,
    *,
    api_key: str | None = KEY_A,
    **headers: str,
) -> Any:
    if key is not None:
        headers["Idempotency-Key"] = key
    if api_key is not None:
        headers["X-API-Key"] = api_key
    return client.post(url, json.dumps(body), content_type="application/json", headers=headers)


@pytest.fixture
def client() -> Client:
    return Client(raise_request_exception=False)


def records() -> list[IdempotencyRecord]:
    return list(IdempotencyRecord.objects.order_by("pk"))


# -- the behaviour table ----------------------------------------------------------------


def test_first_execution_runs_once_and_the_retry_gets_the_same_bytes(client: Client) -> None:
    first = post(client, URL, {"amount": 100}, "order-1")
    retry = post(client, URL, {"amount": 100}, "order-1")

    assert first.status_code == 201 and first["Idempotency-Key"] == "order-1"
    assert not first.has_header("Idempotent-Replayed")
    assert (retry.status_code, retry.content) == (first.status_code, first.content)
    assert retry["Content-Type"] == first["Content-Type"]
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    [record] = records()
    assert (record.operation, record.state) == ("POST ninja/charges", State.COMPLETED)


def test_a_missing_key_is_refused_with_400_the_way_ninja_answers_errors(client: Client) -> None:
    response = post(client, URL, {"amount": 100}, None)

    assert response.status_code == 400
    assert response["Content-Type"] == "application/json; charset=utf-8"
    body = response.json()
    assert body["code"] == "idempotency_key_missing"
    assert "Idempotency-Key" in body["detail"]
    assert (Charge.objects.count(), records()) == (0, [])


@pytest.mark.parametrize("key", ["", "x" * 256, "key-\u00e9", "two words"])
def test_an_invalid_key_is_refused_with_400(client: Client, key: str) -> None:
    response = post(client, URL, {"amount": 100}, key)

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_invalid"
    assert (Charge.objects.count(), records()) == (0, [])


def test_another_body_under_the_same_key_is_refused_with_422(client: Client) -> None:
    post(client, URL, {"amount": 100}, "order-1")

    response = post(client, URL, {"amount": 999}, "order-1")

    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1


def test_a_duplicate_while_the_first_is_in_flight_gets_409_and_retry_after(
    client: Client,
) -> None:
    post(client, URL, {"amount": 100}, "order-1")
    IdempotencyRecord.objects.update(state=State.CLAIMED)

    response = post(client, URL, {"amount": 100}, "order-1")

    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"
    assert response["Retry-After"] == "1"
    assert Charge.objects.count() == 1


@pytest.fixture
def held() -> Iterator[None]:
    ninja_api.entered.clear()
    ninja_api.release.clear()
    yield
    ninja_api.release.set()


@pytest.mark.postgres
@pytest.mark.usefixtures("held")
def test_a_concurrent_duplicate_gets_409_while_the_first_runs() -> None:
    answers: list[Any] = []

    def first() -> None:
        try:
            answers.append(post(Client(), "/ninja/held", {"amount": 5}, "order-1"))
        finally:
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    assert ninja_api.entered.wait(timeout=20)

    duplicate = post(Client(), "/ninja/held", {"amount": 5}, "order-1")
    ninja_api.release.set()
    thread.join(timeout=20)
    retry = post(Client(), "/ninja/held", {"amount": 5}, "order-1")

    assert duplicate.status_code == 409
    assert duplicate.json()["code"] == "idempotency_request_in_progress"
    assert int(duplicate["Retry-After"]) >= 1
    assert [answer.status_code for answer in answers] == [201]
    assert retry.content == answers[0].content and retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


def test_a_4xx_the_operation_raises_is_stored_and_replayed(client: Client) -> None:
    first = post(client, URL, {"amount": 100, "fail": 404}, "order-1")
    retry = post(client, URL, {"amount": 100, "fail": 404}, "order-1")

    assert first.status_code == 404
    assert first.json() == {"detail": "failed with 404 after writing"}
    assert (retry.status_code, retry.content) == (404, first.content)
    assert retry["Idempotent-Replayed"] == "true"
    assert [record.state for record in records()] == [State.FAILED]
    assert Charge.objects.count() == 1  # stored with the operation's writes


def test_a_5xx_releases_the_claim_and_rolls_the_writes_back(client: Client) -> None:
    failed = post(client, URL, {"amount": 100, "fail": 503}, "order-1")
    retry = post(client, URL, {"amount": 100}, "order-1")

    assert failed.status_code == 503
    assert retry.status_code == 201 and not retry.has_header("Idempotent-Replayed")
    assert Charge.objects.count() == 1
    assert [record.state for record in records()] == [State.COMPLETED]


def test_input_ninja_refuses_claims_nothing_and_the_corrected_retry_runs(client: Client) -> None:
    refused = post(client, URL, {"amount": "not a number"}, "order-1")

    assert refused.status_code == 422
    assert isinstance(refused.json()["detail"], list)  # Ninja's validation error
    assert records() == []
    corrected = post(client, URL, {"amount": 100}, "order-1")
    assert corrected.status_code == 201


@pytest.mark.parametrize("api_key", [None, "not-a-key"])
def test_a_failed_authentication_is_answered_401_before_any_claim(
    client: Client, api_key: str | None
) -> None:
    response = post(client, URL, {"amount": 100}, "order-1", api_key=api_key)

    assert response.status_code == 401
    assert response.json() == {"detail": "Unauthorized"}
    assert (Charge.objects.count(), records()) == (0, [])


def test_a_request_ninjas_throttle_refuses_is_answered_429_before_any_claim(
    client: Client,
) -> None:
    response = post(client, URL, {"amount": 100}, "order-1", **{"X-Throttle": "refuse"})

    assert response.status_code == 429
    assert (Charge.objects.count(), records()) == (0, [])


def test_url_arguments_are_input_and_a_literal_operation_name_is_the_records(
    client: Client,
) -> None:
    first = post(client, "/ninja/charges/7", {"amount": 100}, "order-1")
    other_account = post(client, "/ninja/charges/8", {"amount": 100}, "order-1")

    assert first.status_code == 201
    assert other_account.status_code == 422
    [record] = records()
    assert record.operation == "ninja charge of an account"


def test_refusals_follow_the_problem_details_setting(client: Client, settings: Any) -> None:
    settings.IDEMPOTENCY = {"ERROR_FORMAT": "problem"}

    response = post(client, URL, {"amount": 100}, None)

    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "idempotency_key_missing"


def test_a_handler_the_api_registers_for_refusals_renders_them() -> None:
    api = NinjaAPI(urls_namespace="ninja_refusal_handler")

    @api.exception_handler(IdempotencyRefusal)
    def refused(request: HttpRequest, exc: IdempotencyRefusal) -> Any:
        return api.create_response(request, {"error": exc.default_code}, status=exc.status_code)

    request = RequestFactory().post("/")
    response = refusal_response(api, request, RequestInProgress(retry_after=1))

    assert isinstance(response, HttpResponse) and response.status_code == 409
    assert json.loads(response.content) == {"error": "idempotency_request_in_progress"}
    assert response["Retry-After"] == "1"  # part of the answer, whatever renders it


# -- who the tenant is --------------------------------------------------------------------


def test_a_string_credential_names_the_tenant_by_a_keyed_digest_never_raw(
    client: Client,
) -> None:
    post(client, URL, {"amount": 100}, "order-1", api_key=KEY_A)
    other_client = post(client, URL, {"amount": 100}, "order-1", api_key=KEY_B)

    assert other_client.status_code == 201  # one client's key never replays another's
    assert not other_client.has_header("Idempotent-Replayed")
    tenants = [record.tenant for record in records()]
    assert tenants == [f"auth:{tenant_digest(KEY_A)}", f"auth:{tenant_digest(KEY_B)}"]
    for row in IdempotencyRecord.objects.values():
        stored = json.dumps(row, default=str)
        assert KEY_A not in stored and KEY_B not in stored, row


def test_a_user_that_ninjas_authentication_returns_is_the_tenant(client: Client) -> None:
    token = TokenFactory.create()

    response = post(
        client,
        "/ninja/user-charges",
        {"amount": 100},
        "order-1",
        api_key=None,
        Authorization=f"Bearer {token.key}",
    )

    assert response.status_code == 201
    assert response.json()["tenant"] == f"user:{token.user.pk}"
    assert [record.tenant for record in records()] == [f"user:{token.user.pk}"]


def test_the_tenant_setting_wins_when_the_project_sets_one(client: Client, settings: Any) -> None:
    settings.IDEMPOTENCY = {"TENANT": lambda request: "organisation-1"}

    post(client, URL, {"amount": 100}, "order-1")

    assert [record.tenant for record in records()] == ["organisation-1"]


# -- async operations ---------------------------------------------------------------------


async def send_async(client: AsyncClient, body: dict[str, Any], key: str | None) -> Any:
    headers = {"X-API-Key": KEY_A}
    if key is not None:
        headers["Idempotency-Key"] = key
    return await client.post(
        "/ninja/async-charges", json.dumps(body), content_type="application/json", headers=headers
    )


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


@sync_to_async
def mark_in_flight() -> None:
    try:
        IdempotencyRecord.objects.update(state=State.CLAIMED)
    finally:
        connections.close_all()


async def test_an_async_operation_runs_once_and_refuses_as_the_sync_one() -> None:
    """Through Django's ASGI handler; an ORM call on the event loop would raise there."""
    client = AsyncClient()
    first = await send_async(client, {"amount": 5}, "k")
    retry = await send_async(client, {"amount": 5}, "k")
    mismatch = await send_async(client, {"amount": 6}, "k")
    missing = await send_async(client, {"amount": 5}, None)
    await mark_in_flight()
    in_flight = await send_async(client, {"amount": 5}, "k")

    assert first.status_code == 201 and first["Idempotency-Key"] == "k"
    assert retry.content == first.content and retry["Idempotent-Replayed"] == "true"
    assert (mismatch.status_code, mismatch.json()["code"]) == (422, "idempotency_key_reused")
    assert (missing.status_code, missing.json()["code"]) == (400, "idempotency_key_missing")
    assert (in_flight.status_code, in_flight["Retry-After"]) == (409, "1")
    assert await charges_and_states() == (1, [State.CLAIMED])


async def test_an_async_operations_writes_roll_back_with_a_released_claim() -> None:
    client = AsyncClient()
    failed = await send_async(client, {"amount": 5, "fail": 500}, "k")

    assert failed.status_code == 500
    # Its acreate() ran in the transaction the release rolled back.
    assert await charges_and_states() == (0, [])
    retry = await send_async(client, {"amount": 5}, "k")
    assert retry.status_code == 201
    assert await charges_and_states() == (1, [State.COMPLETED])


# -- routers ----------------------------------------------------------------------------


@pytest.mark.skipif(not ninja_api.MOUNTS_TWICE, reason="Ninja mounts a router once before 1.6")
def test_a_router_mounted_twice_protects_each_copy(client: Client) -> None:
    answers = {
        mount: [post(client, f"/ninja/{mount}/orders", {"amount": 5}, "order-1") for _ in range(2)]
        for mount in ("first", "second")
    }
    missing = post(client, "/ninja/second/orders", {"amount": 5}, None)

    for first, retry in answers.values():
        assert first.status_code == 201
        assert retry.content == first.content and retry["Idempotent-Replayed"] == "true"
    assert missing.status_code == 400
    assert Charge.objects.filter(tenant="order").count() == 2
    assert [record.operation for record in records()] == [
        "POST ninja/first/orders",
        "POST ninja/second/orders",
    ]


def test_add_decorator_protects_every_unsafe_operation_of_a_router(client: Client) -> None:
    missing = post(client, "/ninja/routed/notes", {"amount": 5}, None)
    first = post(client, "/ninja/routed/notes", {"amount": 5}, "note-1")
    retry = post(client, "/ninja/routed/notes", {"amount": 5}, "note-1")
    listed = client.get("/ninja/routed/notes", headers={"X-API-Key": KEY_A})

    assert (missing.status_code, missing.json()["code"]) == (400, "idempotency_key_missing")
    assert first.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert listed.status_code == 200 and listed.json() == [first.json()["id"]]
    assert [record.operation for record in records()] == ["POST ninja/routed/notes"]


def test_add_decorator_on_the_api_protects_its_operations_with_its_options(
    client: Client,
) -> None:
    keyless = client.put(
        "/ninja/api-level",
        json.dumps({"amount": 5}),
        content_type="application/json",
        headers={"X-API-Key": KEY_A},
    )
    first, retry = (
        client.put(
            "/ninja/api-level",
            json.dumps({"amount": 5}),
            content_type="application/json",
            headers={"X-API-Key": KEY_A, "Idempotency-Key": "put-1"},
        )
        for _ in range(2)
    )

    assert keyless.status_code == 201  # the API's required=False
    assert first.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content
    assert [record.operation for record in records()] == ["PUT ninja/api-level"]
    # Under it, the router's own add_decorator (required=True) wins
    # (test_add_decorator_protects_every_unsafe_operation_of_a_router), and
    # an operation's own @idempotent wins over both (the next test).


def test_a_nested_routers_add_decorator_wins_over_its_parents(client: Client) -> None:
    keyless = post(client, "/ninja/routed/nested/notes", {"amount": 5}, None)  # required=False
    keyed = post(client, "/ninja/routed/nested/notes", {"amount": 5}, "note-1")

    assert (keyless.status_code, keyed.status_code) == (201, 201)
    assert [record.operation for record in records()] == ["ninja nested note"]


def test_an_operations_own_decorator_keeps_its_options_under_a_protected_router(
    client: Client,
) -> None:
    keyless = post(client, "/ninja/routed/own-options", {"amount": 5}, None)  # required=False
    keyed = post(client, "/ninja/routed/own-options", {"amount": 5}, "note-1")

    assert (keyless.status_code, keyed.status_code) == (201, 201)
    assert [record.operation for record in records()] == ["ninja note with its own options"]


def test_add_decorator_in_its_default_mode_is_refused_rather_than_protecting_nothing() -> None:
    router = Router()

    @router.post("/refused")
    def refused(request: HttpRequest) -> int:
        return 1

    router.add_decorator(idempotent)  # mode="operation": given the function, not the operation
    api = NinjaAPI(urls_namespace="ninja_refused_mode")

    with pytest.raises(ImproperlyConfigured, match='mode="view"'):
        api.add_router("/", router)  # where Ninja before 1.6 applies the decorators
        api.urls  # noqa: B018  (where Ninja 1.6+ does)


def test_idempotent_above_the_route_decorator_is_refused() -> None:
    router = Router()

    with pytest.raises(ImproperlyConfigured, match="directly under the route decorator"):

        @idempotent
        @router.post("/above")
        def above(request: HttpRequest) -> int:
            return 1


@pytest.fixture
def project_wide(settings: Any) -> Iterator[list[Callable[..., Any]]]:
    """A NinjaAPI nothing protects yet, at ``/project/`` in a URLconf of its own; its views."""
    api = NinjaAPI(urls_namespace="ninja_project_wide", auth=ninja_api.ApiKey())

    @api.post("/plain", response={201: ninja_api.ChargeOut})
    def plain(request: HttpRequest, charge: ninja_api.ChargeIn) -> dict[str, Any]:
        return ninja_api._charge(request, charge, tenant="plain")

    @api.get("/plain", response=int)
    def count(request: HttpRequest) -> int:
        return Charge.objects.count()

    @api.post("/own", response={201: ninja_api.ChargeOut})
    @idempotent(required=False, operation="its own name")
    def own(request: HttpRequest, charge: ninja_api.ChargeIn) -> dict[str, Any]:
        return ninja_api._charge(request, charge, tenant="own")

    @api.post("/excused", response={201: ninja_api.ChargeOut})
    def excused(request: HttpRequest, charge: ninja_api.ChargeIn) -> dict[str, Any]:
        return ninja_api._charge(request, charge, tenant="excused")

    urls = api.urls
    urlconf = types.ModuleType("tests.ninja_project_wide_urls")
    urlconf.urlpatterns = [path("project/", urls)]  # type: ignore[attr-defined]
    sys.modules[urlconf.__name__] = urlconf
    settings.ROOT_URLCONF = urlconf.__name__
    try:
        yield [pattern.callback for pattern in urls[0] if isinstance(pattern, URLPattern)]
    finally:
        del sys.modules[urlconf.__name__]


def test_protect_view_protects_each_unsafe_operation_once_for_project_wide_protection(
    client: Client, project_wide: list[Callable[..., Any]]
) -> None:
    """What a project-wide middleware calls with a URL's view, at each request."""
    views = project_wide

    def excused(function: Callable[..., Any]) -> bool:
        return getattr(function, "__name__", "") == "excused"

    for _ in range(2):  # again at the next request: nothing changes
        ninja_views = {view for view in views if protect_view(view, Options(), exempt=excused)}
        # One URL pattern per operation; the API's docs and schema views are no Ninja path's.
        assert len(ninja_views) == 4 and len(views) > 4

    missing = post(client, "/project/plain", {"amount": 5}, None)
    first, retry = (post(client, "/project/plain", {"amount": 5}, "k-1") for _ in range(2))
    own_keyless = post(client, "/project/own", {"amount": 5}, None)
    own = post(client, "/project/own", {"amount": 5}, "k-1")
    excused_keyless = post(client, "/project/excused", {"amount": 5}, None)
    listed = client.get("/project/plain", headers={"X-API-Key": KEY_A})

    assert missing.status_code == 400
    assert first.status_code == 201 and retry["Idempotent-Replayed"] == "true"
    assert (own_keyless.status_code, own.status_code) == (201, 201)  # its own options
    assert excused_keyless.status_code == 201
    assert listed.status_code == 200
    assert [record.operation for record in records()] == ["POST project/plain", "its own name"]
    # Exempt from ATOMIC_REQUESTS where an operation is protected (the
    # protection opens its transactions): all but the excused one's path.
    exempt = [view for view in ninja_views if hasattr(view, "_non_atomic_requests")]
    assert len(exempt) == 3


@pytest.mark.skipif(not hasattr(ninja, "JSONL"), reason="Ninja streams responses from 1.6")
def test_protecting_an_operation_that_streams_its_response_is_refused() -> None:
    router = Router()

    with pytest.raises(ImproperlyConfigured, match="streams its response"):

        @router.post("/stream", response=ninja.JSONL[int])
        @idempotent
        def stream(request: HttpRequest) -> Iterator[int]:
            yield 1


# -- what describes the operations -------------------------------------------------------


def test_the_openapi_schema_has_the_key_header_and_the_refusals() -> None:
    paths = ninja_api.api.get_openapi_schema()["paths"]
    charges = paths["/ninja/charges"]["post"]
    own_options = paths["/ninja/routed/own-options"]["post"]

    [header] = [p for p in charges["parameters"] if p["in"] == "header"]
    assert (header["name"], header["required"]) == ("Idempotency-Key", True)
    responses = charges["responses"]
    assert {"201", "400", "409", "413", "422", "503"} <= {str(code) for code in responses}
    by_code = {str(code): response for code, response in responses.items()}
    assert "idempotency_key_reused" in by_code["422"]["description"]
    error = by_code["409"]["content"]["application/json"]["schema"]
    assert set(error["required"]) == {"detail", "code"}
    assert "Retry-After" in by_code["409"]["headers"]
    assert "Idempotent-Replayed" in by_code["201"]["headers"]
    assert "$ref" in by_code["201"]["content"]["application/json"]["schema"]  # Ninja's own
    routed_notes = paths["/ninja/routed/notes"]["post"]
    [routed] = [p for p in routed_notes["parameters"] if p["in"] == "header"]
    assert routed["required"] is True  # the router's add_decorator(idempotent(required=True))
    [optional] = [p for p in own_options["parameters"] if p["in"] == "header"]
    assert optional["required"] is False
    assert "parameters" not in paths["/ninja/routed/notes"]["get"] or not [
        p for p in paths["/ninja/routed/notes"]["get"]["parameters"] if p["in"] == "header"
    ]


def test_idempotency_routes_names_what_protects_each_operation_and_ninjas_own_views(
    settings: Any,
) -> None:
    settings.ROOT_URLCONF = "tests.testapp.ninja_urls"
    out = StringIO()
    call_command("idempotency_routes", stdout=out)
    blocks = {block.split("  (")[0]: block for block in out.getvalue().split("\n\n")}

    by_router = "protected by a Router's or NinjaAPI's add_decorator, operation"
    assert (
        f"POST                    {by_router} POST ninja/routed/notes"
        in blocks["ninja/routed/notes"]
    )
    assert f"PUT                     {by_router} PUT ninja/api-level" in blocks["ninja/api-level"]
    assert by_router in blocks["ninja/routed/nested/notes"]
    assert "protected by @idempotent, operation POST ninja/charges" in blocks["ninja/charges"]
    assert (
        "protected by @idempotent, operation ninja note with its own options"
        in (blocks["ninja/routed/own-options"])
    )
    # Ninja routes its schema and docs through functools.partial: named by the function.
    assert blocks["ninja/openapi.json"].startswith(
        "ninja/openapi.json  (ninja.openapi.views.openapi_json)"
    )
    assert blocks["ninja/docs"].startswith("ninja/docs  (ninja.openapi.views.openapi_view)")
    assert "functools.partial" not in out.getvalue()


def test_the_checks_and_the_metrics_know_the_protected_operations(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.ROOT_URLCONF = "tests.testapp.ninja_urls"
    names = protected_operations()

    assert {
        "POST ninja/charges",
        "ninja charge of an account",
        "POST ninja/routed/notes",
        "POST ninja/async-charges",
        "POST ninja-transactions/probe",
    } <= names
    assert "GET ninja/routed/notes" not in names
    assert operation_label("POST ninja/routed/notes") == "POST ninja/routed/notes"
    assert operation_label("POST ninja/not-an-operation") == OTHER

    monkeypatch.setattr(recovery, "_reconcilers", {})

    def settle(record: IdempotencyRecord) -> Completed:
        return Completed(status=200)

    recovery.register_reconciler("ninja charge of an account")(settle)
    recovery.register_reconciler("POST ninja/charge")(settle)
    [warning] = check_operations()
    assert warning.id == "django_idempotency.W004"
    assert "'POST ninja/charge'" in warning.msg and "'POST ninja/charges'" in str(warning.hint)


# -- ATOMIC_REQUESTS ----------------------------------------------------------------------


@pytest.mark.usefixtures("atomic_requests")
def test_under_atomic_requests_the_claim_commits_before_the_operation_runs(
    client: Client,
) -> None:
    """``non_atomic_requests(api.urls)``: the protection opens the transaction, after the claim."""
    protected = post(client, "/ninja-transactions/probe", {}, "probe-1")
    unprotected = client.get("/ninja-transactions/probe", headers={"X-API-Key": KEY_A})

    # Another connection sees the claim while the operation runs: committed.
    assert protected.status_code == 201
    assert protected.json() == {"record_states": [State.CLAIMED], "in_atomic_block": True}
    # The API's unprotected operation still runs in Django's transaction.
    assert unprotected.json()["in_atomic_block"] is True
    assert [record.state for record in records()] == [State.COMPLETED]


@pytest.mark.usefixtures("atomic_requests")
def test_w002_names_the_ninja_operations_left_inside_atomic_requests(settings: Any) -> None:
    settings.ROOT_URLCONF = "tests.testapp.ninja_urls"

    warned = {str(message.obj): message for message in check_atomic_requests()}

    assert "tests.testapp.ninja_api.create_charge" in warned
    assert "tests.testapp.ninja_api.transaction_probe" not in warned  # exempt
    hint = str(warned["tests.testapp.ninja_api.create_charge"].hint)
    assert "non_atomic_requests(api.urls)" in hint
