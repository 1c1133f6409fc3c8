"""``IdempotencyMiddleware`` and the decorators a view's route or handler carries.

Through the real Django test client and ``tests.testapp.decorated_view_urls``:
a decorator that wraps a DRF view's ``as_view()`` (or sits above
``@api_view``) still decides every request, keyed or not; ``@idempotent``
above ``@api_view`` and ``@idempotent`` through Django's
``method_decorator`` keep their own options and claim once; a method that
``http_method_names`` refuses is answered 405 with no record, and is not
listed as protected. The drf-spectacular schema documents the key header
on exactly the routes ``idempotency_routes`` lists as protected.
"""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from django_idempotency.exceptions import DurableTransactionInView
from django_idempotency.models import IdempotencyRecord
from tests.factories import UserFactory
from tests.testapp.models import Charge
from tests.utils import post

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
BASE = tuple(django_settings.MIDDLEWARE)


def configure(settings: Any, **idempotency: Any) -> None:
    settings.MIDDLEWARE = [*BASE, MIDDLEWARE]
    settings.ROOT_URLCONF = "tests.testapp.decorated_view_urls"
    settings.IDEMPOTENCY = {"MIDDLEWARE_PLAIN_VIEW_PREFIXES": ["/plain-api/"], **idempotency}


@pytest.fixture(autouse=True)
def middleware(settings: Any) -> None:
    configure(settings)


def logged_in(user: User) -> APIClient:
    """A client with ``user``'s session: DRF's SessionAuthentication and Django's user agree."""
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture
def user() -> User:
    user: User = UserFactory.create()
    return user


def records() -> list[tuple[str, str]]:
    return sorted(IdempotencyRecord.objects.values_list("operation", "state"))


def routes() -> dict[str, dict[str, Any]]:
    """``idempotency_routes --format json``, by route, each method by name."""
    out = StringIO()
    call_command("idempotency_routes", format="json", stdout=out)
    return {
        route["route"]: {method["method"]: method for method in route["methods"]}
        for route in json.loads(out.getvalue())["routes"]
    }


# -- a decorator of the route ----------------------------------------------------------


@pytest.mark.parametrize("url", ["/api/gated/payments", "/api/gated/function"])
@pytest.mark.parametrize("key", [None, "pay-1"], ids=["keyless", "keyed"])
def test_a_decorator_around_the_view_refuses_a_keyed_request_as_a_keyless_one(
    user: User, url: str, key: str | None
) -> None:
    response = post(logged_in(user), url, {"amount": 5}, key)

    assert response.status_code == 403
    assert Charge.objects.count() == 0
    assert records() == []


@pytest.mark.parametrize("url", ["/api/gated/payments", "/api/gated/function"])
def test_a_decorator_around_the_view_lets_through_whom_it_allows(user: User, url: str) -> None:
    user.user_permissions.add(Permission.objects.get(codename="add_charge"))

    response = post(logged_in(user), url, {"amount": 5}, "pay-1")

    assert response.status_code == 201
    assert Charge.objects.count() == 1


def test_idempotency_routes_says_why_a_decorated_route_is_left_to_the_view() -> None:
    listed = routes()

    for route in ("api/gated/payments", "api/gated/function"):
        assert listed[route]["POST"]["protected"] is False
        assert "decorator" in listed[route]["POST"]["reason"]
        assert "IdempotentMixin" in listed[route]["POST"]["reason"]
    assert listed["api/payments"]["POST"]["by"] == "middleware"


@pytest.mark.parametrize("url", ["/api/csrf-exempt/payments", "/api/dispatch-decorated"])
def test_csrf_exempt_around_the_view_and_decorators_of_the_class_keep_it_protected(
    user: User, url: str
) -> None:
    client = logged_in(user)
    first = post(client, url, {"amount": 5}, "pay-1")
    retry = post(client, url, {"amount": 5}, "pay-1")

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert records() == [(f"POST {url.removeprefix('/')}", State.COMPLETED)]
    if url == "/api/dispatch-decorated":
        assert "no-store" in first["Cache-Control"]  # never_cache on dispatch ran


def test_an_exempt_decorated_route_says_it_is_exempt() -> None:
    assert routes()["api/gated/exempt"]["POST"]["reason"] == "idempotent_exempt"


# -- @idempotent the middleware cannot see on the class ----------------------------------


def test_idempotent_above_api_view_keeps_its_options_and_claims_once(user: User) -> None:
    client = logged_in(user)
    first = post(client, "/api/under-idempotent", {"amount": 5}, "pay-1")
    retry = post(client, "/api/under-idempotent", {"amount": 5}, "pay-1")

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert records() == [("api view under its own idempotent", State.COMPLETED)]
    assert routes()["api/under-idempotent"]["POST"]["by"] == "decorator"


@pytest.mark.parametrize(
    ("url", "operation"),
    [
        ("/plain-api/method-decorated", "POST plain-api/method-decorated"),
        ("/api/method-decorated", "POST api/method-decorated"),
        ("/api/method-decorated-options", "method-decorated with options"),
    ],
)
def test_idempotent_through_method_decorator_claims_once(
    user: User, url: str, operation: str
) -> None:
    client = logged_in(user)
    first = post(client, url, {"amount": 5}, "pay-1")
    retry = post(client, url, {"amount": 5}, "pay-1")

    assert first.status_code == 201, first.content
    assert (retry.status_code, retry.content) == (201, first.content)
    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1
    assert records() == [(operation, State.COMPLETED)]
    assert routes()[url.removeprefix("/")]["POST"]["by"] == "decorator"


def test_idempotent_through_method_decorator_keeps_its_required_option(
    settings: Any, user: User
) -> None:
    configure(settings, MIDDLEWARE_KEYS="required", REQUIRED=False)

    response = post(logged_in(user), "/api/method-decorated", {"amount": 5}, None)

    assert response.status_code == 201
    assert records() == []


# -- http_method_names -----------------------------------------------------------------


@pytest.mark.parametrize("url", ["/plain-api/get-only", "/api/get-only"])
def test_a_method_http_method_names_refuses_is_answered_405_without_a_record(
    user: User, url: str
) -> None:
    response = post(logged_in(user), url, {"amount": 5}, "pay-1")

    assert response.status_code == 405
    assert (Charge.objects.count(), records()) == (0, [])
    assert routes()[url.removeprefix("/")] == {}


# -- a view that keeps its own transactions --------------------------------------------


def test_a_durable_block_the_middleware_cannot_nest_names_idempotent_exempt_as_the_way_out(
    user: User,
) -> None:
    """Keyless, it runs as before; keyed, Django refuses its block: the error says what to do."""
    client = logged_in(user)
    assert post(client, "/api/durable", {"amount": 5}, None).status_code == 201

    with pytest.raises(DurableTransactionInView) as refused:
        post(client, "/api/durable", {"amount": 5}, "pay-1")

    message = str(refused.value)
    assert "DurableBlockAPIView.post" in message
    assert "IdempotencyMiddleware" in message and "idempotent_exempt" in message
    assert (Charge.objects.count(), records()) == (1, [])


# -- the OpenAPI schema ----------------------------------------------------------------


def schema_paths() -> dict[str, Any]:
    generator = SchemaGenerator()  # type: ignore[no-untyped-call]
    generated: dict[str, Any] = generator.get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
    return dict(generated["paths"])


def key_header(operation: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (
            parameter
            for parameter in operation.get("parameters", [])
            if parameter["in"] == "header" and parameter["name"] == "Idempotency-Key"
        ),
        None,
    )


@pytest.mark.parametrize(
    "path",
    [
        "/api/gated/payments",
        "/api/gated/function",
        "/api/never-cache/payments",
        "/api/gated/exempt",
        "/api/exempt-route/payments",
    ],
)
def test_the_schema_documents_no_key_where_the_route_leaves_the_view_unprotected(
    path: str,
) -> None:
    operation = schema_paths()[path]["post"]

    assert key_header(operation) is None
    assert not {"409", "422", "503"} & set(operation["responses"])


@pytest.mark.parametrize(
    "path",
    [
        "/api/payments",
        "/api/csrf-exempt/payments",
        "/api/dispatch-decorated",
        "/api/under-idempotent",
        "/api/method-decorated",
    ],
)
def test_the_schema_documents_the_key_where_the_route_keeps_the_view_protected(
    path: str,
) -> None:
    operation = schema_paths()[path]["post"]

    assert key_header(operation) is not None
    assert {"409", "422", "503"} <= set(operation["responses"])


def test_the_schema_documents_the_key_exactly_where_idempotency_routes_lists_protection() -> None:
    paths = schema_paths()
    compared = 0

    for route, methods in routes().items():
        for method, listed in methods.items():
            operation = paths.get(f"/{route}", {}).get(method.lower())
            if operation is None:
                continue  # a plain Django view: not in DRF's schema
            assert (key_header(operation) is not None) is listed["protected"], (route, method)
            compared += 1
    assert compared >= 10
