"""drf-spectacular integration: protected operations document themselves.

Loaded by the AppConfig when drf-spectacular is installed. Every operation
that ``@idempotent``, ``IdempotentMixin`` or ``IdempotencyMiddleware``
protects gets the
``Idempotency-Key`` header parameter (required or not, as configured) and
the 400, 409, 413, 422 and 503 responses it can answer with, in the
configured error format; handlers under ``@extend_schema`` included. Its
responses declare the headers they may carry: ``Idempotent-Replayed`` (and,
with ``ADVERTISE_RETENTION``, ``Idempotency-Key-Expires-In``) on every
status that is stored and so may be a replay, ``Retry-After`` on 409 and 503.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import build_basic_type, build_object_type, get_doc
from drf_spectacular.settings import spectacular_settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter

from django_idempotency._middleware.frameworks import protection_by_middleware
from django_idempotency._protection.flow import Options
from django_idempotency.conf import idempotency_settings
from django_idempotency.drf import IdempotentMixin, protection_of
from django_idempotency.responses import REPLAYED_HEADER, RETENTION_HEADER, RETRYABLE_STATUSES

_ERROR = build_object_type(
    properties={
        "detail": build_basic_type(OpenApiTypes.STR),
        "code": build_basic_type(OpenApiTypes.STR),
    },
    required=["detail", "code"],
)
_PROBLEM = build_object_type(
    properties={
        "type": build_basic_type(OpenApiTypes.URI),
        "title": build_basic_type(OpenApiTypes.STR),
        "status": build_basic_type(OpenApiTypes.INT),
        "detail": build_basic_type(OpenApiTypes.STR),
        "code": build_basic_type(OpenApiTypes.STR),
    },
    required=["type", "title", "status", "detail", "code"],
)
# The view's own 400s (a serializer's {"amount": [...]}) share the status
# with the key's refusals, so nothing is required and more may come. (An
# empty "required" list is invalid OpenAPI 3.0: `spectacular --validate`.)
_ERROR_OR_VALIDATION = build_object_type(properties=_ERROR["properties"], additionalProperties=True)
_ERRORS = {
    "400": "Idempotency-Key missing (idempotency_key_missing) or malformed "
    "(idempotency_key_invalid), or a body with no canonical form (parse_error).",
    "409": "A request with this Idempotency-Key is still in progress "
    "(idempotency_request_in_progress); retry after Retry-After.",
    "422": "This Idempotency-Key was used with a different request (idempotency_key_reused), "
    "or its request's outcome is past retention (idempotency_key_expired).",
    "413": "The request body is larger than an idempotent request may be "
    "(idempotency_body_too_large).",
    "503": "The idempotency record store is unreachable (idempotency_store_unavailable): "
    "the request was not run; or the request was run and its outcome is not known yet "
    "(idempotency_outcome_uncertain): retry with the same key to learn it. Retry after "
    "Retry-After.",
}


_REPLAYED = {
    "description": "true when this is the stored response of an earlier request with the "
    "same Idempotency-Key and input, replayed; absent on a first execution.",
    "schema": {"type": "string", "enum": ["true"]},
}
_RETENTION = {
    "description": "For how many more seconds (counted from this response) a retry with the "
    "same Idempotency-Key and input is answered with this outcome.",
    "schema": {"type": "integer", "minimum": 0},
}
_RETRY_AFTER = {
    "description": "Seconds to wait before retrying with the same Idempotency-Key.",
    "schema": {"type": "integer", "minimum": 0},
}
#: Statuses answered with Retry-After: a request in flight, a store unavailable.
_RETRY_AFTER_STATUSES = ("409", "503")


def _may_be_replayed(code: str) -> bool:
    """Whether a response of this status may be stored, and so replayed."""
    if code.isdigit():
        number = int(code)
        return number < 500 and number not in RETRYABLE_STATUSES
    return code[:1] in ("2", "3", "4")  # "2XX" and the like; not "default"


def _with_headers(responses: dict[str, Any]) -> dict[str, Any]:
    """``responses`` with the headers protection adds declared; the view's own win."""
    for code, response in responses.items():
        added: dict[str, Any] = {}
        if _may_be_replayed(code):
            added[REPLAYED_HEADER] = _REPLAYED
            if idempotency_settings.ADVERTISE_RETENTION:
                added[RETENTION_HEADER] = _RETENTION
        if code in _RETRY_AFTER_STATUSES:
            added["Retry-After"] = _RETRY_AFTER
        if added:
            # Copies: a YAML dump would write an object met twice as an alias.
            headers = {**copy.deepcopy(added), **response.get("headers", {})}
            responses[code] = {**response, "headers": headers}
    return responses


class IdempotencySchemaMixin:
    """Adds the header and the refusals to protected operations."""

    view: Any
    method: str

    def _protection(self) -> Options | None:
        handler = getattr(self.view, "action", None) or self.method.lower()
        # The user's class: the replacement's handlers may be stand-ins.
        view_class = getattr(type(self.view), "_idempotency_view_class", type(self.view))
        own = protection_of(view_class, handler, self.method)
        return own or protection_by_middleware(view_class, handler, self.method)

    def get_override_parameters(self) -> list[Any]:
        parameters = list(super().get_override_parameters())  # type: ignore[misc]
        options = self._protection()
        # A key read from the body or by a callable is no header to declare.
        header = options.key.header if options is not None else None
        if options is not None and header is not None:
            conf = idempotency_settings
            required = options.required if options.required is not None else conf.REQUIRED
            parameters.append(
                OpenApiParameter(
                    name=header,
                    type=OpenApiTypes.STR,
                    location=OpenApiParameter.HEADER,
                    required=required,
                    description=(
                        "A unique key for this operation (a UUID is a good choice). "
                        "Retries with the same key and input get the original response, "
                        "marked Idempotent-Replayed: true; the operation runs once. At most "
                        f"{conf.KEY_MAX_LENGTH} visible ASCII characters."
                    ),
                )
            )
        return parameters

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)  # type: ignore[misc]
        if direction == "response" and self._protection() is not None:
            problem = idempotency_settings.ERROR_FORMAT == "problem"
            media_type = "application/problem+json" if problem else "application/json"
            schema = _PROBLEM if problem else _ERROR
            for code, description in _ERRORS.items():
                body = _ERROR_OR_VALIDATION if code == "400" and not problem else schema
                responses.setdefault(
                    code,
                    {"description": description, "content": {media_type: {"schema": body}}},
                )
            return _with_headers(responses)
        return responses

    def get_description(self) -> str:
        description: str = super().get_description()  # type: ignore[misc]
        if description and description == get_doc(IdempotentMixin):
            # Spectacular fell back on the first class docstring of the
            # view's MRO, and found the mixin's: it documents this package,
            # not the user's API. Take the user's own, or none.
            return _class_doc_without_mixin(type(self.view))
        return description


def _class_doc_without_mixin(view_class: type) -> str:
    """``get_doc(view_class)``, as if ``IdempotentMixin`` had no docstring."""
    mro = view_class.__mro__
    # Spectacular's own barrier: DRF's classes document DRF, not the API.
    barrier = min(
        (mro.index(cls) for cls in spectacular_settings.GET_LIB_DOC_EXCLUDES() if cls in mro),
        default=len(mro),
    )
    for cls in mro[:barrier]:
        if cls is not IdempotentMixin and cls.__doc__:
            return get_doc(cls)
    return ""


class IdempotentViewExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Gives views with protected handlers a schema that knows about them."""

    target_class = "rest_framework.views.APIView"
    match_subclasses = True
    # Any extension written for a specific view wins over this general one.
    priority = -1

    def view_replacement(self) -> Any:
        view_class = self.target
        schema = getattr(view_class, "schema", None)
        if not isinstance(schema, AutoSchema) or isinstance(schema, IdempotencySchemaMixin):
            return view_class
        # Spectacular names a view's source file and line in its warnings,
        # from the class's __module__ and __qualname__ (and __firstlineno__
        # from Python 3.13): the replacement takes the user's, or the
        # warnings would point at this module.
        where = {"__module__": view_class.__module__, "__qualname__": view_class.__qualname__}
        if "__firstlineno__" in vars(view_class):
            where["__firstlineno__"] = vars(view_class)["__firstlineno__"]
        return type(
            view_class.__name__,
            (view_class,),
            {
                **where,
                **_handlers_with_extended_schemas(view_class),
                "schema": _with_idempotency(type(schema))(),
                "_idempotency_view_class": view_class,
            },
        )


def _with_idempotency(schema_class: type) -> type:
    if issubclass(schema_class, IdempotencySchemaMixin):
        return schema_class
    return type(f"Idempotent{schema_class.__name__}", (IdempotencySchemaMixin, schema_class), {})


def _handlers_with_extended_schemas(view_class: type) -> dict[str, Any]:
    """Stand-ins for the handlers that ``@extend_schema`` gave a schema class of their own.

    Spectacular builds such an operation's schema from the handler's
    ``kwargs["schema"]`` (a subclass of the default AutoSchema), not from the
    view's, so the header and the refusals would be lost. The stand-in
    carries the same attributes (docstring, ``@action`` routing, kwargs)
    with our mixin added to that class; the user's function is left as it is.
    Schema generation never calls a handler.
    """
    stand_ins: dict[str, Any] = {}
    for name in dir(view_class):
        handler = getattr(view_class, name, None)
        extended = getattr(handler, "kwargs", None)
        if not callable(handler) or not isinstance(extended, dict):
            continue
        schema_class = extended.get("schema")
        if not isinstance(schema_class, type) or not issubclass(schema_class, AutoSchema):
            continue
        stand_ins[name] = _stand_in(
            handler, {**extended, "schema": _with_idempotency(schema_class)}
        )
    return stand_ins


def _stand_in(handler: Any, kwargs: dict[str, Any]) -> Any:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a schema-generation stand-in is never called")

    functools.update_wrapper(stand_in, handler)
    stand_in.kwargs = kwargs  # type: ignore[attr-defined]
    return stand_in
