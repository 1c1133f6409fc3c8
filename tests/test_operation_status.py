"""The operation status view: ``include("django_idempotency.urls")``.

A client that lost the answer to a protected request asks what became of
it: the state, and once resolved the stored response, of its own operation
only; a key it does not hold is 404 however other tenants use it, with the
same query and the same bytes; the record is read where it is written.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.db import connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import include, path, re_path, reverse
from django.utils import timezone
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.versioning import URLPathVersioning

from django_idempotency import idempotent
from django_idempotency._store.database_time import DatabaseLater
from django_idempotency.models import IdempotencyRecord, IdempotencyStep
from django_idempotency.status import OperationStatusView, encode_body
from tests.factories import RecordFactory, TokenFactory
from tests.test_store_unavailable import unreachable_store  # noqa: F401  (a fixture)
from tests.test_tenant_isolation import ApiKeyAuthentication, TokenWithoutUser
from tests.utils import SHARD_TEST_ALIASES, TokenClient, post, record_in, routed_by_tenant

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
STATUS_URL = "/idempotency/status/"
CHARGES = "POST api-view/charges"


def tenant_of(client: TokenClient) -> str:
    return f"user:{client.user.pk}"


def status(client: APIClient, key: str, **more: str) -> Any:
    return client.get(STATUS_URL, {"key": key, **more})


def status_at(client: APIClient, url: str, key: str) -> Any:
    return client.get(url, {"key": key})


@pytest.fixture
def alice(client_for: Callable[..., TokenClient]) -> TokenClient:
    return client_for()


@pytest.fixture
def bob(client_for: Callable[..., TokenClient]) -> TokenClient:
    return client_for()


def test_the_urls_module_is_namespaced() -> None:
    assert reverse("django_idempotency:status") == STATUS_URL


def test_a_completed_request_is_answered_with_its_stored_response(
    alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    first = post(alice, "/api-view/charges", {"amount": 7}, key)

    answer = status(alice, key)

    assert answer.status_code == 200
    body = answer.json()
    record = IdempotencyRecord.objects.get(key=key)
    assert body["key"] == key
    assert body["operation"] == CHARGES
    assert body["state"] == "COMPLETED"
    assert body["expired"] is False
    assert body["created_at"] == record.created_at.isoformat().replace("+00:00", "Z")
    assert body["expires_at"] == record.expires_at.isoformat().replace("+00:00", "Z")
    assert body["response"] == {
        "status": 201,
        "headers": {"Content-Type": "application/json", "Location": first["Location"]},
        "body_encoding": "json",
        "body": first.json(),
    }
    assert answer["Cache-Control"] == "no-store"


def test_a_failed_request_is_answered_with_its_stored_refusal(
    alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    # A stored refusal: a raised ValidationError is not stored (refused input).
    first = post(alice, "/api-view/charges", {"amount": 7, "forbidden": True}, key)
    assert first.status_code == 403

    body = status(alice, key).json()

    assert body["state"] == "FAILED"
    assert body["response"]["status"] == 403
    assert body["response"]["body"] == first.json()


@pytest.mark.parametrize("state", [State.CLAIMED, State.IN_PROGRESS, State.UNCERTAIN])
def test_an_unresolved_operation_answers_its_state_and_no_response(
    alice: TokenClient, state: str
) -> None:
    RecordFactory.create(
        tenant=tenant_of(alice),
        key="in-flight",
        state=state,
        response_status=None,
        response_headers=[],
        response_body=None,
    )

    answer = status(alice, "in-flight")

    assert answer.status_code == 200
    assert answer.json()["state"] == state
    assert answer.json()["expired"] is False
    assert answer.json()["response"] is None


def test_a_request_released_for_retry_is_unknown(
    alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    assert post(alice, "/api-view/charges", {"amount": 7, "status": 503}, key).status_code == 503

    answer = status(alice, key)

    assert answer.status_code == 404
    assert answer.json()["code"] == "idempotency_key_unknown"


@pytest.mark.parametrize("with_operation", [True, False], ids=["operation", "key-only"])
def test_another_tenants_key_is_answered_exactly_as_an_unknown_key(
    alice: TokenClient, bob: TokenClient, with_operation: bool
) -> None:
    RecordFactory.create(tenant=tenant_of(bob), key="bobs-key", operation=CHARGES)
    RecordFactory.create(tenant=tenant_of(bob), key="bobs-other", operation="POST other")
    more = {"operation": CHARGES} if with_operation else {}

    def ask(key: str) -> tuple[Any, list[str]]:
        with CaptureQueriesContext(connections["default"]) as queries:
            answer = status(alice, key, **more)
        # The caller's own authentication (the token) is looked up first.
        lookups = [q["sql"] for q in queries if "django_idempotency_record" in q["sql"]]
        return answer, lookups

    held, held_queries = ask("bobs-key")
    unknown, unknown_queries = ask("nobody-has-it")

    assert held.status_code == unknown.status_code == 404
    assert held.content == unknown.content
    assert sorted(held.items()) == sorted(unknown.items())
    # One indexed lookup each, the same statement but for the key itself.
    assert len(held_queries) == len(unknown_queries) == 1
    assert held_queries[0].replace("bobs-key", "?") == unknown_queries[0].replace(
        "nobody-has-it", "?"
    )
    assert status(bob, "bobs-key", **more).status_code == 200


def one_organisation(request: Any) -> str:
    """Every caller is one tenant: a tenant coarser than the principal (an organisation)."""
    return "organisation:acme"


@pytest.mark.parametrize("with_operation", [True, False], ids=["operation", "key-only"])
def test_a_colleague_of_the_same_tenant_is_answered_as_for_an_unknown_key(
    alice: TokenClient, bob: TokenClient, settings: Any, with_operation: bool
) -> None:
    """The stored response goes to the principal that sent the request, as a replay does.

    A retry needs the key and the same input, and past a refused permission
    only its own principal gets the replay; asking needs the key alone.
    """
    settings.IDEMPOTENCY = {"TENANT": "tests.test_operation_status.one_organisation"}
    first = post(alice, "/api-view/charges", {"amount": 7}, "k1")
    more = {"operation": CHARGES} if with_operation else {}

    bobs = status(bob, "k1", **more)
    unknown = status(bob, "nobody-has-it", **more)
    alices = status(alice, "k1", **more)

    assert first.status_code == 201
    assert (bobs.status_code, bobs.content) == (404, unknown.content)
    assert alices.status_code == 200
    assert alices.json()["response"]["body"] == first.json()


def test_a_found_operation_costs_one_query(alice: TokenClient) -> None:
    RecordFactory.create(tenant=tenant_of(alice), key="mine", operation=CHARGES)

    for more in ({}, {"operation": CHARGES}):
        with CaptureQueriesContext(connections["default"]) as queries:
            assert status(alice, "mine", **more).status_code == 200
        lookups = [q for q in queries if "django_idempotency_record" in q["sql"]]
        assert len(lookups) == 1, more


def test_a_key_used_for_several_operations_lists_them(alice: TokenClient) -> None:
    tenant = tenant_of(alice)
    RecordFactory.create(tenant=tenant, key="shared", operation=CHARGES)
    RecordFactory.create(
        tenant=tenant, key="shared", operation="POST refunds", state=State.IN_PROGRESS
    )

    listed = status(alice, "shared")
    chosen = status(alice, "shared", operation="POST refunds")

    assert listed.status_code == 300
    assert listed.json() == {
        "detail": listed.json()["detail"],
        "code": "idempotency_operation_ambiguous",
        "operations": [CHARGES, "POST refunds"],
    }
    assert chosen.status_code == 200
    assert chosen.json()["state"] == "IN_PROGRESS"
    assert status(alice, "shared", operation="POST nothing").status_code == 404


@pytest.mark.parametrize(
    "tombstone_ttl", [None, 30 * 24 * 3600], ids=["no-tombstones", "tombstones"]
)
def test_a_resolved_record_past_its_retention_is_expired(
    alice: TokenClient, settings: Any, tombstone_ttl: int | None
) -> None:
    # With TOMBSTONE_TTL, a record past retention that the purge has not
    # turned into a tombstone yet is refused to retries: expired here too.
    settings.IDEMPOTENCY = {"TOMBSTONE_TTL": tombstone_ttl}
    RecordFactory.create(
        tenant=tenant_of(alice), key="old", expires_at=timezone.now() - timedelta(seconds=5)
    )

    body = status(alice, "old").json()

    assert body["state"] == "COMPLETED"
    assert body["expired"] is True
    assert body["response"] is None


def test_a_tombstone_is_expired(alice: TokenClient) -> None:
    RecordFactory.create(
        tenant=tenant_of(alice),
        key="purged",
        tombstone=True,
        response_headers=[],
        response_body=None,
        expires_at=timezone.now() + timedelta(days=7),
    )

    answer = status(alice, "purged")

    assert answer.status_code == 200
    assert answer.json()["expired"] is True
    assert answer.json()["response"] is None


def test_an_unresolved_record_past_expires_at_is_not_expired(alice: TokenClient) -> None:
    # UNCERTAIN is never purged: its outcome is still being found out.
    RecordFactory.create(
        tenant=tenant_of(alice),
        key="stuck",
        state=State.UNCERTAIN,
        response_status=None,
        response_body=None,
        expires_at=timezone.now() - timedelta(hours=1),
    )

    assert status(alice, "stuck").json()["expired"] is False


def test_an_encrypted_response_is_shown_decrypted(
    alice: TokenClient, new_key: Callable[[], str]
) -> None:
    secret = Fernet.generate_key().decode()
    key = new_key()
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [secret]}):
        first = post(alice, "/api-view/charges", {"amount": 9}, key)
        answer = status(alice, key)

    assert IdempotencyRecord.objects.get(key=key).response_sealed
    assert answer.json()["response"]["body"] == first.json()
    assert answer.json()["response"]["headers"]["Location"] == first["Location"]


def test_an_encrypted_response_without_its_key_is_503(
    alice: TokenClient, new_key: Callable[[], str]
) -> None:
    key = new_key()
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}):
        post(alice, "/api-view/charges", {"amount": 9}, key)
    with override_settings(IDEMPOTENCY={"ENCRYPTION_KEYS": [Fernet.generate_key().decode()]}):
        answer = status(alice, key)

    assert answer.status_code == 503
    assert answer.json()["code"] == "idempotency_store_unavailable"
    assert answer["Retry-After"] == "5"


@pytest.mark.usefixtures("unreachable_store")
def test_an_unreachable_store_is_503(alice: TokenClient) -> None:
    answer = status(alice, "any")

    assert answer.status_code == 503
    assert answer.json()["code"] == "idempotency_store_unavailable"
    assert answer["Retry-After"] == "5"


def test_a_body_that_was_not_stored_says_so(alice: TokenClient) -> None:
    RecordFactory.create(tenant=tenant_of(alice), key="big", response_body=None)

    response = status(alice, "big").json()["response"]

    assert response["body_encoding"] == "omitted"
    assert response["body"] is None


@pytest.mark.parametrize(
    ("content_type", "body", "expected"),
    [
        ("application/json", b'{"a": [1, 2.5]}', ("json", {"a": [1, 2.5]})),
        ("application/problem+json", b'{"code": "x"}', ("json", {"code": "x"})),
        ("application/json", b"{not json", ("text", "{not json")),
        ("application/json", b'{"a": NaN}', ("text", '{"a": NaN}')),
        ("text/plain; charset=utf-8", "café".encode(), ("text", "café")),
        ("text/plain; charset=latin-1", "café".encode("latin-1"), ("text", "café")),
        ("text/csv", b"\xff\xfe", ("base64", base64.b64encode(b"\xff\xfe").decode())),
        ("application/pdf", b"%PDF\x00", ("base64", base64.b64encode(b"%PDF\x00").decode())),
        ("", b"", ("text", "")),
        ("application/json", None, ("omitted", None)),
        # A NUL in the charset's name: a ValueError of its own, was a 500.
        # (PostgreSQL cannot store it; SQLite and MariaDB can.)
        ("text/plain; charset=\x00", b"abc", ("base64", "YWJj")),
    ],
)
def test_stored_bodies_are_given_as_json_text_or_base64(
    content_type: str, body: bytes | None, expected: tuple[str, Any]
) -> None:
    headers = [["Content-Type", content_type]] if content_type else []
    assert encode_body(headers, body) == expected


@pytest.mark.parametrize(
    ("content_type", "body", "expected"),
    [
        # JSON that parses, but into a value no JSON answer can carry: an
        # overflowing number (inf) and a lone surrogate (a plain view's
        # JsonResponse writes a client's "\ud800" escaped, as ASCII).
        ("application/json", b'{"a": 1e999}', ("text", '{"a": 1e999}')),
        ("application/json", b'{"note": "\\ud800"}', ("text", '{"note": "\\ud800"}')),
        ("application/json", b'{"\\udc00": 1}', ("text", '{"\\udc00": 1}')),
        # Text whose charset decodes it into lone surrogates.
        ("text/plain; charset=utf-7", b"+2AA-", ("base64", base64.b64encode(b"+2AA-").decode())),
        ("text/plain; charset=unicode_escape", b"\\ud800", ("base64", "XHVkODAw")),
    ],
    ids=["json-inf", "json-surrogate", "json-surrogate-name", "utf-7", "unicode-escape"],
)
def test_a_stored_body_the_answer_could_not_carry_as_parsed_is_given_as_text_or_base64(
    alice: TokenClient, content_type: str, body: bytes, expected: tuple[str, Any]
) -> None:
    # Each was a 500: DRF's JSON renderer refuses inf, and a lone surrogate
    # cannot be encoded in UTF-8.
    RecordFactory.create(
        tenant=tenant_of(alice),
        key="odd",
        response_headers=[["Content-Type", content_type]],
        response_body=body,
    )

    answer = status(alice, "odd")

    assert answer.status_code == 200, answer.content[:300]
    response = answer.json()["response"]
    assert (response["body_encoding"], response["body"]) == expected


def test_a_binary_body_round_trips_through_base64(alice: TokenClient) -> None:
    raw = bytes(range(256))
    RecordFactory.create(
        tenant=tenant_of(alice),
        key="pdf",
        response_headers=[["Content-Type", "application/pdf"]],
        response_body=raw,
    )

    response = status(alice, "pdf").json()["response"]

    assert response["body_encoding"] == "base64"
    assert base64.b64decode(response["body"]) == raw


def test_an_anonymous_caller_is_refused(api: APIClient) -> None:
    RecordFactory.create(tenant="anonymous", key="anyones")

    answer = status(api, "anyones")

    assert answer.status_code == 401
    assert "anyones" not in answer.content.decode()


class OpenStatusView(OperationStatusView):
    """A project's subclass: its tenants come from elsewhere than the authenticated user."""

    permission_classes = [AllowAny]


@api_view(["POST"])
@authentication_classes([ApiKeyAuthentication])
@permission_classes([])
@idempotent(operation="POST keyed")
def keyed_charge(request: Request) -> Response:
    return Response({"charged": dict(request.data)["amount"]}, status=201)


@api_view(["POST"])
@authentication_classes([TokenWithoutUser])
@permission_classes([])
@idempotent(operation="POST keyed")
def machine_charge(request: Request) -> Response:
    return Response({"charged": dict(request.data)["amount"]}, status=201)


class ApiKeyStatusView(OperationStatusView):
    """The status view of a project whose clients authenticate with an API key, no user."""

    authentication_classes = [ApiKeyAuthentication]


class MachineStatusView(OperationStatusView):
    """The status view of a project whose tokens authenticate machine clients, no user."""

    authentication_classes = [TokenWithoutUser]


urlpatterns = [
    path("open-status/", OpenStatusView.as_view()),
    path("keyed/", keyed_charge),
    path("keyed-status/", ApiKeyStatusView.as_view()),
    path("machine/", machine_charge),
    path("machine-status/", MachineStatusView.as_view()),
    # Prefixes that capture URL arguments, as a project's own API nests them.
    path("organizers/<slug:organizer>/idempotency/", include("django_idempotency.urls")),
    re_path(r"^(?P<version>v1|v2)/idempotency/", include("django_idempotency.urls")),
    re_path(r"^positional/(\d+)/idempotency/", include("django_idempotency.urls")),
]


@pytest.mark.urls(__name__)
def test_a_subclass_may_change_the_permissions(api: APIClient, settings: Any) -> None:
    settings.IDEMPOTENCY = {"TENANT": "tests.test_tenant_isolation.header_tenant"}
    RecordFactory.create(tenant="acme", key="acmes")

    answer = api.get("/open-status/", {"key": "acmes"}, HTTP_X_FUZZ_TENANT="acme")

    assert answer.status_code == 200


@pytest.mark.parametrize("tenant", ["ac\x00me", "\x1b[2Jacme"], ids=["nul", "esc"])
def test_a_tenant_holding_control_characters_finds_its_own_records(
    alice: TokenClient, settings: Any, tenant: str
) -> None:
    # A resolver reading the tenant from client input: such a tenant is
    # stored by its digest, and the status view resolves it the same way.
    settings.IDEMPOTENCY = {"TENANT": "tests.test_tenant_isolation.header_tenant"}
    first = post(alice, "/api-view/charges", {"amount": 7}, "k", HTTP_X_FUZZ_TENANT=tenant)

    answer = alice.get(STATUS_URL, {"key": "k"}, HTTP_X_FUZZ_TENANT=tenant)
    elsewhere = alice.get(STATUS_URL, {"key": "k"}, HTTP_X_FUZZ_TENANT=tenant.replace("a", "b"))

    assert first.status_code == 201
    assert answer.status_code == 200
    assert answer.json()["response"]["body"] == first.json()
    assert elsewhere.status_code == 404
    assert IdempotencyRecord.objects.get().tenant.startswith("sha256:")


@pytest.mark.urls(__name__)
def test_the_shared_tenant_of_unauthenticated_requests_is_never_answered(
    api: APIClient,
) -> None:
    # Even under a subclass that lets anyone ask: every anonymous client's
    # records are under the one tenant "anonymous", so each other's.
    RecordFactory.create(tenant="anonymous", key="anyones")

    answer = api.get("/open-status/", {"key": "anyones"})

    assert answer.status_code in (401, 403)
    assert "anyones" not in answer.content.decode()


@pytest.mark.urls(__name__)
@pytest.mark.parametrize(
    "prefix", ["/organizers/acme/idempotency", "/v1/idempotency", "/positional/7/idempotency"]
)
def test_the_view_answers_under_a_prefix_that_captures_url_arguments(
    alice: TokenClient, prefix: str
) -> None:
    RecordFactory.create(tenant=tenant_of(alice), key="mine", operation=CHARGES)

    found = alice.get(f"{prefix}/status/", {"key": "mine"})
    unknown = alice.get(f"{prefix}/status/", {"key": "not-mine"})

    assert found.status_code == 200, found.content
    assert found.json()["operation"] == CHARGES
    assert unknown.status_code == 404


@pytest.mark.urls(__name__)
def test_the_view_answers_under_drfs_url_path_versioning(
    alice: TokenClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What DEFAULT_VERSIONING_CLASS gives every APIView when the project loads.
    monkeypatch.setattr(OperationStatusView, "versioning_class", URLPathVersioning)
    RecordFactory.create(tenant=tenant_of(alice), key="mine", operation=CHARGES)

    answer = alice.get("/v2/idempotency/status/", {"key": "mine"})

    assert answer.status_code == 200, answer.content
    assert answer.json()["state"] == "COMPLETED"


def client_with(header: str, credential: str) -> APIClient:
    client = APIClient()
    client.credentials(**{header: credential})
    return client


@pytest.mark.urls(__name__)
@pytest.mark.parametrize(
    ("charge", "ask", "header"),
    [
        pytest.param("/keyed/", "/keyed-status/", "HTTP_X_API_KEY", id="api-key"),
        pytest.param("/machine/", "/machine-status/", "HTTP_AUTHORIZATION", id="token-no-user"),
    ],
)
def test_a_client_authenticated_by_a_credential_without_a_user_asks_about_its_own(
    api: APIClient, charge: str, ask: str, header: str
) -> None:
    # (AnonymousUser, credential): default_tenant names the client by its
    # credential, so its requests are protected; it may ask what became of them.
    if header == "HTTP_AUTHORIZATION":
        mine = f"Token {TokenFactory.create().key}"
        theirs = f"Token {TokenFactory.create().key}"
    else:
        mine, theirs = "key-of-mine", "key-of-theirs"
    client = client_with(header, mine)
    first = post(client, charge, {"amount": 3}, "k1")
    assert first.status_code == 201, first.content

    answer = status_at(client, ask, "k1")
    elsewhere = status_at(client_with(header, theirs), ask, "k1")
    nobody = status_at(api, ask, "k1")

    assert answer.status_code == 200, answer.content
    assert answer.json()["response"]["body"] == {"charged": 3}
    assert elsewhere.status_code == 404
    assert nobody.status_code in (401, 403)


@pytest.mark.parametrize(
    ("query", "code"),
    [({}, "idempotency_key_missing"), ({"key": "has space"}, "idempotency_key_invalid")],
)
def test_a_missing_or_malformed_key_is_400(
    alice: TokenClient, query: dict[str, str], code: str
) -> None:
    answer = alice.get(STATUS_URL, query)

    assert answer.status_code == 400
    assert answer.json()["code"] == code


@pytest.mark.parametrize(
    "operation",
    ["\x00", "POST api/\x00charges", "POST \x1b[2J", "POST api\ncharges", "P" * 256],
    ids=["nul", "nul-inside", "escape", "newline", "too-long"],
)
def test_an_operation_no_record_can_have_is_400_on_every_database(
    alice: TokenClient, operation: str
) -> None:
    # PostgreSQL refuses a NUL in text: asked, it raised a DataError (500).
    # The name is judged before any query, by the rule operation names obey.
    RecordFactory.create(tenant=tenant_of(alice), key="mine", operation=CHARGES)

    with CaptureQueriesContext(connections["default"]) as queries:
        answer = status(alice, "mine", operation=operation)

    assert answer.status_code == 400, answer.content
    assert answer.json()["code"] == "idempotency_operation_invalid"
    assert not [q for q in queries if "django_idempotency_record" in q["sql"]]


def test_a_quoted_key_is_the_bare_key(alice: TokenClient) -> None:
    RecordFactory.create(tenant=tenant_of(alice), key="quoted")

    assert status(alice, '"quoted"').status_code == 200


def test_refusals_follow_the_error_format(alice: TokenClient) -> None:
    with override_settings(IDEMPOTENCY={"ERROR_FORMAT": "problem"}):
        answer = status(alice, "unknown")

    assert answer.status_code == 404
    assert answer["Content-Type"] == "application/problem+json"
    assert json.loads(answer.content)["code"] == "idempotency_key_unknown"


class ReadsElsewhereRouter:
    """Writes (and so the records) on ``default``, reads sent to ``shard_a``: a lagging replica."""

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return "shard_a" if model._meta.app_label == "django_idempotency" else None

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return "default" if model._meta.app_label == "django_idempotency" else None


@pytest.mark.django_db(databases=SHARD_TEST_ALIASES, transaction=True)
@pytest.mark.parametrize("database", ["default", None], ids=["DATABASE", "routers"])
def test_the_record_is_read_where_it_is_written_never_on_a_replica(
    alice: TokenClient, database: str | None
) -> None:
    tenant = tenant_of(alice)
    RecordFactory.create(tenant=tenant, key="lagging", state=State.COMPLETED)
    # The replica's stale copy, still in flight: what a read there would answer.
    record_in("shard_a", tenant=tenant, key="lagging", state=State.IN_PROGRESS)
    router = f"{__name__}.ReadsElsewhereRouter"
    with override_settings(DATABASE_ROUTERS=[router], IDEMPOTENCY={"DATABASE": database}):
        answer = status(alice, "lagging")

    assert answer.json()["state"] == "COMPLETED"


@pytest.fixture
def shards() -> Iterator[None]:
    with routed_by_tenant(), override_settings(ROOT_URLCONF="tests.testapp.urls"):
        yield


@pytest.mark.django_db(databases=SHARD_TEST_ALIASES, transaction=True)
def test_a_routed_tenants_record_is_read_from_its_shard(shards: None, alice: TokenClient) -> None:
    record_in("shard_a", tenant="tenant-a", key="routed", state=State.COMPLETED)
    record_in("shard_a", tenant="tenant-a", key="a-only", state=State.COMPLETED)
    record_in("shard_b", tenant="tenant-b", key="routed", state=State.IN_PROGRESS)

    def ask(tenant: str, key: str) -> Any:
        return alice.get(STATUS_URL, {"key": key}, HTTP_X_TENANT=tenant)

    assert ask("tenant-a", "routed").json()["state"] == "COMPLETED"
    assert ask("tenant-b", "routed").json()["state"] == "IN_PROGRESS"
    assert ask("tenant-b", "a-only").status_code == 404


# The operation status view against tombstones and handed-back records.
#
# The status view must tell a client what the protected request itself would
# do with a retry: a response the replay refuses (past retention, kept as a
# tombstone) is not shown either, and a record handed back to the client's
# retry (``RetryFrom``) does not tell the client to wait for it.


def test_with_tombstone_ttl_a_record_past_retention_shows_no_response(
    alice: TokenClient, settings: Any
) -> None:
    """Past ``expires_at``, before the purge made it a tombstone.

    The protected request refuses a retry as ``idempotency_key_expired`` (its
    response is "gone, or due to be"), yet the status view still answers
    ``expired: false`` with the stored body: it judges ``past_retention``,
    which with TOMBSTONE_TTL is true only once the tombstone's time is over.
    """
    settings.IDEMPOTENCY = {
        **getattr(settings, "IDEMPOTENCY", {}),
        "TOMBSTONE_TTL": timedelta(days=7),
    }
    first = post(alice, "/api-view/charges", {"amount": 5}, "late")
    assert first.status_code == 201, first.content
    IdempotencyRecord.objects.update(expires_at=DatabaseLater(-timedelta(hours=1)))

    retry = post(alice, "/api-view/charges", {"amount": 5}, "late")
    answer = alice.get(STATUS_URL, {"key": "late"}).json()

    assert retry.json()["code"] == "idempotency_key_expired"
    assert answer["expired"] is True, answer
    assert answer["response"] is None, answer


def test_a_record_handed_back_to_the_clients_retry_does_not_tell_the_client_to_wait(
    alice: TokenClient,
) -> None:
    """A reconciler's ``RetryFrom`` waits for the client's retry with the same key.

    docs/status.md tells a client that sees CLAIMED "it is running: wait, and
    ask again". A client following the status protocol (ask instead of a blind
    retry) then never retries, and the record waits out its whole retention
    before recovery leaves it UNCERTAIN for an operator. The answer should be
    the one of a record released for retry: 404 ``idempotency_key_unknown``
    ("retry it with the same key"), or anything else that says "retry".
    """
    expires_at = timezone.now() + timedelta(hours=20)
    record = RecordFactory.create(
        tenant=tenant_of(alice),
        key="handed-back",
        state=State.CLAIMED,
        lease_owner="",
        lease_expires_at=expires_at,
        expires_at=expires_at,
        response_status=None,
        response_headers=[],
        response_body=None,
        fencing_token=2,
    )
    IdempotencyStep.objects.create(
        record=record,
        name="authorize",
        provider_key="v1:" + "a" * 60,
        provider_operation_id="auth_1",
        begun_at=timezone.now(),
        updated_at=timezone.now(),
    )

    answer = alice.get(STATUS_URL, {"key": "handed-back"})

    assert answer.status_code == 404, answer.json()
    assert answer.json()["code"] == "idempotency_key_unknown"
