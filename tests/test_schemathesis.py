"""schemathesis against the demo project's OpenAPI schema, in-process.

The schema is the one the demo serves at ``/v1/schema`` (drf-spectacular;
django-idempotency's extension adds the ``Idempotency-Key`` header and the
layer's refusals to the protected operations). schemathesis generates
requests from it, valid and invalid (``GenerationMode.all()``), for every
operation of the payments API, and sends them through Django's WSGI
handler, authenticated with a real DRF token. ``POST /v1/payments`` charges
through the payment provider simulator (the ``payments_provider`` fixture).

Checks on every response:

- ``not_a_server_error``: no 5xx at all (the demo's views are robust; its
  only 5xx, 502 for an unreachable provider, needs the simulator's failure
  modes, which these tests never ask for);
- ``response_schema_conformance`` and ``content_type_conformance`` for
  documented statuses;
- the status is one the operation documents, or one of the statuses a DRF
  view answers without documenting it (404, 415, and a 400 with field
  errors) or the demo's own (402 declined, 409 order_already_paid);
- any ``code`` in a refusal is one the layer or the demo documents.

Requests share one database state within a run, so keys repeat across
generated requests: replays (``Idempotent-Replayed: true``) and 422
``idempotency_key_reused`` come up along with first executions.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import hypothesis.core
import hypothesis.vendor.pretty
import pytest
from django.apps import apps
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import given
from hypothesis import strategies as st

if not apps.is_installed("payments"):
    pytest.skip("the demo project's app is not installed", allow_module_level=True)

schemathesis = pytest.importorskip("schemathesis")

# Importing schemathesis swaps Hypothesis's RepresentationPrinter, process-wide,
# for one that prints nothing (a speed-up for huge schemas): every other
# Hypothesis test in the run would then report its failing example as
# "test(x=, y=)". Put Hypothesis's own printer back; schemathesis works without
# its speed-up. (Its pytest plugin does the same at startup: the suite runs
# with ``-p no:schemathesis``, or this line restores it once this module loads.)
hypothesis.core.RepresentationPrinter = hypothesis.vendor.pretty.RepresentationPrinter  # type: ignore[attr-defined]

from payments.models import Payment  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import Failure, FailureGroup  # noqa: E402
from schemathesis.core.transport import Response  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
)

from tests import fuzzing  # noqa: E402
from tests.factories import TokenFactory, UserFactory  # noqa: E402

pytestmark = [pytest.mark.django_db, pytest.mark.urls("testproject.urls")]
TEST = "schemathesis (payments API)"


@pytest.fixture(autouse=True, scope="module")
def _summary(request: pytest.FixtureRequest) -> None:
    fuzzing.install_summary(request.config)


@pytest.fixture
def wsgi_app() -> Iterator[WSGIHandler]:
    """Django's WSGI handler, sharing the test's connection and transaction.

    Django closes the database connection when a request starts and ends;
    Django's own test client switches that off around each request, and so
    does this fixture, for the whole test.
    """
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield WSGIHandler()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def test_payments_api_against_its_schema(payments_provider: str, wsgi_app: WSGIHandler) -> None:
    schema = schemathesis.openapi.from_wsgi("/v1/schema", wsgi_app)
    # The provider simulator is the session's, shared with other tests, and
    # provider keys derive from (tenant, operation, key): a user id of its
    # own keeps this test's charges apart from theirs (SQLite reuses ids
    # after a rollback).
    user = UserFactory.create(
        username="schemathesis", id=random.SystemRandom().randrange(10**8, 10**9)
    )
    token = TokenFactory.create(user=user).key
    # Something for the detail and refund operations to find.
    payment = Payment.objects.create(owner=user, order_id="ORD-SEED", amount=10_000, currency="EUR")
    by_operation = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path.startswith("/v1/webhooks/"):
            continue  # signed by their senders: tests/test_webhooks.py
        positive = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
        negative = operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)
        variants = [positive, negative]
        if "{id}" in operation.path:
            # The seeded payment too, not only ids that do not exist.
            seeded = {"id": payment.pk}
            positive = operation.as_strategy(
                generation_mode=GenerationMode.POSITIVE, path_parameters=seeded
            )
            variants += [
                positive,
                operation.as_strategy(
                    generation_mode=GenerationMode.NEGATIVE, path_parameters=seeded
                ),
            ]
        if operation.method.upper() == "POST":
            variants += [_nudged(positive)] * len(variants)  # half of them nudged
            by_operation += [st.one_of(variants)] * 3  # the protected ones, more often
        else:
            by_operation.append(st.one_of(variants))
    auth = {"Authorization": f"Token {token}"}
    failures: list[str] = []

    @fuzzing.fuzz_settings(in_suite=120)
    @given(case=st.one_of(by_operation), retry=st.booleans())
    def run(case: Any, retry: bool) -> None:
        fuzzing.note_input(TEST, f"{case.method} {case.path}")
        first = check(case)
        if retry and case.method.upper() == "POST":
            # The very same request again: the stored answer, byte for byte,
            # or the same refusal; never a second execution.
            again = check(case)
            if _refused_before_the_view(first) or _refused_input(first):
                assert not _replayed(again)
                assert (again.status_code, _code(again)) == (first.status_code, _code(first))
            elif first.status_code < 500 and first.status_code not in RELEASED:
                assert _replayed(again), (
                    first.status_code,
                    first.content[:300],
                    again.content[:300],
                )
                assert again.status_code == first.status_code
                assert again.content == first.content

    def check(case: Any) -> Any:
        response = case.call(headers=auth)
        body = _json(response)
        code = body.get("code") if isinstance(body, dict) else None
        label = f"{case.method} {case.path} -> {response.status_code}"
        if _replayed(response):
            label += " replay"
        elif isinstance(code, str):
            label += f" {code}"
        try:
            case.validate_response(response, checks=CHECKS, headers=auth)
        except (Failure, FailureGroup) as exc:
            found = exc.exceptions if isinstance(exc, FailureGroup) else (exc,)
            for failure in found:
                failures.append(f"{label}: {failure.title}: {str(failure)[:800]}")
        fuzzing.STATS.outcomes[TEST][label] += 1
        problem = _undocumented(case, response.status_code, body)
        if problem:
            failures.append(f"{label}: {problem}")
        return response

    run()
    assert not failures, "\n\n".join(failures[:20])


#: A few keys, so that generated requests meet again: replays and 422s.
KEYS = ["k-1", "k-2", '"k-3"', "8e03978e-40d5-43e8-bc93-6894a57f9324"]


def _nudged(strategy: Any) -> Any:
    """Generated cases, with a key from KEYS and a real currency.

    schemathesis's random strings are rarely a valid key (visible ASCII)
    and never an ISO currency, so without this nudge nearly every POST
    stops at a 400 and the views' success paths go untested.
    """

    def nudge(args: tuple[Any, str, str]) -> Any:
        case, key, currency = args
        case.headers = {**(case.headers or {}), "Idempotency-Key": key}
        if isinstance(case.body, dict) and "currency" in case.body:
            case.body = {**case.body, "currency": currency}
        return case

    keys = st.sampled_from(KEYS) | st.uuids().map(str)  # some meet again, some are new
    return st.tuples(strategy, keys, st.sampled_from(["EUR", "usd", "GBP"])).map(nudge)


CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
#: Codes an answer may carry: the layer's, DRF's, and the demo's own.
CODES = {
    "idempotency_key_missing",
    "idempotency_key_invalid",
    "idempotency_key_reused",
    "idempotency_request_in_progress",
    "idempotency_body_too_large",
    "parse_error",
    # the operation status view's (django_idempotency.urls)
    "idempotency_key_unknown",
    "idempotency_operation_ambiguous",
    "idempotency_operation_invalid",
    # the demo's (payments/views.py)
    "order_already_paid",
    "card_declined",
    "provider_key_conflict",
}
#: Statuses a DRF view answers without documenting them.
UNDOCUMENTED_OK = {400, 404, 415}
#: The demo's schema documents its refund action (a POST @action) as 200;
#: it answers 201. drf-spectacular's default; the view has no
#: @extend_schema to say otherwise (payments/views.py, not the package).
DEMO_SCHEMA_GAPS = {("POST", "/v1/payments/{id}/refunds"): {201}}
#: The demo's own: 402 (declined), 409 (order already paid), 422 (the
#: provider refused the request, or a provider key conflict).
DEMO_STATUSES = {402, 409, 422}


LAYER_REFUSALS = {
    "idempotency_key_missing",
    "idempotency_key_invalid",
    "idempotency_key_reused",
    "idempotency_body_too_large",
    "parse_error",
}
RELEASED = {408, 409, 423, 425, 429}


def _refused_before_the_view(response: Any) -> bool:
    """The layer's refusals, DRF's when the layer read an unreadable body, unrouted paths."""
    if response.status_code in (400, 413, 422) and _code(response) in LAYER_REFUSALS:
        return True
    body = _json(response)
    if response.status_code == 404 and body is None:
        return True  # Django's own 404 page: the path matched no route at all
    return (
        response.status_code in (400, 415)
        and isinstance(body, dict)
        and set(body) == {"detail"}
        and str(body["detail"]).startswith((*fuzzing.DRF_PARSE_ERRORS, "Unsupported media type"))
    )


def _refused_input(response: Any) -> bool:
    """A serializer's ValidationError raised by the view: answered, not stored.

    The refund beyond the payment has the same shape, but the view returns
    it: a stored, replayed 400.
    """
    body = _json(response)
    return (
        response.status_code == 400
        and isinstance(body, dict)
        and bool(body)
        and "detail" not in body
        and all(isinstance(value, list) for value in body.values())
        and not str((body.get("amount") or [""])[0]).startswith("Refunds would total")
    )


def _replayed(response: Response) -> bool:
    return response.headers.get("idempotent-replayed") == ["true"]


def _code(response: Any) -> Any:
    body = _json(response)
    return body.get("code") if isinstance(body, dict) else None


def _json(response: Any) -> Any:
    try:
        return response.json()
    except Exception:
        return None


def _undocumented(case: Any, status: int, body: Any) -> str | None:
    documented = {int(code) for code in case.operation.definition.raw.get("responses", {})}
    gaps = DEMO_SCHEMA_GAPS.get((case.method.upper(), case.path), set())
    if status not in documented | UNDOCUMENTED_OK | DEMO_STATUSES | gaps:
        return f"status {status} is not documented ({sorted(documented)})"
    if isinstance(body, dict) and "code" in body and body["code"] not in CODES:
        return f"undocumented code {body['code']!r}"
    return None


def test_the_documented_400_admits_the_views_own_validation_errors(
    wsgi_app: WSGIHandler,
) -> None:
    schema = schemathesis.openapi.from_wsgi("/v1/schema", wsgi_app)
    auth = {"Authorization": f"Token {TokenFactory.create(user__username='validation').key}"}
    case = schema["/v1/payments"]["POST"].Case(
        body={"order_id": "A-1", "amount": 0, "currency": "EUR"},
        headers={"Idempotency-Key": "k-1"},
        media_type="application/json",
    )
    response = case.call(headers=auth)
    assert response.status_code == 400 and "amount" in response.json()
    case.validate_response(response, checks=[response_schema_conformance], headers=auth)
