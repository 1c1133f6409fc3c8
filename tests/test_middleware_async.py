"""``IdempotencyMiddleware`` under ASGI: adrf's async views and async plain views, protected.

Through Django's ASGI handler (``AsyncClient``) and the URLconf of
``tests.testapp.async_middleware_urls``, whose views protect nothing
themselves (but those under ``api/own/`` and ``plain-api/own``): the
behaviour table on each kind of adrf view, a concurrent duplicate, the
report-only rollout and the required mode, what the middleware leaves
alone, a view protected once when it also protects itself, async plain
views under the prefixes, sync DRF views under ASGI, where the queries
run, and what ``idempotency_routes`` says. Each request runs in a
``ThreadSensitiveContext`` of its own, as Django's ``ASGIHandler`` runs
it (see tests/test_adrf.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from io import StringIO
from typing import Any

import pytest
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings as django_settings
from django.core.handlers.asgi import ASGIHandler
from django.core.management import call_command
from django.db import connections
from django.http import HttpResponse
from django.test import AsyncClient, Client
from drf_spectacular.generators import SchemaGenerator

from django_idempotency import recovery, signals
from django_idempotency._routes import protected_operations
from django_idempotency.checks import check_operations
from django_idempotency.models import IdempotencyRecord
from tests.factories import TokenFactory, UserFactory
from tests.telemetry import Readings, installed
from tests.test_adrf import (
    assert_replay_of,
    in_a_thread,
    one_writer_at_a_time,
    refusal_code,
    statements_recorded,
)
from tests.test_middleware_routes import key_header
from tests.testapp import adrf_views
from tests.testapp.models import Charge
from tests.utils import TokenClient, post, signals_sent

pytestmark = pytest.mark.django_db(transaction=True)

State = IdempotencyRecord.State
MIDDLEWARE = "django_idempotency.middleware.IdempotencyMiddleware"
URLCONF = "tests.testapp.async_middleware_urls"
BASE = tuple(django_settings.MIDDLEWARE)

#: One route of each kind of adrf view, with the operation its records get.
ASYNC_KINDS = {
    "APIView": ("/api/payments", "POST api/payments"),
    "generic view": ("/api/generic/payments", "POST api/generic/payments"),
    "viewset": ("/api/viewset/payments/", "POST ^api/viewset/payments"),
    "viewset action": ("/api/viewset/payments/refund/", "POST ^api/viewset/payments/refund"),
    "@api_view": ("/api/function/payments", "POST api/function/payments"),
}
#: The kinds whose handler is adrf_views.charge, which a body's "hold" keeps in flight.
HELD_KINDS = ["APIView", "viewset action", "@api_view"]


def configure(settings: Any, **idempotency: Any) -> None:
    settings.MIDDLEWARE = [*BASE, MIDDLEWARE]
    settings.ROOT_URLCONF = URLCONF
    settings.IDEMPOTENCY = {"MIDDLEWARE_PLAIN_VIEW_PREFIXES": ["/plain-api/"], **idempotency}


@pytest.fixture(autouse=True)
def middleware(settings: Any) -> None:
    """The middleware last in MIDDLEWARE, on the async URLconf, report-only."""
    configure(settings)


@pytest.fixture
def keys_required(settings: Any) -> None:
    configure(settings, MIDDLEWARE_KEYS="required")


class HeaderClient(AsyncClient):
    """An ASGI client that sends ``Authorization`` on every request.

    ``AsyncClient(headers=...)`` puts its headers where Django's WSGI
    handler reads them, not in the ASGI scope's headers.
    """

    def __init__(self, authorization: str, user: Any = None) -> None:
        super().__init__()
        self.authorization = authorization
        self.user = user

    def generic(self, *args: Any, headers: Any = None, **kwargs: Any) -> Any:
        headers = {"Authorization": self.authorization, **(headers or {})}
        return super().generic(*args, headers=headers, **kwargs)


@pytest.fixture
async def client() -> HeaderClient:
    """An ASGI client authenticated with a token of its own; ``user`` is the token's owner."""
    token = await in_a_thread(TokenFactory.create)
    return HeaderClient(f"Token {token.key}", token.user)


@pytest.fixture
async def session() -> AsyncClient:
    """A browser's session, logged in: what plain Django views authenticate."""
    browser = AsyncClient()
    await browser.aforce_login(await in_a_thread(UserFactory.create))
    # The session was saved from asgiref's sync thread: its connection goes too.
    await sync_to_async(connections.close_all)()
    return browser


@pytest.fixture
def counted() -> Callable[..., float]:
    """How much an instrument's matching points rose since the test began."""
    reader, _ = installed()
    before = Readings(reader)
    return lambda name, **labels: (
        Readings(reader).value(name, **labels) - before.value(name, **labels)
    )


@pytest.fixture(params=list(ASYNC_KINDS), ids=list(ASYNC_KINDS))
def kind(request: pytest.FixtureRequest) -> tuple[str, str]:
    return ASYNC_KINDS[request.param]


async def send(
    url: str,
    body: dict[str, Any] | None,
    key: str | None,
    *,
    client: AsyncClient | None = None,
    method: str = "post",
    headers: dict[str, str] | None = None,
) -> HttpResponse:
    """Send ``body`` as JSON in a request context of its own, as Django's ASGIHandler would."""
    headers = dict(headers or {})
    if key is not None:
        headers["Idempotency-Key"] = key
    async with ThreadSensitiveContext():
        try:
            send = getattr(client or AsyncClient(), method)
            response = await send(
                url,
                None if body is None else json.dumps(body),
                content_type="application/json",
                headers=headers,
            )
        finally:
            # The request's thread ends with its context: its connection with it.
            await sync_to_async(connections.close_all)()
    assert isinstance(response, HttpResponse), response
    return response


async def charges() -> int:
    return int(await in_a_thread(Charge.objects.count))


async def records() -> list[tuple[str, str]]:
    return sorted(
        await in_a_thread(lambda: list(IdempotencyRecord.objects.values_list("operation", "state")))
    )


# -- the middleware runs on the event loop under ASGI -----------------------------------


def test_under_asgi_django_adapts_no_handler_for_the_middleware(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Django says (at DEBUG) which middleware it has to run through a thread: not this one."""
    settings.DEBUG = True
    caplog.set_level(logging.DEBUG, logger="django.request")

    ASGIHandler()  # loads MIDDLEWARE, async

    adapted = [r.getMessage() for r in caplog.records if "adapted for middleware" in r.getMessage()]
    assert not [message for message in adapted if MIDDLEWARE in message]


# -- the behaviour table, on every kind of adrf view ------------------------------------


async def test_a_first_execution_its_replay_and_the_refusals(
    client: HeaderClient, kind: tuple[str, str]
) -> None:
    url, operation = kind
    body = {"amount": 7, "note": "table"}

    first = await send(url, body, "pay-1", client=client)
    retry = await send(url, body, "pay-1", client=client)
    reused = await send(url, {**body, "amount": 8}, "pay-1", client=client)
    invalid = await send(url, body, "two words", client=client)

    assert first.status_code == 201 and first["Idempotency-Key"] == "pay-1"
    assert "Idempotent-Replayed" not in first
    assert_replay_of(retry, first)
    assert (reused.status_code, refusal_code(reused)) == (422, "idempotency_key_reused")
    assert (invalid.status_code, refusal_code(invalid)) == (400, "idempotency_key_invalid")
    assert await charges() == 1
    assert await records() == [(operation, State.COMPLETED)]
    tenant = await in_a_thread(lambda: IdempotencyRecord.objects.get().tenant)
    assert tenant == f"user:{client.user.pk}"


async def test_in_required_mode_a_keyless_request_is_refused_with_400(
    keys_required: None, client: HeaderClient, kind: tuple[str, str]
) -> None:
    url, _ = kind
    missing = await send(url, {"amount": 5}, None, client=client)

    assert (missing.status_code, refusal_code(missing)) == (400, "idempotency_key_missing")
    assert await charges() == 0
    assert (await send(url, {"amount": 5}, "k", client=client)).status_code == 201


@pytest.mark.parametrize(
    ("method", "url", "status"),
    [
        ("put", "/api/payments", 201),
        ("delete", "/api/payments", 204),
        ("patch", "/api/viewset/payments/{pk}/", 200),
        ("delete", "/api/viewset/payments/{pk}/", 204),
    ],
)
async def test_every_unsafe_method_is_protected(
    client: HeaderClient, method: str, url: str, status: int
) -> None:
    tenant = f"user:{client.user.pk}"
    existing = await in_a_thread(lambda: Charge.objects.create(tenant=tenant, amount=1))
    url = url.format(pk=existing.pk)

    first = await send(url, {"amount": 9}, "k", client=client, method=method)
    retry = await send(url, {"amount": 9}, "k", client=client, method=method)

    assert first.status_code == status, first.content
    assert_replay_of(retry, first)
    ((operation, state),) = await records()
    assert operation.startswith(method.upper()) and state == State.COMPLETED


@pytest.mark.parametrize("name", HELD_KINDS)
async def test_a_concurrent_duplicate_never_runs_the_view_a_second_time(
    client: HeaderClient, name: str
) -> None:
    """Two real requests in flight at once, the first held in its view after its claim.

    PostgreSQL and MariaDB answer the duplicate 409 at once; on SQLite the
    duplicate's claim waits for the first request's commit (one writer at
    a time) and answers with its replay.
    """
    url, _ = ASYNC_KINDS[name]
    hold = adrf_views.holds[url] = adrf_views.Hold()
    body = {"amount": 1, "hold": url}
    try:
        with statements_recorded() as sent:
            first = asyncio.ensure_future(send(url, body, "k", client=client))
            await asyncio.wait_for(hold.entered.wait(), timeout=30)
            first_threads = {statement.thread for statement in sent}
            duplicate = asyncio.ensure_future(send(url, body, "k", client=client))
            if not one_writer_at_a_time():
                refused = await asyncio.wait_for(duplicate, timeout=30)
                hold.released.set()
                original = await asyncio.wait_for(first, timeout=30)

                assert (refused.status_code, refusal_code(refused)) == (
                    409,
                    "idempotency_request_in_progress",
                )
                assert int(refused["Retry-After"]) >= 1
            else:

                async def duplicate_claiming() -> None:
                    while not {statement.thread for statement in sent} - first_threads:
                        await asyncio.sleep(0.01)

                await asyncio.wait_for(duplicate_claiming(), timeout=30)
                hold.released.set()
                original, replay = await asyncio.wait_for(asyncio.gather(first, duplicate), 30)

                assert_replay_of(replay, original)
    finally:
        hold.released.set()
        del adrf_views.holds[url]

    assert original.status_code == 201
    assert await charges() == 1


async def test_the_claim_comes_after_drfs_authentication_permissions_and_throttles(
    settings: Any, client: HeaderClient
) -> None:
    """Refused by DRF, a request claims nothing, even with anonymous requests protected."""
    configure(settings, TENANT=lambda request: "everyone")
    url = "/api/guarded/payments"
    forged = HeaderClient("Token not-a-token")

    anonymous = await send(url, {"amount": 5}, "k-anonymous")
    unknown = await send(url, {"amount": 5}, "k-forged", client=forged)
    first = await send(url, {"amount": 5}, "k-1", client=client)
    throttled = await send(url, {"amount": 5}, "k-2", client=client)

    assert [r.status_code for r in (anonymous, unknown, first, throttled)] == [401, 401, 201, 429]
    assert await records() == [("POST api/guarded/payments", State.COMPLETED)]
    assert await in_a_thread(lambda: IdempotencyRecord.objects.get().key) == "k-1"


async def test_safe_methods_are_not_protected(client: HeaderClient) -> None:
    async with ThreadSensitiveContext():
        answer = await client.get("/api/payments", headers={"Idempotency-Key": "k"})
        await sync_to_async(connections.close_all)()

    assert answer.status_code == 200 and "Idempotency-Key" not in answer
    assert await records() == []


# -- report-only: keyless requests run, counted and logged ------------------------------


async def test_a_keyless_request_runs_unprotected_is_counted_and_names_its_client(
    client: HeaderClient, counted: Callable[..., float], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="django_idempotency.middleware")

    first = await send("/api/payments", {"amount": 5}, None, client=client)
    second = await send("/api/payments", {"amount": 5}, None, client=client)

    assert (first.status_code, second.status_code) == (201, 201)
    assert "Idempotency-Key" not in first
    assert await charges() == 2 and await records() == []
    assert counted("idempotency.keyless_requests", operation="POST api/payments") == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "django_idempotency.middleware"]
    assert len(lines) == 2
    assert "POST api/payments ran without an Idempotency-Key header" in lines[0]
    assert f"sent by user:{client.user.pk}; answered 201" in lines[0]


async def test_an_anonymous_keyless_request_is_not_counted(
    counted: Callable[..., float],
) -> None:
    assert (await send("/api/payments", {"amount": 5}, None)).status_code == 201
    assert (await send("/plain-api/charges", {"amount": 5}, None)).status_code == 201
    assert counted("idempotency.keyless_requests") == 0


async def test_a_keyless_request_to_an_async_plain_view_names_its_user(
    session: AsyncClient, counted: Callable[..., float], caplog: pytest.LogCaptureFixture
) -> None:
    """The user, not loaded by the view's auser(), is loaded off the loop to be named."""
    caplog.set_level(logging.INFO, logger="django_idempotency.middleware")

    keyless = await send("/plain-api/charges", {"amount": 5}, None, client=session)

    assert keyless.status_code == 201

    assert counted("idempotency.keyless_requests", operation="POST plain-api/charges") == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "django_idempotency.middleware"]
    assert "sent by user:" in line


# -- what the middleware leaves alone ----------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "/api/exempt/class",
        "/api/exempt/above",
        "/api/exempt/below",
        "/api/exempt/route",
        "/api/viewset/payments/note/",
    ],
    ids=["class", "above-api_view", "below-api_view", "route", "viewset-action"],
)
async def test_an_exempt_async_view_is_left_alone(client: HeaderClient, url: str) -> None:
    first = await send(url, {"amount": 5}, "k", client=client)
    retry = await send(url, {"amount": 5}, "k", client=client)

    assert (first.status_code, retry.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in retry
    assert await charges() == 2 and await records() == []


async def test_anonymous_requests_are_left_alone_without_a_tenant() -> None:
    await send("/api/payments", {"amount": 5}, "shared-key")
    retry = await send("/api/payments", {"amount": 5}, "shared-key")

    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert await charges() == 2 and await records() == []


async def test_anonymous_requests_are_protected_where_the_project_sets_a_tenant(
    settings: Any,
) -> None:
    configure(settings, TENANT=lambda request: request.headers.get("X-Device", "unknown"))
    device = {"X-Device": "device-1"}

    first = await send("/api/payments", {"amount": 5}, "k", headers=device)
    retry = await send("/api/payments", {"amount": 5}, "k", headers=device)

    assert_replay_of(retry, first)
    assert await in_a_thread(lambda: IdempotencyRecord.objects.get().tenant) == "device-1"


# -- a view that protects itself is protected once ---------------------------------------


@pytest.mark.parametrize(
    ("url", "operation"),
    [
        ("/api/own/mixin", "own-async-mixin-payment"),
        ("/api/own/method", "own-async-method-payment"),
        ("/api/own/decorator", "own-async-decorator-payment"),
        ("/plain-api/own", "own-async-plain-charge"),
    ],
    ids=["mixin", "decorated-method", "decorated-api_view", "decorated-plain-view"],
)
async def test_a_view_that_protects_itself_keeps_its_options_and_is_claimed_once(
    client: HeaderClient, url: str, operation: str
) -> None:
    with signals_sent({"claimed": signals.request_claimed}) as sent:
        await send(url, {"amount": 5}, "k", client=client)
        retry = await send(url, {"amount": 5}, "k", client=client)

    assert [name for name, _ in sent] == ["claimed"]
    assert retry["Idempotent-Replayed"] == "true"
    assert await records() == [(operation, State.COMPLETED)]


# -- async plain Django views: under the prefixes only ------------------------------------


@pytest.mark.parametrize("url", ["/plain-api/charges", "/plain-api/class-charges"])
async def test_an_async_plain_view_under_a_prefix_is_protected(
    session: AsyncClient, url: str
) -> None:
    first = await send(url, {"amount": 5}, "k", client=session)
    retry = await send(url, {"amount": 5}, "k", client=session)
    reused = await send(url, {"amount": 6}, "k", client=session)

    assert first.status_code == 201
    assert_replay_of(retry, first)
    assert (reused.status_code, refusal_code(reused)) == (422, "idempotency_key_reused")
    assert await charges() == 1
    assert await records() == [(f"POST {url.lstrip('/')}", State.COMPLETED)]


async def test_an_async_plain_view_outside_the_prefixes_is_left_alone(
    session: AsyncClient,
) -> None:
    await send("/forms/charges", {"amount": 5}, "k", client=session)
    retry = await send("/forms/charges", {"amount": 5}, "k", client=session)

    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry
    assert await charges() == 2 and await records() == []


async def test_an_async_plain_views_keyless_request_is_refused_in_required_mode_unless_anonymous(
    keys_required: None, session: AsyncClient
) -> None:
    refused = await send("/plain-api/charges", {"amount": 5}, None, client=session)
    anonymous = await send("/plain-api/charges", {"amount": 5}, None)

    assert (refused.status_code, refusal_code(refused)) == (400, "idempotency_key_missing")
    assert anonymous.status_code == 201
    assert await charges() == 1


# -- ATOMIC_REQUESTS ------------------------------------------------------------------------


async def test_under_atomic_requests_only_the_requests_left_to_django_are_refused(
    client: HeaderClient, atomic_requests: None
) -> None:
    """Django refuses ATOMIC_REQUESTS to the async views it runs; the middleware runs its own.

    Its class is exempt, and the protection opens the view's transaction
    after the claim: a released claim rolls the view's writes back.
    """
    keyed = await send("/api/payments", {"amount": 1, "status": 503}, "k", client=client)

    assert keyed.status_code == 503
    assert await charges() == 0  # its writes rolled back with the released claim
    with pytest.raises(RuntimeError, match="ATOMIC_REQUESTS with async views"):
        await send("/api/payments", {"amount": 1}, None, client=client)


# -- sync DRF views under ASGI, async views under WSGI -------------------------------------


async def test_a_sync_drf_view_under_asgi_is_protected_as_under_wsgi(
    client: HeaderClient, counted: Callable[..., float]
) -> None:
    url = "/api/sync/payments"
    first = await send(url, {"amount": 5}, "k", client=client)
    retry = await send(url, {"amount": 5}, "k", client=client)
    reused = await send(url, {"amount": 6}, "k", client=client)
    keyless = await send(url, {"amount": 5}, None, client=client)

    assert first.status_code == 201
    assert_replay_of(retry, first)
    assert (reused.status_code, refusal_code(reused)) == (422, "idempotency_key_reused")
    assert keyless.status_code == 201
    assert await charges() == 2
    assert await records() == [("POST api/sync/payments", State.COMPLETED)]
    assert counted("idempotency.keyless_requests", operation="POST api/sync/payments") == 1


@pytest.mark.parametrize("url", ["/api/payments", "/api/function/payments"])
def test_an_async_view_under_wsgi_is_protected_too(url: str) -> None:
    """Django's WSGI handler runs an async view through async_to_sync: so does the middleware."""
    client = TokenClient(TokenFactory.create())
    first = post(client, url, {"amount": 5}, "k")
    retry = post(client, url, {"amount": 5}, "k")

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert Charge.objects.count() == 1


def test_an_async_plain_view_under_wsgi_is_protected_too() -> None:
    browser = Client()
    browser.force_login(UserFactory.create())
    headers = {"Idempotency-Key": "k"}

    first = browser.post("/plain-api/charges", {"amount": 5}, "application/json", headers=headers)
    retry = browser.post("/plain-api/charges", {"amount": 5}, "application/json", headers=headers)

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true" and retry.content == first.content
    assert Charge.objects.count() == 1


# -- where the queries run -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "logged_in"),
    [("/api/payments", False), ("/plain-api/charges", True)],
    ids=["adrf", "plain"],
)
async def test_no_query_runs_on_the_event_loop(
    client: HeaderClient, session: AsyncClient, url: str, logged_in: bool
) -> None:
    """Every answer of the middleware: the claim, a replay, a refusal, a keyless request's count."""
    caller = session if logged_in else client
    loop_thread = threading.get_ident()
    requests = [
        (caller, {"amount": 1}, "k"),  # first execution
        (caller, {"amount": 1}, "k"),  # replay
        (caller, {"amount": 2}, "k"),  # 422
        (caller, {"amount": 1}, None),  # keyless, counted
        (AsyncClient(), {"amount": 1}, "k"),  # anonymous, left alone
    ]
    with statements_recorded() as sent:
        answers = [await send(url, body, key, client=sender) for sender, body, key in requests]
    threads = {statement.thread for statement in sent}

    assert [answer.status_code for answer in answers] == [201, 201, 422, 201, 201]
    assert answers[1]["Idempotent-Replayed"] == "true"
    assert sent and loop_thread not in threads


# -- what lists the protected views knows the async ones ------------------------------------


def routes() -> str:
    out = StringIO()
    call_command("idempotency_routes", stdout=out)
    return out.getvalue()


def section(text: str, route: str) -> list[str]:
    (block,) = [block for block in text.split("\n\n") if block.split("  (")[0] == route]
    return [line.strip() for line in block.splitlines()[1:]]


def test_idempotency_routes_lists_async_views_as_protected() -> None:
    text = routes()

    assert "async view" not in text
    assert section(text, "api/payments") == [
        "POST                    protected by the middleware, operation POST api/payments",
        "PUT                     protected by the middleware, operation PUT api/payments",
        "DELETE                  protected by the middleware, operation DELETE api/payments",
    ]
    assert section(text, "api/function/payments") == [
        "POST                    protected by the middleware, operation POST api/function/payments"
    ]
    assert section(text, "plain-api/class-charges") == [
        "POST                    protected by the middleware, operation POST "
        "plain-api/class-charges"
    ]
    assert section(text, "api/own/method") == [
        "POST                    protected by @idempotent, operation own-async-method-payment"
    ]
    assert section(text, "api/own/decorator") == [
        "POST                    protected by @idempotent, operation "
        "own-async-decorator-payment; ttl=60s"
    ]
    assert section(text, "plain-api/own")[0] == (
        "POST                    protected by @idempotent, operation own-async-plain-charge"
    )
    assert section(text, "api/exempt/above") == [
        "POST                    not protected: idempotent_exempt"
    ]


@pytest.mark.parametrize(("keys", "required"), [("report", False), ("required", True)])
def test_the_schema_shows_the_header_of_middleware_protected_async_operations(
    settings: Any, keys: str, required: bool
) -> None:
    # With a TENANT, anonymous callers are protected too: "required" holds for all
    # (test_middleware_routes: without one, the views that let them in say so).
    configure(settings, MIDDLEWARE_KEYS=keys, TENANT=lambda request: "everyone")
    generator = SchemaGenerator(urlconf=URLCONF)  # type: ignore[no-untyped-call]
    paths = generator.get_schema(request=None, public=True)["paths"]  # type: ignore[no-untyped-call]

    for path, method in [
        ("/api/payments", "post"),
        ("/api/payments", "delete"),
        ("/api/generic/payments", "post"),
        ("/api/function/payments", "post"),
        ("/api/viewset/payments/{id}/", "patch"),
        ("/api/viewset/payments/refund/", "post"),
    ]:
        header = key_header(paths[path][method])
        assert header is not None, (path, method)
        assert header.get("required", False) is required
        assert {"409", "422"} <= set(paths[path][method]["responses"]), (path, method)
    for path, method in [
        ("/api/payments", "get"),
        ("/api/exempt/class", "post"),
        ("/api/exempt/above", "post"),
        ("/api/viewset/payments/note/", "post"),
    ]:
        assert key_header(paths[path][method]) is None, (path, method)


def test_the_checks_and_metrics_know_the_async_views_operations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    operations = protected_operations()
    assert {"POST api/payments", "POST ^api/viewset/payments/refund", "POST plain-api/charges"} <= (
        operations
    )
    assert {"own-async-method-payment", "own-async-plain-charge"} <= operations
    assert "POST api/exempt/class" not in operations

    monkeypatch.setattr(recovery, "_reconcilers", {})
    for operation in ("POST api/function/payments", "own-async-plain-charge"):
        recovery.register_reconciler(operation)(lambda record: recovery.Completed(status=200))
    assert check_operations() == []
