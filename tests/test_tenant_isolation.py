"""No response ever crosses a tenant or an operation (SPEC guarantee 4).

A hypothesis state machine interleaves requests of several tenants to
several operations, reusing a handful of keys everywhere, and keeps a model
of what the store must hold: for each (tenant, operation, key) the input
of the request that ran and the exact response it got. Every answer is
checked against the model:

- a (tenant, operation, key) never seen runs the view (the answer carries
  this request's marker and the caller as the view saw it);
- the same input again is a replay of exactly the first response (bytes);
- another input under the same (tenant, operation, key) is 422;
- an answer the view gave with a retryable status (409, 429, 5xx) stores
  nothing, so the next request runs;
- a record marked in flight answers 409 to its own (tenant, operation,
  key), 422 to another input, and does not disturb anybody else's.

After every step the records table holds exactly the model's responses.
Tenants are token-authenticated users (plus an anonymous client) in one
machine, and come from a header through a ``TENANT`` resolver in the other
(long names, near-duplicates, names that look like the default resolver's).
"""

from __future__ import annotations

import hashlib
import random
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from rest_framework.authentication import BaseAuthentication, TokenAuthentication
from rest_framework.decorators import api_view, authentication_classes, permission_classes
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord
from tests import fuzzing
from tests.factories import TokenFactory, UserFactory
from tests.fuzzing import (
    ECHO_API_VIEW,
    ECHO_ASYNC,
    ECHO_PLAIN,
    ECHO_VIEWSET,
    RELEASED,
    STATUS,
    TENANT,
    Sent,
    Target,
    send,
)
from tests.utils import idempotency_of

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.fuzzing"), pytest.mark.guarantees]
State = IdempotencyRecord.State


@pytest.fixture(autouse=True, scope="module")
def _summary(request: pytest.FixtureRequest) -> None:
    fuzzing.install_summary(request.config)


def header_tenant(request: Any) -> str:
    """A ``TENANT`` resolver that trusts a header (as a gateway-fronted API may)."""
    return str(request.headers.get(TENANT, "no-tenant-header"))


@dataclass(frozen=True)
class Operation:
    """One protected endpoint and method, and how the layer names its key space."""

    name: str
    target: Target
    method: str
    path: str
    #: the key space: two Operations with one ``space`` share records
    space: str
    #: DRF views see the token's user; plain Django views see none
    drf: bool
    #: URL arguments, part of the input (the fingerprint)
    url_input: str = ""


def _at(target: Target, path: str) -> Target:
    return Target(target.name, path, target.kind, target.echo, target.operation)


SHARED_A = Target("echo-shared-a", "/fuzz/shared-a", "drf", True, "fuzz-shared")
SHARED_B = Target("echo-shared-b", "/fuzz/shared-b", "drf", True, "fuzz-shared")
OPERATIONS = [
    Operation("api-view POST", ECHO_API_VIEW, "POST", "/fuzz/api-view", "api POST", True),
    Operation("api-view PATCH", ECHO_API_VIEW, "PATCH", "/fuzz/api-view", "api PATCH", True),
    Operation("viewset create", ECHO_VIEWSET, "POST", "/fuzz/viewset", "viewset POST", True),
    Operation(
        "viewset update 1",
        _at(ECHO_VIEWSET, "/fuzz/viewset/1"),
        "PUT",
        "/fuzz/viewset/1",
        "viewset PUT",
        True,
        "1",
    ),
    Operation(
        "viewset update 2",
        _at(ECHO_VIEWSET, "/fuzz/viewset/2"),
        "PUT",
        "/fuzz/viewset/2",
        "viewset PUT",
        True,
        "2",
    ),
    Operation("plain", ECHO_PLAIN, "POST", "/fuzz/plain", "plain POST", False),
    Operation("async", ECHO_ASYNC, "POST", "/fuzz/async", "async POST", False),
    # Two views given one explicit operation name: one key space, by design.
    Operation("shared-a", SHARED_A, "POST", "/fuzz/shared-a", "fuzz-shared", True),
    Operation("shared-b", SHARED_B, "POST", "/fuzz/shared-b", "fuzz-shared", True),
]
INPUTS = [
    {"amount": 1},
    {"amount": 2},
    {"amount": 1, "note": "x"},
    {"items": [1, 2.5, {"a": None}], "amount": 1},
]
KEYS = ["k1", "k2", "same-key", '"quoted\\"key"']
STATUSES = [201, 201, 201, 201, 200, 400, 402, 422, 409, 429, 500, 503]
#: Header tenants: near-duplicates, long ones and ones holding control
#: characters (stored by digest), look-alikes of the default resolver's
#: names. All latin-1: what an HTTP header can carry.
HEADER_TENANTS = [
    "acme",
    "Acme",
    "acme ",
    "user:1",
    "anonymous",
    "",
    "t" * 128,
    "t" * 129,
    "t" * 129 + "x",
    "x" * 300,
    "caf\u00e9",  # spellchecker:disable-line
    "ac\x00me",
    "acme\x1b[2J",
]


@dataclass(frozen=True)
class Call:
    """Who asks which operation under which key with which input."""

    tenant: int
    operation: Operation
    key: str
    input_index: int


@dataclass
class Stored:
    """What the store must hold for one (tenant, operation, key)."""

    input: tuple[int, str]
    status: int
    content: bytes
    in_flight: bool = False


class TenantMachine(RuleBasedStateMachine):
    """Subclasses say who the tenants are and how a request carries its tenant."""

    test = "tenant isolation"
    tenant_count = 4

    def __init__(self) -> None:
        super().__init__()
        self._atomic = transaction.atomic()
        self._atomic.__enter__()
        self.model: dict[tuple[str, str, str], Stored] = {}
        self.setup_tenants()

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._atomic.__exit__(None, None, None)

    # --- the tenants ------------------------------------------------------------
    def setup_tenants(self) -> None:
        raise NotImplementedError

    def tenant_headers(self, tenant: int) -> dict[str, str]:
        raise NotImplementedError

    def scope_tenant(self, tenant: int, operation: Operation) -> str:
        """Who the layer takes the caller for (the model's tenant)."""
        raise NotImplementedError

    def seen_as(self, tenant: int, operation: Operation) -> str:
        """Who the echo view reports the caller to be."""
        raise NotImplementedError

    # --- requests --------------------------------------------------------------
    sent = Bundle("sent")

    @rule(
        target=sent,
        tenant=st.integers(0, 99),
        operation=st.sampled_from(OPERATIONS),
        key=st.sampled_from(KEYS),
        input_index=st.integers(0, len(INPUTS) - 1),
        status=st.sampled_from(STATUSES),
        seed=st.integers(0, 2**16),
    )
    def request(
        self,
        tenant: int,
        operation: Operation,
        key: str,
        input_index: int,
        status: int,
        seed: int,
    ) -> Call:
        call = Call(tenant % self.tenant_count, operation, key, input_index)
        self.send(call, status, seed)
        return call

    @rule(
        target=sent,
        previous=sent,
        change=st.sampled_from(["none", "none", "tenant", "operation", "input", "key"]),
        other=st.integers(0, 99),
        status=st.sampled_from(STATUSES),
        seed=st.integers(0, 2**16),
    )
    def again(self, previous: Call, change: str, other: int, status: int, seed: int) -> Call:
        """A retry of an earlier request, or a neighbour of it differing in one thing."""
        call = previous
        if change == "tenant":
            call = replace(previous, tenant=other % self.tenant_count)
        elif change == "operation":
            call = replace(previous, operation=OPERATIONS[other % len(OPERATIONS)])
        elif change == "input":
            call = replace(previous, input_index=other % len(INPUTS))
        elif change == "key":
            call = replace(previous, key=KEYS[other % len(KEYS)])
        self.send(call, status, seed)
        return call

    def send(self, call: Call, status: int, seed: int) -> None:
        tenant, operation, key = call.tenant, call.operation, call.key
        fuzzing.note_input(self.test, operation.name)
        # Any spelling of the input (key order, whitespace, numbers) is one input.
        body = fuzzing.spell(INPUTS[call.input_index], random.Random(seed)).encode()
        sent = Sent(
            operation.target,
            operation.method,
            body=body,
            key=key,
            headers={**self.tenant_headers(tenant), STATUS: str(status)},
        )
        scope = (
            self.scope_tenant(tenant, operation),
            operation.space,
            fuzzing.expected_key(key) or "",
        )
        given = (call.input_index, operation.url_input)
        seen = send(sent)
        fuzzing.note(self.test, seen)
        stored = self.model.get(scope)
        if stored is not None and stored.input != given:
            assert seen.label == "422 idempotency_key_reused", (scope, seen.label)
        elif stored is not None and stored.in_flight:
            assert seen.label == "409 idempotency_request_in_progress", (scope, seen.label)
            assert seen.headers.get("Retry-After")
        elif stored is not None:
            assert seen.replayed, (scope, seen.label)
            assert (seen.status, seen.content) == (stored.status, stored.content), (
                "a replay that is not the first response of this (tenant, operation, key, input)"
            )
            assert seen.headers["Idempotency-Key"] == key
        else:
            assert seen.label == f"{status} view", (scope, seen.label, seen.content[:200])
            assert seen.body["marker"] == sent.marker
            assert seen.body["tenant"] == self.seen_as(tenant, operation)
            assert seen.headers["Idempotency-Key"] == key
            if not (status in RELEASED or status >= 500):
                self.model[scope] = Stored(given, status, seen.content)

    @precondition(lambda self: any(not s.in_flight for s in self.model.values()))
    @rule(choice=st.integers(0, 2**16))
    def mark_in_flight(self, choice: int) -> None:
        """Another request is running this (tenant, operation, key) right now."""
        scopes = sorted(scope for scope, s in self.model.items() if not s.in_flight)
        scope = scopes[choice % len(scopes)]
        record = self._record(self.model[scope])
        record.state = State.CLAIMED
        record.lease_expires_at = timezone.now() + timedelta(hours=1)
        record.save(update_fields=["state", "lease_expires_at"])
        self.model[scope].in_flight = True

    @precondition(lambda self: any(s.in_flight for s in self.model.values()))
    @rule(choice=st.integers(0, 2**16))
    def finish_in_flight(self, choice: int) -> None:
        scopes = sorted(scope for scope, s in self.model.items() if s.in_flight)
        scope = scopes[choice % len(scopes)]
        stored = self.model[scope]
        record = self._record(stored)
        record.state = State.COMPLETED if stored.status < 400 else State.FAILED
        record.lease_expires_at = None
        record.save(update_fields=["state", "lease_expires_at"])
        stored.in_flight = False

    @staticmethod
    def _record(stored: Stored) -> IdempotencyRecord:
        # Every stored body carries a marker of its own: it names one record.
        (record,) = [
            r
            for r in IdempotencyRecord.objects.all()
            if r.response_body is not None and bytes(r.response_body) == stored.content
        ]
        return record

    @invariant()
    def the_store_holds_exactly_the_models_first_responses(self) -> None:
        in_store = Counter(
            (r.key, r.response_status, bytes(r.response_body or b""))
            for r in IdempotencyRecord.objects.all()
        )
        in_model = Counter(
            (scope[2], stored.status, stored.content) for scope, stored in self.model.items()
        )
        assert in_store == in_model


class TokenTenants(TenantMachine):
    """Tenants are users authenticated by DRF tokens, plus an anonymous client."""

    test = "tenant isolation (token users)"
    tenant_count = 4

    def setup_tenants(self) -> None:
        self.users = []
        self.tokens = []
        for _ in range(self.tenant_count - 1):
            user = UserFactory.create(username=f"tenant-{uuid.uuid4().hex[:12]}")
            self.users.append(user)
            self.tokens.append(TokenFactory.create(user=user).key)

    def tenant_headers(self, tenant: int) -> dict[str, str]:
        if tenant < len(self.tokens):
            return {"Authorization": f"Token {self.tokens[tenant]}"}
        return {}  # the anonymous client

    def scope_tenant(self, tenant: int, operation: Operation) -> str:
        # Plain Django views do not authenticate DRF tokens: to the layer
        # (and to the view) every caller there is the anonymous one.
        if tenant < len(self.users) and operation.drf:
            return f"user:{self.users[tenant].pk}"
        return "anonymous"

    def seen_as(self, tenant: int, operation: Operation) -> str:
        return self.scope_tenant(tenant, operation)


class HeaderTenants(TenantMachine):
    """Tenants come from a header through IDEMPOTENCY["TENANT"]."""

    test = "tenant isolation (header resolver)"
    tenant_count = len(HEADER_TENANTS)

    def setup_tenants(self) -> None:
        pass

    def tenant_headers(self, tenant: int) -> dict[str, str]:
        return {TENANT: HEADER_TENANTS[tenant]}

    def scope_tenant(self, tenant: int, operation: Operation) -> str:
        return HEADER_TENANTS[tenant]

    def seen_as(self, tenant: int, operation: Operation) -> str:
        return f"header:{HEADER_TENANTS[tenant]}"


@pytest.mark.not_under(
    "encryption", reason="its model compares the stored body raw; ENCRYPTION_KEYS seals it at rest"
)
def test_token_authenticated_tenants() -> None:
    run_state_machine_as_test(
        TokenTenants,
        settings=fuzzing.fuzz_settings(in_suite=20, stateful=True, stateful_step_count=40),
    )


def test_tenants_from_a_header_resolver() -> None:
    with override_settings(IDEMPOTENCY={"TENANT": "tests.test_tenant_isolation.header_tenant"}):
        run_state_machine_as_test(
            HeaderTenants,
            settings=fuzzing.fuzz_settings(in_suite=20, stateful=True, stateful_step_count=40),
        )


def test_a_replay_is_bound_to_the_tenant_that_created_it() -> None:
    """The guarantee in one picture: one key, two tenants, two operations."""
    tokens = [TokenFactory.create(user__username=name).key for name in ("alice", "bob")]
    answers = []
    for token in tokens:
        for target in (ECHO_API_VIEW, ECHO_VIEWSET):
            sent = Sent(target, key="shared", headers={"Authorization": f"Token {token}"})
            seen = send(sent)
            assert seen.label == "201 view" and seen.body["marker"] == sent.marker
            answers.append(seen.content)
    assert len(set(answers)) == 4
    assert IdempotencyRecord.objects.filter(key="shared").count() == 4


def test_a_tenant_named_like_another_tenants_digest_is_another_tenant() -> None:
    long_name = "t" * 129
    look_alike = "sha256:" + hashlib.sha256(long_name.encode()).hexdigest()
    with override_settings(IDEMPOTENCY={"TENANT": "tests.test_tenant_isolation.header_tenant"}):
        first = send(Sent(ECHO_API_VIEW, key="k", headers={TENANT: long_name}))
        other = Sent(ECHO_API_VIEW, key="k", headers={TENANT: look_alike})
        second = send(other)
    assert first.label == "201 view"
    assert second.label == "201 view", "another tenant's response was replayed"
    assert second.body["marker"] == other.marker


def test_tenants_differing_in_trailing_spaces_are_two_tenants() -> None:
    with override_settings(IDEMPOTENCY={"TENANT": "tests.test_tenant_isolation.header_tenant"}):
        first = send(Sent(ECHO_API_VIEW, key="k", headers={TENANT: "acme"}))
        other = Sent(ECHO_API_VIEW, key="k", headers={TENANT: "acme "})
        second = send(other)
    assert first.label == "201 view"
    assert second.label == "201 view", "another tenant's response was replayed"
    assert second.body["marker"] == other.marker


#: Tenants a resolver may read from client input that no record may hold as
#: they are: PostgreSQL refuses a NUL in text; ESC starts a terminal control
#: sequence, CR rewrites a printed line, U+202E reorders it; a lone surrogate
#: cannot be encoded for any database.
UNPRINTABLE_TENANTS = ["ac\x00me", "\x1b]0;pwned\x07acme", "acme\rstatus: healthy", "\u202eemca"]


@pytest.mark.parametrize("tenant", UNPRINTABLE_TENANTS, ids=["nul", "esc", "cr", "bidi"])
def test_a_tenant_holding_control_characters_is_stored_by_its_digest(tenant: str) -> None:
    with override_settings(IDEMPOTENCY={"TENANT": "tests.test_tenant_isolation.header_tenant"}):
        first = send(Sent(ECHO_API_VIEW, key="k", headers={TENANT: tenant}))
        again = send(Sent(ECHO_API_VIEW, key="k", headers={TENANT: tenant}))
        other = Sent(ECHO_API_VIEW, key="k", headers={TENANT: tenant.replace("a", "b")})
        neighbour = send(other)

    assert first.label == "201 view"
    assert again.replayed and again.content == first.content  # one tenant, found again
    assert neighbour.label == "201 view", "another tenant's response was replayed"
    stored = set(IdempotencyRecord.objects.values_list("tenant", flat=True))
    digest = "sha256:" + hashlib.sha256(tenant.encode("utf-8")).hexdigest()
    assert digest in stored
    assert all(value.isprintable() for value in stored), stored


# --- No credential is ever a tenant ---------------------------------------------


class TokenWithoutUser(TokenAuthentication):
    """A DRF token that authenticates a client, not a user (a machine client)."""

    def authenticate_credentials(self, key: str) -> tuple[Any, Any]:
        _, token = super().authenticate_credentials(key)
        return AnonymousUser(), token


@dataclass(frozen=True)
class ApiKey:
    """An auth object whose primary key is its secret, with no user."""

    pk: str


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        secret = request.headers.get("X-Api-Key")
        return None if secret is None else (AnonymousUser(), ApiKey(secret))


def _tenant_echo(request: Request) -> Response:
    return Response({"tenant": idempotency_of(request).tenant}, status=201)


@api_view(["POST"])
@authentication_classes([TokenAuthentication])
@permission_classes([])
@idempotent(operation="POST tenant-echo")
def token_user_view(request: Request) -> Response:
    return _tenant_echo(request)


@api_view(["POST"])
@authentication_classes([TokenWithoutUser])
@permission_classes([])
@idempotent(operation="POST tenant-echo")
def token_client_view(request: Request) -> Response:
    return _tenant_echo(request)


@api_view(["POST"])
@authentication_classes([ApiKeyAuthentication])
@permission_classes([])
@idempotent(operation="POST tenant-echo")
def api_key_view(request: Request) -> Response:
    return _tenant_echo(request)


def _call(view: Any, key: str, **headers: str) -> Any:
    request = APIRequestFactory().post(
        "/tenant-echo", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY=key, **headers
    )
    response = view(request)
    if hasattr(response, "render"):
        response.render()  # the first answer; a replay is a finished HttpResponse
    return response


def _stored_text() -> str:
    """Every column of every record, as text (the body decoded)."""
    rows = IdempotencyRecord.objects.values()
    return repr(
        [
            {
                name: bytes(value).decode("latin-1") if isinstance(value, memoryview) else value
                for name, value in row.items()
            }
            for row in rows
        ]
    )


@pytest.mark.parametrize("view", [token_user_view, token_client_view], ids=["user", "client"])
def test_a_token_authenticated_request_stores_no_part_of_the_token(view: Any) -> None:
    token = TokenFactory.create(user__username="machine")

    response = _call(view, "k", HTTP_AUTHORIZATION=f"Token {token.key}")

    assert response.status_code == 201
    record = IdempotencyRecord.objects.get()
    assert record.tenant == f"user:{token.user_id}"
    stored = _stored_text()
    for start in range(len(token.key) - 7):
        assert token.key[start : start + 8] not in stored


def test_two_users_tokens_remain_two_tenants() -> None:
    tokens = [TokenFactory.create(user__username=name) for name in ("alice", "bob")]
    answers = [
        _call(token_client_view, "same", HTTP_AUTHORIZATION=f"Token {token.key}")
        for token in tokens
    ]

    assert [answer.status_code for answer in answers] == [201, 201]
    assert not any(answer.get("Idempotent-Replayed") for answer in answers)
    assert len(set(IdempotencyRecord.objects.values_list("tenant", flat=True))) == 2


def test_an_opaque_credential_is_stored_as_a_keyed_digest() -> None:
    secrets = ["sk_live_" + uuid.uuid4().hex, "sk_live_" + uuid.uuid4().hex]

    first = _call(api_key_view, "same", HTTP_X_API_KEY=secrets[0])
    again = _call(api_key_view, "same", HTTP_X_API_KEY=secrets[0])
    other = _call(api_key_view, "same", HTTP_X_API_KEY=secrets[1])

    assert again.get("Idempotent-Replayed") == "true"  # one client, one tenant
    assert other.status_code == 201 and not other.get("Idempotent-Replayed")
    tenants = set(IdempotencyRecord.objects.values_list("tenant", flat=True))
    assert len(tenants) == 2
    stored = _stored_text()
    assert not any(secret[8:16] in stored for secret in secrets)
    plain = [hashlib.sha256(secret.encode()).hexdigest() for secret in secrets]
    assert not any(digest in stored for digest in plain)  # keyed, not a bare hash
    assert first.status_code == 201
