"""drf-spectacular integration: protected operations document themselves.

Loaded by the AppConfig when drf-spectacular is installed. Every operation
that ``@idempotent``, ``IdempotentMixin`` or ``IdempotencyMiddleware``
protects, as the middleware and ``manage.py idempotency_routes`` decide it
from the route (``_middleware.frameworks.drf_coverage``: a route that wraps
``as_view()`` in a decorator of its own, or exempts it, is left alone), gets the
``Idempotency-Key`` header parameter (required or not, as configured;
never required where the middleware runs anonymous requests unprotected
and the view lets them in, as its description then says) and
the 400, 409, 413, 422 and 503 responses it can answer with, in the
configured error format; handlers under ``@extend_schema`` included. Its
responses declare the headers they may carry: ``Idempotent-Replayed`` (and,
with ``ADVERTISE_RETENTION``, ``Idempotency-Key-Expires-In``) on every
status that is stored and so may be a replay, ``Retry-After`` on 409 and 503.
"""

from __future__ import annotations

import functools
from typing import Any

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import build_basic_type, build_object_type, get_doc
from drf_spectacular.settings import spectacular_settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter

from django_idempotency._middleware.coverage import Coverage, anonymous_left_alone
from django_idempotency._middleware.drf import admits_anonymous
from django_idempotency._middleware.frameworks import drf_coverage
from django_idempotency._protection.flow import Options
from django_idempotency._schema_parts import REFUSALS, headers_for, key_description
from django_idempotency.conf import idempotency_settings
from django_idempotency.drf import IdempotentMixin

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


def _with_headers(responses: dict[str, Any]) -> dict[str, Any]:
    """``responses`` with the headers protection adds declared; the view's own win."""
    for code, response in responses.items():
        added = headers_for(code)
        if added:
            headers = {**added, **response.get("headers", {})}
            responses[code] = {**response, "headers": headers}
    return responses


class IdempotencySchemaMixin:
    """Adds the header and the refusals to protected operations."""

    view: Any
    method: str

    def _protection(self) -> Options | None:
        return self._coverage().options

    def _coverage(self) -> Coverage:
        """What protects this operation, decided as the middleware and ``idempotency_routes`` do."""
        handler = getattr(self.view, "action", None) or self.method.lower()
        # The user's class, and the route's callable (read off the class: a
        # function read off an instance would come back bound). The
        # replacement's handlers may be stand-ins.
        replacement = type(self.view)
        view_class = getattr(replacement, "_idempotency_view_class", replacement)
        callback = getattr(replacement, "_idempotency_callback", None)
        return drf_coverage(callback, view_class, handler, self.method)

    def get_override_parameters(self) -> list[Any]:
        parameters = list(super().get_override_parameters())  # type: ignore[misc]
        options = self._protection()
        # A key read from the body or by a callable is no header to declare.
        header = options.key.header if options is not None else None
        if options is not None and header is not None:
            conf = idempotency_settings
            required = options.required if options.required is not None else conf.REQUIRED
            # "Required" promises a 400 to a keyless request: not where it runs unprotected.
            anonymous_unprotected = self._anonymous_unprotected()
            parameters.append(
                OpenApiParameter(
                    name=header,
                    type=OpenApiTypes.STR,
                    location=OpenApiParameter.HEADER,
                    required=required and not anonymous_unprotected,
                    description=key_description(anonymous_unprotected=anonymous_unprotected),
                )
            )
        return parameters

    def _anonymous_unprotected(self) -> bool:
        """Whether the middleware runs this operation's anonymous requests unprotected."""
        return (
            self._coverage().by_middleware
            and anonymous_left_alone()
            and admits_anonymous(self.view, self.method)
        )

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)  # type: ignore[misc]
        if direction == "response" and self._protection() is not None:
            problem = idempotency_settings.ERROR_FORMAT == "problem"
            media_type = "application/problem+json" if problem else "application/json"
            schema = _PROBLEM if problem else _ERROR
            for code, description in REFUSALS.items():
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
                # The route decides too: a decorator of its own, an exempt as_view().
                "_idempotency_callback": self.target_callback,
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
