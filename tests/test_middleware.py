"""``IdempotencyMiddleware``: a whole API protected by one line of MIDDLEWARE, and its rollout.

Through the real Django test client and the URLconf of
``tests.testapp.middleware_urls``, whose views protect nothing themselves
(but those under ``api/own/``): every row of the behaviour table on each
kind of DRF view, the report-only rollout and the required mode, what the
middleware leaves alone (exempt views, credential views, anonymous
requests, safe methods, plain views outside the prefixes, the admin), a
view protected once when it also protects itself, ATOMIC_REQUESTS, a
generated API of thirty views, and the query budget of the mixin.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.db import connection, connections
from django.test import Client
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.drf import IdempotentMixin
from django_idempotency.middleware import IdempotencyMiddleware
from django_idempotency.models import IdempotencyRecord
from tests.factories import TokenFactory, UserFactory
from tests.telemetry import Readings, installed
from tests.testapp import many_views, middleware_views
from tests.testapp.models import Charge
from tests.utils import TokenClient, post, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
PLAIN_PREFIX = "/plain-api/"
#: The suite's MIDDLEWARE, without this one.
BASE = tuple(django_settings.MIDDLEWARE)

#: One route of each kind of DRF view, with the operation its records get.
DRF_KINDS = {
    "APIView": ("/api/payments", "POST api/payments"),
    "generic view": ("/api/generic/payments", "POST api/generic/payments"),
    "viewset": ("/api/viewset/payments/", "POST ^api/viewset/payments"),
    "@api_view": ("/api/function/payments", "POST api/function/payments"),
}


def configure(settings: Any, **idempotency: Any) -> None:
    settings.MIDDLEWARE = [*BASE, MIDDLEWARE]
    settings.ROOT_URLCONF = "tests.testapp.middleware_urls"
    settings.IDEMPOTENCY = {"MIDDLEWARE_PLAIN_VIEW_PREFIXES": [PLAIN_PREFIX], **idempotency}


@pytest.fixture(autouse=True)
def middleware(settings: Any) -> None:
    """The middleware last in MIDDLEWARE, on the middleware's URLconf, report-only."""
    configure(settings)


@pytest.fixture
def keys_required(settings: Any) -> None:
    configure(settings, MIDDLEWARE_KEYS="required")


@pytest.fixture
def client() -> TokenClient:
    """A client authenticated with a token of its own (made after the settings changed)."""
    return TokenClient(TokenFactory.create())


@pytest.fixture
def counted() -> Callable[..., float]:
    """How much an instrument's matching points rose since the test began."""
    reader, _ = installed()
    before = Readings(reader)
    return lambda name, **labels: (
        Readings(reader).value(name, **labels) - before.value(name, **labels)
    )


def records() -> list[tuple[str, str]]:
    return sorted(IdempotencyRecord.objects.values_list("operation", "state"))


# -- the behaviour table, on every kind of DRF view -------------------------------------


@pytest.fixture(params=list(DRF_KINDS), ids=list(DRF_KINDS))
def kind(request: pytest.FixtureRequest) -> tuple[str, str]:
    return DRF_KINDS[request.param]


def test_a_first_execution_is_claimed_and_echoes_the_key(
    client: TokenClient, kind: tuple[str, str]
) -> None:
    url, operation = kind
    response = post(client, url, {"amount": 5}, "pay-1")

    assert response.status_code == 201
    assert response["Idempotency-Key"] == "pay-1"
    assert "Idempotent-Replayed" not in response
    assert records() == [(operation, State.COMPLETED)]
    record = IdempotencyRecord.objects.get()
    assert (record.tenant, record.key) == (f"user:{client.user.pk}", "pay-1")


def test_a_retry_is_answered_with_the_replay(client: TokenClient, kind: tuple[str, str]) -> None:
    url, _ = kind
    first = post(client, url, {"amount": 5}, "pay-1")
    retry = post(client, url, {"amount": 5}, "pay-1")

    assert Charge.objects.count() == 1
    assert (retry.status_code, retry.content) == (first.status_code, first.content)
    assert retry["Idempotent-Replayed"] == "true"


def test_another_body_under_the_same_key_is_refused_with_422(
    client: TokenClient, kind: tuple[str, str]
) -> None:
    url, _ = kind
    post(client, url, {"amount": 5}, "pay-1")
    response = post(client, url, {"amount": 6}, "pay-1")

    assert response.status_code == 422
    assert response.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == 1


def test_a_retry_while_the_first_runs_is_refused_with_409(
    client: TokenClient, kind: tuple[str, str]
) -> None:
    url, _ = kind
    post(client, url, {"amount": 5}, "pay-1")
    IdempotencyRecord.objects.update(state=State.CLAIMED)

    response = post(client, url, {"amount": 5}, "pay-1")

    assert response.status_code == 409
    assert response.json()["code"] == "idempotency_request_in_progress"
    assert int(response["Retry-After"]) >= 1
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("key", ["", "x" * 256, "clé"], ids=["empty", "too-long", "not-ascii"])
def test_an_invalid_key_is_refused_with_400(
    client: TokenClient, kind: tuple[str, str], key: str
) -> None:
    url, _ = kind
    response = post(client, url, {"amount": 5}, key)

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_invalid"
    assert Charge.objects.count() == 0


@pytest.mark.postgres
def test_a_concurrent_duplicate_is_refused_with_409_while_the_first_holds_its_claim() -> None:
    """Two clients of one token, the first held in the view after its claim committed."""
    token = TokenFactory.create()
    middleware_views.held.clear()
    middleware_views.release.clear()
    answers: list[Any] = []

    def first() -> None:
        try:
            answers.append(post(TokenClient(token), "/api/held", {"amount": 5}, "race"))
        finally:
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert middleware_views.held.wait(30), "the first request never reached its view"
        duplicate = post(TokenClient(token), "/api/held", {"amount": 5}, "race")
    finally:
        middleware_views.release.set()
        thread.join(30)

    assert duplicate.status_code == 409
    assert duplicate.json()["code"] == "idempotency_request_in_progress"
    assert answers[0].status_code == 201
    assert Charge.objects.count() == 1
    assert records() == [("POST api/held", State.COMPLETED)]


def test_the_claim_comes_after_drfs_authentication_permissions_and_throttles(
    settings: Any, client: TokenClient
) -> None:
    """Refused by DRF, a request claims nothing, even with anonymous requests protected."""
    configure(settings, TENANT=lambda request: "everyone")
    url = "/api/guarded/payments"

    anonymous = post(APIClient(), url, {"amount": 5}, "k-anonymous")
    forged = APIClient()
    forged.credentials(HTTP_AUTHORIZATION="Token not-a-token")
    unknown = post(forged, url, {"amount": 5}, "k-forged")
    first = post(client, url, {"amount": 5}, "k-1")
    throttled = post(client, url, {"amount": 5}, "k-2")

    assert [r.status_code for r in (anonymous, unknown, first, throttled)] == [401, 401, 201, 429]
    assert records() == [("POST api/guarded/payments", State.COMPLETED)]
    assert IdempotencyRecord.objects.get().key == "k-1"


@pytest.mark.parametrize(
    ("method", "url", "body", "status"),
    [
        ("put", "/api/viewset/payments/{pk}/", {"amount": 9}, 200),
        ("patch", "/api/viewset/payments/{pk}/", {"amount": 9}, 200),
        ("delete", "/api/viewset/payments/{pk}/", None, 204),
        ("post", "/api/viewset/payments/{pk}/refund/", {}, 201),
        ("put", "/api/payments", {"amount": 9}, 200),
        ("delete", "/api/payments", {"amount": 9}, 204),
    ],
)
def test_every_unsafe_method_and_custom_action_is_protected(
    client: TokenClient, method: str, url: str, body: Any, status: int
) -> None:
    charge = Charge.objects.create(tenant=f"user:{client.user.pk}", amount=1)
    url = url.format(pk=charge.pk)
    send = getattr(client, method)

    first = send(url, body, format="json", HTTP_IDEMPOTENCY_KEY="k")
    retry = send(url, body, format="json", HTTP_IDEMPOTENCY_KEY="k")

    assert first.status_code == status, first.content
    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().operation.startswith(method.upper())


def test_safe_methods_are_not_protected(client: TokenClient) -> None:
    client.get("/api/payments", HTTP_IDEMPOTENCY_KEY="k")
    answer = client.get("/api/payments", HTTP_IDEMPOTENCY_KEY="k")

    assert answer.status_code == 200
    assert "Idempotent-Replayed" not in answer
    assert IdempotencyRecord.objects.count() == 0


# -- report-only: keyless requests run, counted and logged ------------------------------


def test_a_keyless_request_runs_unprotected_is_counted_and_names_its_client_in_the_log(
    client: TokenClient, counted: Callable[..., float], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="django_idempotency.middleware")
    token = Token.objects.get(user=client.user).key

    first = post(client, "/api/payments", {"amount": 5}, None)
    second = post(client, "/api/payments", {"amount": 5}, None)

    assert (first.status_code, second.status_code) == (201, 201)
    assert "Idempotency-Key" not in first
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 0
    assert counted("idempotency.keyless_requests", operation="POST api/payments") == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "django_idempotency.middleware"]
    assert len(lines) == 2
    assert f"sent by user:{client.user.pk}" in lines[0]
    assert "POST api/payments" in lines[0]
    assert token not in caplog.text


def test_a_keyless_request_on_an_unprotected_view_is_not_counted(
    client: TokenClient, counted: Callable[..., float]
) -> None:
    post(client, "/api/exempt/class", {"amount": 5}, None)
    client.get("/api/payments")

    assert counted("idempotency.keyless_requests") == 0


def test_an_anonymous_keyless_request_is_not_counted(counted: Callable[..., float]) -> None:
    assert post(APIClient(), "/api/payments", {"amount": 5}, None).status_code == 201
    assert counted("idempotency.keyless_requests") == 0


def test_a_keyed_request_is_protected_while_keyless_ones_are_reported(
    client: TokenClient, counted: Callable[..., float]
) -> None:
    post(client, "/api/payments", {"amount": 5}, "k")
    post(client, "/api/payments", {"amount": 5}, None)
    post(client, "/api/payments", {"amount": 5}, "k")

    assert Charge.objects.count() == 2
    assert records() == [("POST api/payments", State.COMPLETED)]
    assert counted("idempotency.keyless_requests", operation="POST api/payments") == 1


# -- one setting makes keys required ----------------------------------------------------


def test_in_required_mode_a_keyless_request_is_refused_with_400(
    keys_required: None, client: TokenClient, kind: tuple[str, str]
) -> None:
    url, _ = kind
    response = post(client, url, {"amount": 5}, None)

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_missing"
    assert Charge.objects.count() == 0
    assert post(client, url, {"amount": 5}, "k").status_code == 201


def test_in_required_mode_exempt_and_safe_requests_still_need_no_key(
    keys_required: None, client: TokenClient
) -> None:
    assert post(client, "/api/exempt/class", {"amount": 5}, None).status_code == 201
    assert client.get("/api/payments").status_code == 200
    assert post(APIClient(), "/api/payments", {"amount": 5}, None).status_code == 201


# -- what the middleware leaves alone ----------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "/api/exempt/class",
        "/api/exempt/subclass",
        "/api/exempt/above",
        "/api/exempt/below",
        "/api/exempt/route",
        "/api/viewset/payments/{pk}/note/",
    ],
    ids=["class", "subclass", "above-api_view", "below-api_view", "route", "viewset-action"],
)
def test_an_exempt_drf_view_is_left_alone(client: TokenClient, url: str) -> None:
    charge = Charge.objects.create(tenant="someone", amount=1)
    url = url.format(pk=charge.pk)

    first = post(client, url, {"amount": 5}, "k")
    retry = post(client, url, {"amount": 5}, "k")

    assert (first.status_code, retry.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 3
    assert IdempotencyRecord.objects.count() == 0


def test_the_token_view_is_left_alone_even_with_a_tenant(settings: Any) -> None:
    """Each login gets its own answer: a replay would hand the token out again."""
    configure(settings, TENANT=lambda request: "everyone")
    User.objects.create_user("ann", password="secret")
    api = APIClient()

    first = post(api, "/api/token", {"username": "ann", "password": "secret"}, "login")
    retry = post(api, "/api/token", {"username": "ann", "password": "wrong"}, "login")

    assert first.status_code == 200 and "token" in first.json()
    assert retry.status_code == 400  # not a replay, not a 422: the view answered
    assert IdempotencyRecord.objects.count() == 0


def test_anonymous_requests_are_left_alone_without_a_tenant() -> None:
    api = APIClient()
    post(api, "/api/payments", {"amount": 5}, "shared-key")
    retry = post(APIClient(), "/api/payments", {"amount": 5}, "shared-key")

    assert "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 0


def test_anonymous_requests_are_protected_where_the_project_sets_a_tenant(settings: Any) -> None:
    configure(settings, TENANT=lambda request: request.headers.get("X-Device", "unknown"))
    api = APIClient()

    post(api, "/api/payments", {"amount": 5}, "k", HTTP_X_DEVICE="device-1")
    retry = post(api, "/api/payments", {"amount": 5}, "k", HTTP_X_DEVICE="device-1")

    assert retry["Idempotent-Replayed"] == "true"
    assert IdempotencyRecord.objects.get().tenant == "device-1"


# -- plain Django views: under the prefixes only ----------------------------------------


@pytest.fixture
def session() -> Client:
    """A browser's session, logged in: what plain Django views authenticate."""
    browser = Client()
    browser.force_login(UserFactory.create())
    return browser


def plain_post(browser: Client, url: str, key: str | None) -> Any:
    headers = {} if key is None else {"Idempotency-Key": key}
    return browser.post(url, {"amount": 5}, content_type="application/json", headers=headers)


@pytest.mark.parametrize("url", ["/plain-api/charges", "/plain-api/class-charges"])
def test_a_plain_view_under_a_prefix_is_protected(session: Client, url: str) -> None:
    plain_post(session, url, "k")
    retry = plain_post(session, url, "k")

    assert retry["Idempotent-Replayed"] == "true"
    assert Charge.objects.count() == 1


@pytest.mark.parametrize("url", ["/forms/charges", "/plain-api/exempt"])
def test_a_plain_view_outside_the_prefixes_or_exempt_is_left_alone(
    session: Client, url: str
) -> None:
    plain_post(session, url, "k")
    retry = plain_post(session, url, "k")

    assert "Idempotent-Replayed" not in retry
    assert Charge.objects.count() == 2
    assert IdempotencyRecord.objects.count() == 0


def test_a_prefix_longer_than_a_routes_literal_part_is_matched_against_the_path(
    settings: Any, session: Client
) -> None:
    """``plain-api/<str:version>/charges`` under ``/plain-api/v1/``: v1's requests only."""
    configure(settings, MIDDLEWARE_PLAIN_VIEW_PREFIXES=["/plain-api/v1/"])
    for version in ("v1", "v2"):
        plain_post(session, f"/plain-api/{version}/charges", "k")
        plain_post(session, f"/plain-api/{version}/charges", "k")

    assert Charge.objects.count() == 3
    assert records() == [("POST plain-api/<str:version>/charges", State.COMPLETED)]


def test_a_plain_view_keyless_request_is_refused_in_required_mode(
    keys_required: None, session: Client
) -> None:
    assert plain_post(session, "/plain-api/charges", None).status_code == 400
    assert plain_post(Client(), "/plain-api/charges", None).status_code == 201  # anonymous


def test_the_admin_login_still_works(settings: Any) -> None:
    """A real login form POST, CSRF token and all, with a prefix set and keys required."""
    configure(settings, MIDDLEWARE_KEYS="required", MIDDLEWARE_PLAIN_VIEW_PREFIXES=["/api/"])
    User.objects.create_superuser("admin", "admin@example.com", "secret")
    browser = Client(enforce_csrf_checks=True)
    browser.get("/admin/login/")
    token = browser.cookies["csrftoken"].value

    response = browser.post(
        "/admin/login/?next=/admin/",
        {"username": "admin", "password": "secret", "csrfmiddlewaretoken": token},
    )

    assert response.status_code == 302
    assert response["Location"] == "/admin/"
    assert browser.get("/admin/").status_code == 200
    assert IdempotencyRecord.objects.count() == 0


# -- a view that protects itself is protected once ---------------------------------------


@pytest.mark.parametrize(
    ("url", "operation"),
    [("/api/own/mixin", "own-mixin-payment"), ("/api/own/decorator", "own-decorator-payment")],
    ids=["mixin", "decorator"],
)
def test_a_view_that_protects_itself_keeps_its_options_and_is_claimed_once(
    client: TokenClient, url: str, operation: str
) -> None:
    with signals_sent({"claimed": signals.request_claimed}) as sent:
        post(client, url, {"amount": 5}, "k")
        retry = post(client, url, {"amount": 5}, "k")

    assert [name for name, _ in sent] == ["claimed"]
    assert retry["Idempotent-Replayed"] == "true"
    assert records() == [(operation, State.COMPLETED)]


def test_a_view_that_protects_itself_keeps_its_required_option(
    keys_required: None, client: TokenClient
) -> None:
    """The decorator's own ``required`` (the REQUIRED default here) decides, not the middleware."""
    assert post(client, "/api/own/decorator", {"amount": 5}, None).status_code == 400


# -- transactions -----------------------------------------------------------------------


@pytest.mark.parametrize("url", ["/api/probe", "/api/function/probe"], ids=["APIView", "api_view"])
def test_under_atomic_requests_the_claim_commits_before_the_views_transaction(
    client: TokenClient, atomic_requests: None, url: str
) -> None:
    """No @transaction.non_atomic_requests, no call: the middleware's class is exempt."""
    body = post(client, url, {"amount": 1}, "k").json()
    assert body == {"in_atomic_block": True, "committed_claims": 1}


def test_under_atomic_requests_a_keyless_request_keeps_djangos_transaction(
    client: TokenClient, atomic_requests: None
) -> None:
    body = post(client, "/api/probe", {"amount": 1}, None).json()
    assert body == {"in_atomic_block": True, "committed_claims": 0}


def test_under_atomic_requests_a_released_claim_rolls_back_the_views_writes(
    client: TokenClient, atomic_requests: None
) -> None:
    assert post(client, "/api/probe", {"amount": 1, "status": 503}, "k").status_code == 503
    assert Charge.objects.count() == 0
    assert IdempotencyRecord.objects.count() == 0


# -- a large API: many view classes, no mixin, only the middleware -------------------------


def generated_urls() -> list[str]:
    views = [f"/many/views/{number}" for number in range(many_views.VIEWS)]
    return views + [f"/many/sets/{number}/" for number in range(many_views.VIEWSETS)]


def test_many_view_classes_are_all_protected_by_the_middleware_alone(
    client: TokenClient, counted: Callable[..., float]
) -> None:
    urls = generated_urls()
    assert len(urls) == 30

    firsts = [post(client, url, {"amount": 1}, f"key-{url}") for url in urls]
    retries = [post(client, url, {"amount": 1}, f"key-{url}") for url in urls]
    keyless = [post(client, url, {"amount": 1}, None) for url in urls]

    assert {response.status_code for response in firsts + retries + keyless} == {201}
    assert all(retry["Idempotent-Replayed"] == "true" for retry in retries)
    assert all("Idempotent-Replayed" not in response for response in firsts + keyless)
    # One charge per keyed operation, one per keyless request: no keyless client broken.
    assert Charge.objects.count() == 60
    assert IdempotencyRecord.objects.filter(state=State.COMPLETED).count() == 30
    assert counted("idempotency.keyless_requests") == 30


def test_many_view_classes_refuse_keyless_requests_once_keys_are_required(
    keys_required: None, client: TokenClient
) -> None:
    refused = [post(client, url, {"amount": 1}, None) for url in generated_urls()]

    assert {response.json()["code"] for response in refused} == {"idempotency_key_missing"}
    assert Charge.objects.count() == 0


# -- the cost: the mixin's queries, no more ------------------------------------------------


@pytest.fixture
def mixin_route(settings: Any) -> Iterator[str]:
    """The same view with ``IdempotentMixin``, routed beside it: the mixin's own path."""
    from django.urls import clear_url_caches, path

    from tests.testapp import middleware_urls

    class MixinPaymentView(IdempotentMixin, middleware_views.PaymentView):
        pass

    route = path("api/mixin-payments", MixinPaymentView.as_view())
    middleware_urls.urlpatterns.append(route)
    clear_url_caches()
    try:
        yield "/api/mixin-payments"
    finally:
        middleware_urls.urlpatterns.remove(route)
        clear_url_caches()


def statements(action: Callable[[], Any]) -> int:
    with CaptureQueriesContext(connection) as captured:
        action()
    return len(captured.captured_queries)


def test_a_request_costs_the_queries_the_mixin_costs(client: TokenClient, mixin_route: str) -> None:
    def first(url: str) -> int:
        return statements(lambda: post(client, url, {"amount": 1}, f"first-{url}"))

    def replay(url: str) -> int:
        return statements(lambda: post(client, url, {"amount": 1}, f"first-{url}"))

    assert first("/api/payments") == first(mixin_route)
    assert replay("/api/payments") == replay(mixin_route)
    keyless = statements(lambda: post(client, "/api/payments", {"amount": 1}, None))
    unprotected = statements(lambda: post(client, "/api/exempt/class", {"amount": 1}, None))
    assert keyless == unprotected


# -- the status view knows the middleware's operations --------------------------------------


def test_the_status_view_finds_a_middleware_protected_operation(client: TokenClient) -> None:
    post(client, "/api/payments", {"amount": 5}, "lost-answer")

    answer = client.get("/idempotency/status/", {"key": "lost-answer"})

    assert answer.status_code == 200
    assert answer.json()["operation"] == "POST api/payments"
    assert answer.json()["state"] == State.COMPLETED


# -- system checks ------------------------------------------------------------------------


def check_ids(settings: Any, middleware: list[str], **idempotency: Any) -> list[str | None]:
    from django_idempotency.checks import check_middleware, check_settings

    settings.MIDDLEWARE = middleware
    settings.IDEMPOTENCY = idempotency
    return [message.id for message in [*check_settings(), *check_middleware()]]


def test_the_middleware_last_passes_the_checks(settings: Any) -> None:
    assert check_ids(settings, [*BASE, MIDDLEWARE]) == []


def test_the_middleware_not_last_is_an_error_naming_what_comes_after(settings: Any) -> None:
    from django_idempotency.checks import check_middleware

    settings.MIDDLEWARE = [MIDDLEWARE, *BASE]
    (message,) = check_middleware()

    assert message.id == "django_idempotency.E050"
    assert "django.middleware.csrf.CsrfViewMiddleware" in message.msg
    assert message.hint is not None and "to the end of MIDDLEWARE" in message.hint


def test_a_subclass_of_the_middleware_is_recognised(settings: Any) -> None:
    subclass = "tests.test_middleware.ProjectMiddleware"
    assert check_ids(settings, [subclass, *BASE]) == ["django_idempotency.E050"]


@pytest.mark.parametrize(
    ("idempotency", "expected"),
    [
        ({"MIDDLEWARE_KEYS": "strict"}, "django_idempotency.E051"),
        ({"MIDDLEWARE_KEYS": True}, "django_idempotency.E051"),
        ({"MIDDLEWARE_PLAIN_VIEW_PREFIXES": "/api/"}, "django_idempotency.E052"),
        ({"MIDDLEWARE_PLAIN_VIEW_PREFIXES": ["api/"]}, "django_idempotency.E052"),
        ({"MIDDLEWARE_PLAIN_VIEW_PREFIXES": [None]}, "django_idempotency.E052"),
    ],
)
def test_an_invalid_middleware_setting_is_reported(
    settings: Any, idempotency: dict[str, Any], expected: str
) -> None:
    assert check_ids(settings, [*BASE, MIDDLEWARE], **idempotency) == [expected]


def test_the_middlewares_settings_without_the_middleware_are_a_warning(settings: Any) -> None:
    assert check_ids(settings, list(BASE), MIDDLEWARE_KEYS="required") == [
        "django_idempotency.W030"
    ]
    assert check_ids(settings, list(BASE)) == []


class ProjectMiddleware(IdempotencyMiddleware):
    """A project's own subclass, as listed in MIDDLEWARE."""
