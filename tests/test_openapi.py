"""drf-spectacular: protected operations show the header and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator


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
