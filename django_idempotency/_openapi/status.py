"""drf-spectacular: the operation status view documents itself.

Loaded by the AppConfig when drf-spectacular is installed, as ``openapi``.
The answers' schemas are the serializers that render them
(``status_answers``); the errors are in the configured ``ERROR_FORMAT``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerFieldExtension, OpenApiViewExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyRecord
from django_idempotency.status import (
    AMBIGUOUS_CODE,
    BODY_ENCODINGS,
    KeyUnknown,
    OperationChoicesSerializer,
    OperationStatusSerializer,
)


class IdempotencyErrorSerializer(serializers.Serializer[dict[str, Any]]):
    """An error: what happened, and a stable code."""

    detail = serializers.CharField()
    code = serializers.CharField()


class IdempotencyProblemSerializer(IdempotencyErrorSerializer):
    """An error as RFC 9457 problem details (``ERROR_FORMAT = "problem"``)."""

    type = serializers.URLField()
    title = serializers.CharField()
    status = serializers.IntegerField()


_PARAMETERS = [
    OpenApiParameter(
        "key",
        OpenApiTypes.STR,
        OpenApiParameter.QUERY,
        required=True,
        description="The Idempotency-Key the operation was requested with.",
    ),
    OpenApiParameter(
        "operation",
        OpenApiTypes.STR,
        OpenApiParameter.QUERY,
        description="The operation's name, as a 300 answer lists them: needed only when "
        "you used the key for several operations.",
    ),
    OpenApiParameter(
        "Retry-After",
        OpenApiTypes.INT,
        OpenApiParameter.HEADER,
        response=[503],
        description="Seconds to wait before asking again.",
    ),
]


def _schema() -> dict[str, Any]:
    problem = idempotency_settings.ERROR_FORMAT == "problem"
    error = IdempotencyProblemSerializer if problem else IdempotencyErrorSerializer
    media_type = "application/problem+json" if problem else "application/json"
    return {
        "operation_id": "idempotency_status",
        "summary": "The state and outcome of your operation under an Idempotency-Key",
        "description": (
            "Ask this after a request timed out or its connection broke, instead of retrying "
            "blindly. 404: the request was not seen (or was released to be retried): retry "
            "it with the same key. CLAIMED or IN_PROGRESS: it runs, ask again shortly. "
            "UNCERTAIN: the server is finding out whether an external call happened, ask "
            "again later. COMPLETED or FAILED: response holds the answer. Only your own "
            "operations are visible."
        ),
        "parameters": _PARAMETERS,
        "responses": {
            200: OperationStatusSerializer,
            300: OpenApiResponse(
                OperationChoicesSerializer,
                description=f"{AMBIGUOUS_CODE}: the key names several of your operations; "
                "ask again with one of them as operation.",
            ),
            (400, media_type): OpenApiResponse(
                error,
                description="key missing (idempotency_key_missing) or malformed "
                "(idempotency_key_invalid), or an operation no record can have "
                "(idempotency_operation_invalid).",
            ),
            (404, media_type): OpenApiResponse(
                error,
                description=f"{KeyUnknown.default_code}: you have no operation under this key.",
            ),
            (503, media_type): OpenApiResponse(
                error,
                description="The records cannot be read now (idempotency_store_unavailable).",
            ),
        },
    }


def _inline_enum(values: Iterable[str]) -> dict[str, Any]:
    # drf-spectacular's enum hook turns every property holding an "enum" into
    # a component named after the property ("StateEnum"), and renames the
    # project's own on a collision ("OrderStateEnum"). Inside allOf the hook
    # leaves it alone: mounting the view never renames the project's schema.
    return {"allOf": [{"type": "string", "enum": list(values)}]}


class StateFieldExtension(OpenApiSerializerFieldExtension):  # type: ignore[no-untyped-call]
    """The states, inline: no ``StateEnum`` component to rename the project's own."""

    target_class = "django_idempotency.status.StateField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return _inline_enum(IdempotencyRecord.State.values)


class BodyEncodingFieldExtension(OpenApiSerializerFieldExtension):  # type: ignore[no-untyped-call]
    """The body encodings, inline, as ``StateFieldExtension``."""

    target_class = "django_idempotency.status.BodyEncodingField"

    def map_serializer_field(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        return _inline_enum(BODY_ENCODINGS)


class OperationStatusViewExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Documents ``OperationStatusView`` (and subclasses) with its parameters and answers."""

    target_class = "django_idempotency.status.OperationStatusView"
    match_subclasses = True

    def view_replacement(self) -> Any:
        view_class = self.target

        def get(self: Any, request: Request) -> Response:  # pragma: no cover - never called
            return view_class.get(self, request)  # type: ignore[no-any-return]

        get.__doc__ = None
        return type(
            view_class.__name__,
            (view_class,),
            {
                "__module__": view_class.__module__,
                "__qualname__": view_class.__qualname__,
                "get": extend_schema(**_schema())(get),
            },
        )
