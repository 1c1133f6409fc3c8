"""drf-spectacular: protected operations show the header and the refusals."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django import urls
from django.core.management import call_command
from django.test import override_settings
from drf_spectacular.generators import SchemaGenerator
from rest_framework import generics, serializers

from django_idempotency._openapi.views import _with_headers
from django_idempotency.drf import IdempotentMixin
from tests.testapp import documented_api


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    # drf-spectacular's generator is untyped.
    schema: dict[str, Any] = SchemaGenerator().get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
    return schema


def header(operation: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (
            p
            for p in operation.get("parameters", [])
            if p["in"] == "header" and p["name"] == "Idempotency-Key"
        ),
        None,
    )


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/api-view/charges", "post"),
        ("/cbv/charges", "post"),
        ("/cbv/charges/{id}", "put"),
        ("/cbv/charges/{id}", "delete"),
        ("/generic/charges", "post"),
        ("/viewset/charges/", "post"),
        ("/viewset/charges/{id}/", "put"),
        ("/viewset/charges/{id}/refund/", "post"),
        ("/mixin/charges", "post"),
    ],
)
def test_protected_operations_document_the_header_and_refusals(
    schema: dict[str, Any], path: str, method: str
) -> None:
    operation = schema["paths"][path][method]
    parameter = header(operation)

    assert parameter is not None
    assert parameter["required"] is True
    assert parameter["schema"] == {"type": "string"}
    for code in ("400", "409", "422"):
        content = operation["responses"][code]["content"]["application/json"]["schema"]
        assert set(content["properties"]) == {"detail", "code"}
    # The view's own responses are still there.
    assert set(operation["responses"]) - {"400", "409", "422"}


def test_an_optional_key_is_documented_as_optional(schema: dict[str, Any]) -> None:
    parameter = header(schema["paths"]["/api-view/optional"]["post"])
    assert parameter is not None and parameter.get("required", False) is False


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/mixin/charges", "get"),
        ("/viewset/charges/", "get"),
        ("/api-view/charges", "get"),
        ("/viewset/charges/{id}/", "get"),
    ],
)
def test_unprotected_operations_are_left_alone(
    schema: dict[str, Any], path: str, method: str
) -> None:
    operation = schema["paths"][path][method]
    assert header(operation) is None
    assert "409" not in operation["responses"]


# ``manage.py spectacular`` on an API written as a new user writes it
# (tests/testapp/documented_api.py): the command a project runs in its CI.
DOCUMENTED_API = "tests.testapp.documented_api"
UNSAFE = ("post", "put", "patch", "delete")
REFUSALS = ("400", "409", "413", "422", "503")


def spectacular(*arguments: str) -> tuple[dict[str, Any], str]:
    """The schema ``manage.py spectacular`` prints, and what it says on stderr."""
    out, err = io.StringIO(), io.StringIO()
    # Spectacular prints its warnings to sys.stderr as it finds them.
    with contextlib.redirect_stderr(err):
        call_command(
            "spectacular",
            "--format",
            "openapi-json",
            "--urlconf",
            DOCUMENTED_API,
            *arguments,
            stdout=out,
        )
    return json.loads(out.getvalue()), err.getvalue()


@pytest.fixture(scope="module")
def documented() -> tuple[dict[str, Any], str]:
    return spectacular()


def operations(schema: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


@pytest.mark.parametrize("error_format", ["drf", "problem"])
def test_the_schema_passes_spectacular_validate(error_format: str) -> None:
    with override_settings(IDEMPOTENCY={"ERROR_FORMAT": error_format}):
        schema, _ = spectacular("--validate")

    media_type = "application/problem+json" if error_format == "problem" else "application/json"
    assert media_type in schema["paths"]["/documented/"]["post"]["responses"]["409"]["content"]


def test_descriptions_are_the_authors_own_docstrings_or_absent(
    documented: tuple[dict[str, Any], str],
) -> None:
    schema, _ = documented
    described = {
        (path, method): operation.get("description")
        for path, method, operation in operations(schema)
    }
    undocumented = [
        description
        for (path, _), description in described.items()
        if path.startswith("/undocumented/")
    ]

    assert described[("/documented/", "get")] == documented_api.DOCUMENTED_VIEWSET
    assert described[("/documented/", "post")] == documented_api.DOCUMENTED_VIEWSET
    assert described[("/documented/{id}/", "patch")] == documented_api.DOCUMENTED_VIEWSET
    assert described[("/documented/{id}/refund/", "post")] == documented_api.REFUND_ACTION
    assert described[("/api-view/charges", "get")] == documented_api.API_VIEW
    assert described[("/api-view/charges", "post")] == documented_api.API_VIEW
    assert described[("/apiview/charges", "post")] == documented_api.APIVIEW_POST
    assert described[("/apiview/charges", "delete")] is None
    # Handlers under @extend_schema: its description, else the handler's, else none.
    assert described[("/extended/api-view/charges", "post")] == documented_api.EXTENDED_API_VIEW
    assert described[("/extended/apiview/charges", "post")] == (
        "Make a charge, described by extend_schema's caller."
    )
    assert described[("/notes/", "post")] is None
    # list, create, retrieve, update, partial update, destroy: none has a docstring.
    assert undocumented == [None] * 6


def test_the_mixins_docstring_never_reaches_the_schema(
    documented: tuple[dict[str, Any], str],
) -> None:
    schema, _ = documented
    mixin_doc = inspect.getdoc(IdempotentMixin)

    assert mixin_doc
    assert mixin_doc.splitlines()[0] not in json.dumps(schema)


def test_reads_gain_no_header_and_no_refusals(documented: tuple[dict[str, Any], str]) -> None:
    schema, _ = documented
    reads = [operation for _, method, operation in operations(schema) if method == "get"]

    assert len(reads) == 6  # two lists, two retrieves, the @api_view, the APIView
    for operation in reads:
        assert header(operation) is None
        assert not set(REFUSALS) & set(operation["responses"])


def test_every_unsafe_operation_documents_the_header_and_every_refusal(
    documented: tuple[dict[str, Any], str],
) -> None:
    schema, _ = documented
    writes = [operation for _, method, operation in operations(schema) if method in UNSAFE]

    assert len(writes) == 15  # three of them with @extend_schema
    for operation in writes:
        assert header(operation) is not None
        assert set(REFUSALS) <= set(operation["responses"])


def test_the_view_own_400_schema_is_valid_and_open(
    documented: tuple[dict[str, Any], str],
) -> None:
    schema, _ = documented
    body = schema["paths"]["/documented/"]["post"]["responses"]["400"]["content"][
        "application/json"
    ]["schema"]

    # A serializer's 400 ({"amount": [...]}) shares the status with the refusals.
    assert "required" not in body
    assert body["additionalProperties"] is True


#: A message line: "[file[:line]: ]Warning|Error [breadcrumbs]: message".
WARNING = re.compile(r"^(?:(?P<file>[^\s:]+)(?::(?P<line>\d+))?: )?(?:Warning|Error) \[[^\]]*\]")


def test_spectacular_warnings_name_the_users_own_file(
    documented: tuple[dict[str, Any], str],
) -> None:
    _, stderr = documented
    found = [m for m in map(WARNING.match, stderr.splitlines()) if m]
    user_file = str(Path(documented_api.__file__).resolve())
    class_line = inspect.getsourcelines(documented_api.ChargeAPIView)[1]

    # The views without a serializer draw spectacular's complaints.
    assert {m.group(0) for m in found} >= {
        f"{user_file}: Error [charges]",
        f"{user_file}:{class_line}: Error [ChargeAPIView]",
    }
    assert all(m.group("file") == user_file for m in found)


# Response headers: what protection adds to a protected operation's answers.

PROTECTED = [
    ("/api-view/charges", "post"),
    ("/cbv/charges", "post"),
    ("/viewset/charges/", "post"),
    ("/viewset/charges/{id}/refund/", "post"),
    ("/mixin/charges", "post"),
]


def response_headers(operation: dict[str, Any], code: str) -> dict[str, Any]:
    headers: dict[str, Any] = operation["responses"][code].get("headers", {})
    return headers


@pytest.mark.parametrize(("path", "method"), PROTECTED)
def test_answers_that_may_be_replays_declare_idempotent_replayed(
    schema: dict[str, Any], path: str, method: str
) -> None:
    operation = schema["paths"][path][method]
    stored = [code for code in operation["responses"] if int(code) < 500 and code != "409"]

    # The view's own success, and the 4xx it may store (a serializer's 400).
    assert {"400", "422"} < set(stored)
    assert any(code.startswith("2") for code in stored)
    for code in stored:
        header = response_headers(operation, code)["Idempotent-Replayed"]
        assert header["schema"] == {"type": "string", "enum": ["true"]}
        assert "Retry-After" not in response_headers(operation, code)


@pytest.mark.parametrize(("path", "method"), PROTECTED)
def test_409_and_503_declare_retry_after_and_are_never_replays(
    schema: dict[str, Any], path: str, method: str
) -> None:
    operation = schema["paths"][path][method]

    for code in ("409", "503"):
        headers = response_headers(operation, code)
        assert headers["Retry-After"]["schema"] == {"type": "integer", "minimum": 0}
        assert "Idempotent-Replayed" not in headers


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("2XX", {"Idempotent-Replayed"}),
        ("4XX", {"Idempotent-Replayed"}),
        ("5XX", set()),
        ("default", set()),
        ("429", set()),
        ("409", {"Retry-After"}),
    ],
)
def test_status_ranges_and_the_default_response_get_the_headers_they_may_carry(
    code: str, expected: set[str]
) -> None:
    response = {"description": "", "headers": {"X-Own": {"schema": {"type": "string"}}}}

    declared = _with_headers({code: response})[code]["headers"]

    assert set(declared) == expected | {"X-Own"}


def test_unprotected_operations_declare_no_headers(schema: dict[str, Any]) -> None:
    for path, method in [("/api-view/charges", "get"), ("/viewset/charges/", "get")]:
        for code in schema["paths"][path][method]["responses"]:
            assert not response_headers(schema["paths"][path][method], code)


def test_the_retention_header_is_declared_when_advertised() -> None:
    def declared() -> set[str]:
        generated = SchemaGenerator().get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
        return set(response_headers(generated["paths"]["/viewset/charges/"]["post"], "201"))

    with override_settings(IDEMPOTENCY={"ADVERTISE_RETENTION": True}):
        advertised = declared()
    silent = declared()

    assert advertised == {"Idempotent-Replayed", "Idempotency-Key-Expires-In"}
    assert silent == {"Idempotent-Replayed"}


def test_the_headers_pass_spectacular_validate() -> None:
    with override_settings(IDEMPOTENCY={"ADVERTISE_RETENTION": True}):
        schema, _ = spectacular("--validate")

    post = schema["paths"]["/documented/"]["post"]["responses"]
    assert "Idempotency-Key-Expires-In" in post["201"]["headers"]
    assert "Retry-After" in post["409"]["headers"]


# The operation status view (django_idempotency.urls).


def test_the_status_view_documents_its_parameters_and_answers(schema: dict[str, Any]) -> None:
    operation = schema["paths"]["/idempotency/status/"]["get"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    responses = operation["responses"]

    assert parameters["key"]["in"] == "query" and parameters["key"]["required"] is True
    assert parameters["operation"]["in"] == "query"
    assert not parameters["operation"].get("required", False)
    assert set(responses) == {"200", "300", "400", "404", "503"}
    assert responses["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OperationStatus"
    }
    assert "Retry-After" in responses["503"]["headers"]
    # A read: no Idempotency-Key, no replays.
    assert header(operation) is None
    assert "Idempotent-Replayed" not in json.dumps(responses)


def test_the_status_answers_schema_is_the_serializers(schema: dict[str, Any]) -> None:
    components = schema["components"]["schemas"]
    status = components["OperationStatus"]
    stored = components["StoredAnswer"]

    assert set(status["properties"]) == {
        "key",
        "operation",
        "state",
        "created_at",
        "expires_at",
        "expired",
        "response",
    }
    assert status["properties"]["response"]["nullable"] is True
    assert set(stored["properties"]) == {"status", "headers", "body_encoding", "body"}
    # Inline, never a StateEnum component that the project's own "state" fields share.
    assert status["properties"]["state"]["allOf"][0]["enum"] == [
        "CLAIMED",
        "IN_PROGRESS",
        "UNCERTAIN",
        "COMPLETED",
        "FAILED",
    ]
    assert stored["properties"]["body_encoding"]["allOf"][0]["enum"] == [
        "json",
        "text",
        "base64",
        "omitted",
    ]
    assert not {"StateEnum", "BodyEncodingEnum"} & set(components)


@pytest.mark.parametrize("error_format", ["drf", "problem"])
def test_the_status_views_errors_follow_the_error_format(error_format: str) -> None:
    with override_settings(IDEMPOTENCY={"ERROR_FORMAT": error_format}):
        generated = SchemaGenerator().get_schema(request=None, public=True)  # type: ignore[no-untyped-call]

    media_type = "application/problem+json" if error_format == "problem" else "application/json"
    assert set(
        generated["paths"]["/idempotency/status/"]["get"]["responses"]["404"]["content"]
    ) == {media_type}


def test_the_demo_projects_schema_passes_spectacular_validate() -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        call_command(
            "spectacular",
            "--format",
            "openapi-json",
            "--urlconf",
            "testproject.urls",
            "--validate",
            stdout=out,
        )
    paths = json.loads(out.getvalue())["paths"]

    assert "/idempotency/status/" in paths
    assert "Idempotent-Replayed" in paths["/v1/payments"]["post"]["responses"]["201"]["headers"]


class Order(serializers.Serializer[Any]):
    state = serializers.ChoiceField(choices=["open", "closed"])
    body_encoding = serializers.ChoiceField(choices=["gzip", "identity"])


class OrderView(generics.RetrieveAPIView[Any]):
    serializer_class = Order


def test_mounting_the_status_view_renames_none_of_the_projects_enums() -> None:
    def components(*patterns: Any) -> dict[str, Any]:
        generator = SchemaGenerator(patterns=[urls.path("order", OrderView.as_view()), *patterns])  # type: ignore[no-untyped-call]
        generated = generator.get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
        found: dict[str, Any] = generated["components"]["schemas"]
        return found

    alone = components()
    beside = components(urls.path("idempotency/", urls.include("django_idempotency.urls")))

    assert alone["StateEnum"]["enum"] == beside["StateEnum"]["enum"] == ["open", "closed"]
    assert beside["BodyEncodingEnum"]["enum"] == ["gzip", "identity"]
    assert "OperationStatus" in beside


def test_the_key_header_parameter_follows_the_views_key_source() -> None:
    """``key="header:X"`` documents X; a key from the body documents no header."""
    from tests.testapp import urls

    generator = SchemaGenerator(patterns=urls.urlpatterns)  # type: ignore[no-untyped-call]
    schema: dict[str, Any] = generator.get_schema(request=None, public=True)  # type: ignore[no-untyped-call]
    paths = schema["paths"]

    def headers(path: str) -> list[str]:
        parameters = paths[path]["post"].get("parameters", [])
        return [p["name"] for p in parameters if p["in"] == "header"]

    assert headers("/keyed/delivery-header") == ["X-Delivery"]
    assert headers("/keyed/body-field") == []
    assert headers("/api-view/charges") == ["Idempotency-Key"]
