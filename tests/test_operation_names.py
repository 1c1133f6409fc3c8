"""Operation names: the default is unchanged; IDEMPOTENCY["OPERATION_NAMES"] opts into others.

Each case sends a real request through the URLconf of every route kind
(``tests/testapp/operation_urls.py``) and reads the name its record got.
The names the system checks compute for the URLconf (``routes.py``) must
be the same, or a reconciler check would judge names no record has.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, JsonResponse
from django.urls import path, re_path
from django.views.decorators.csrf import csrf_exempt
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIClient
from rest_framework.views import APIView

from django_idempotency import idempotent, recovery
from django_idempotency._routes import protected_urls
from django_idempotency.drf import IdempotentMixin
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, register_reconciler
from django_idempotency.testing import expire_leases
from tests.testapp.models import Charge
from tests.testapp.operation_urls import plain_answer

pytestmark = pytest.mark.urls("tests.testapp.operation_urls")
State = IdempotencyRecord.State
REF = "6f1c1a52-2f43-4d9c-9a57-3a4f2b6c0d11"

#: (method, path, body), then the operation name under "pattern" (today's,
#: byte for byte), "normalised" and "route_name". ``{charge}`` is a Charge's pk.
CASES = [
    pytest.param(
        ("post", "/api/orders/", {"amount": 1}),
        "POST api/orders",
        "POST api/orders",
        "POST orders-list",
        id="router-list",
    ),
    pytest.param(
        ("post", "/api/orders.json", {"amount": 1}),
        "POST api/orders",
        "POST api/orders",
        "POST orders-list",
        id="router-format-suffix",
    ),
    pytest.param(
        ("patch", "/api/orders/{charge}/", {"amount": 2}),
        "PATCH api/orders/(?P<pk>[^/.]+)",
        "PATCH api/orders/{pk}",
        "PATCH orders-detail",
        id="router-detail",
    ),
    pytest.param(
        ("post", "/api/orders/{charge}/pay/", {}),
        "POST api/orders/(?P<pk>[^/.]+)/pay",
        "POST api/orders/{pk}/pay",
        "POST orders-pay",
        id="router-action",
    ),
    pytest.param(
        ("patch", "/tenant/acme/v2/orders/{charge}/", {"amount": 2}),
        "PATCH tenant/<slug:tenant>/v2/orders/(?P<pk>[^/.]+)",
        "PATCH tenant/{tenant}/v2/orders/{pk}",
        "PATCH tenant:v2:orders-detail",
        id="nested-namespaces",
    ),
    pytest.param(
        ("post", "/tenant/acme/plain/7", {}),
        "POST tenant/<slug:tenant>/plain/<int:pk>",
        "POST tenant/{tenant}/plain/{pk}",
        "POST tenant:plain",
        id="namespaced-function-view",
    ),
    pytest.param(
        ("post", "/shops/3/answers", {}),
        "POST shops/<int:shop>/answers",
        "POST shops/{shop}/answers",
        "POST shop-answers",
        id="path-converter",
    ),
    pytest.param(
        ("delete", f"/unnamed/{REF}/answers", {}),
        "DELETE unnamed/<uuid:ref>/answers",
        "DELETE unnamed/{ref}/answers",
        "DELETE unnamed/{ref}/answers",  # no name: the normalised pattern
        id="unnamed-path",
    ),
    pytest.param(
        ("put", "/legacy/answers/9/", {}),
        "PUT ^legacy/answers/(?P<pk>[0-9]+)",
        "PUT legacy/answers/{pk}",
        "PUT legacy-answer",
        id="re-path-named-group",
    ),
    pytest.param(
        ("post", "/legacy/v1.0/1/2/", {}),
        r"POST ^legacy/v1\.0/([0-9]+)/(\d+)",
        "POST legacy/v1.0/{0}/{1}",
        "POST legacy/v1.0/{0}/{1}",  # no name: the normalised pattern
        id="re-path-unnamed-groups",
    ),
    pytest.param(
        ("post", "/odd/first/", {}),
        "POST ^odd/(?:first|second)",
        "POST ^odd/(?:first|second)",  # more than text and arguments: the pattern
        "POST odd",
        id="re-path-alternative",
    ),
]


def operation_of(api: APIClient, request: tuple[str, str, dict[str, Any]]) -> str:
    method, url, body = request
    charge = Charge.objects.create(tenant="anonymous", amount=1)
    key = f"k-{uuid.uuid4()}"
    response = getattr(api, method)(
        url.format(charge=charge.pk), body, format="json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert response.status_code < 300, response.content
    return str(IdempotencyRecord.objects.get(key=key).operation)


def check_names(style: str) -> set[str | None]:
    return {url.operation(handler, style) for url in protected_urls() for handler in url.handlers}


@pytest.mark.parametrize(("request_", "pattern", "normalised", "route_name"), CASES)
def test_default_names_are_todays_route_patterns(
    api: APIClient, request_: Any, pattern: str, normalised: str, route_name: str
) -> None:
    assert operation_of(api, request_) == pattern
    assert pattern in check_names("pattern")


@pytest.mark.parametrize(("request_", "pattern", "normalised", "route_name"), CASES)
def test_pattern_setting_names_as_the_default_does(
    api: APIClient, settings: Any, request_: Any, pattern: str, normalised: str, route_name: str
) -> None:
    settings.IDEMPOTENCY = {"OPERATION_NAMES": "pattern"}
    assert operation_of(api, request_) == pattern


@pytest.mark.parametrize("misspelt", ["route-name", "normalized", None])
def test_a_setting_refused_by_check_e022_names_as_the_default_does(
    api: APIClient, settings: Any, misspelt: Any
) -> None:
    # Never a third set of names: records and provider keys keep theirs.
    settings.IDEMPOTENCY = {"OPERATION_NAMES": misspelt}
    request_ = ("patch", "/api/orders/{charge}/", {"amount": 2})
    assert operation_of(api, request_) == "PATCH api/orders/(?P<pk>[^/.]+)"


@pytest.mark.parametrize(("request_", "pattern", "normalised", "route_name"), CASES)
def test_normalised_names_write_url_arguments_as_placeholders(
    api: APIClient, settings: Any, request_: Any, pattern: str, normalised: str, route_name: str
) -> None:
    settings.IDEMPOTENCY = {"OPERATION_NAMES": "normalised"}
    assert operation_of(api, request_) == normalised
    assert normalised in check_names("normalised")


@pytest.mark.parametrize(("request_", "pattern", "normalised", "route_name"), CASES)
def test_route_names_use_the_url_name_with_its_namespaces(
    api: APIClient, settings: Any, request_: Any, pattern: str, normalised: str, route_name: str
) -> None:
    settings.IDEMPOTENCY = {"OPERATION_NAMES": "route_name"}
    assert operation_of(api, request_) == route_name
    assert route_name in check_names("route_name")


def test_an_explicit_operation_wins_over_every_style(api: APIClient, settings: Any) -> None:
    settings.ROOT_URLCONF = "tests.testapp.urls"
    for style in ("pattern", "normalised", "route_name"):
        settings.IDEMPOTENCY = {"OPERATION_NAMES": style}
        key = f"k-{style}"
        api.post("/mixin/selected", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY=key)
        assert IdempotencyRecord.objects.get(key=key).operation == "mixin-selected"


@pytest.fixture
def route_name_reconciler() -> Iterator[list[str]]:
    """A reconciler registered under the route-name style's name, removed afterwards."""
    seen: list[str] = []

    @register_reconciler("PATCH orders-detail")
    def settle(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        seen.append(record.provider_key)
        return Completed(status=200, body={"reconciled": record.key})

    yield seen
    del recovery._reconcilers["PATCH orders-detail"]


@pytest.mark.django_db(transaction=True)
def test_a_reconciler_under_the_route_name_recovers_a_record_made_under_it(
    settings: Any, route_name_reconciler: list[str]
) -> None:
    settings.IDEMPOTENCY = {"OPERATION_NAMES": "route_name"}
    api = APIClient(raise_request_exception=False)
    charge = Charge.objects.create(tenant="anonymous", amount=1)
    url = f"/api/orders/{charge.pk}/"

    failed = api.patch(url, {"external": True}, format="json", HTTP_IDEMPOTENCY_KEY="stuck")
    record = IdempotencyRecord.objects.get(key="stuck")
    assert failed.status_code == 500
    assert (record.state, record.operation) == (State.UNCERTAIN, "PATCH orders-detail")

    expire_leases()
    report = recovery.recover_stale_records()

    assert report.completed == 1 and route_name_reconciler == [record.provider_key]
    replay = api.patch(url, {"external": True}, format="json", HTTP_IDEMPOTENCY_KEY="stuck")
    assert (replay.status_code, replay.json()) == (200, {"reconciled": "stuck"})
    assert replay["Idempotent-Replayed"] == "true"


# Operation names computed from the request obey the rule step names obey
# (1 to 255 printable characters): a name no record can hold is the
# client's to change, so it is refused with 400 before anything is claimed.


def operation_of_kind(request: Request) -> str:
    """An operation named by a field of the body: the client's input."""
    return f"POST kinds/{dict(request.data)['kind']}"


@api_view(["POST"])
@idempotent(operation=operation_of_kind)  # type: ignore[arg-type]
def kind_answer(request: Request) -> Response:
    return Response({"kind": dict(request.data)["kind"]}, status=201)


@csrf_exempt
@idempotent
def catch_all_answer(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"path": request.path}, status=201)


#: A callable's operation, and a route without a pattern, whose name is the
#: request's path.
urlpatterns = [path("kinds/", kind_answer), re_path(r"", catch_all_answer)]

UNSTORABLE_NAMES = [
    pytest.param("\x00", id="nul"),
    pytest.param("\x1b[2J\x1b[H", id="escape"),
    pytest.param("ok\rstatus: healthy", id="carriage-return"),
    pytest.param("x" * 300, id="longer-than-the-column"),
]


@pytest.mark.urls(__name__)
@pytest.mark.parametrize("kind", UNSTORABLE_NAMES)
def test_a_callables_operation_name_no_record_can_hold_is_400(api: APIClient, kind: str) -> None:
    answer = api.post("/kinds/", {"kind": kind}, format="json", HTTP_IDEMPOTENCY_KEY="k1")

    assert answer.status_code == 400, answer.content
    assert answer.json()["code"] == "idempotency_operation_invalid"
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.urls(__name__)
@pytest.mark.parametrize(
    "path_", ["/a%00b", "/%1b%5b2J", "/a%0d%0astatus:%20healthy", "/" + "x" * 300]
)
def test_a_path_named_operation_no_record_can_hold_is_400(api: APIClient, path_: str) -> None:
    answer = api.post(path_, {}, format="json", HTTP_IDEMPOTENCY_KEY="k1")

    assert answer.status_code == 400, answer.content
    assert answer.json()["code"] == "idempotency_operation_invalid"
    assert not IdempotencyRecord.objects.exists()


@pytest.mark.urls(__name__)
def test_printable_names_from_a_callable_and_a_path_are_kept_as_they_are(
    api: APIClient,
) -> None:
    api.post("/kinds/", {"kind": "café ☕"}, format="json", HTTP_IDEMPOTENCY_KEY="k1")
    api.post("/orders/42", {}, format="json", HTTP_IDEMPOTENCY_KEY="k2")

    names = set(IdempotencyRecord.objects.values_list("operation", flat=True))
    assert names == {"POST kinds/café ☕", "POST /orders/42"}


@pytest.mark.parametrize("name", ["", "\x1b[2J", "a\x00b", "x" * 256, 42])
def test_a_fixed_operation_name_no_record_can_hold_fails_at_import(name: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="operation"):
        idempotent(operation=name)(plain_answer)

    with pytest.raises(ImproperlyConfigured, match="operation"):

        class Named(IdempotentMixin, APIView):
            idempotency_operation = name
