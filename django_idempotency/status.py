"""The operation status view: what became of a request, asked after a timeout.

Mounted by the project with ``path("idempotency/", include("django_idempotency.urls"))``.
``GET .../status/?key=<Idempotency-Key>[&operation=<name>]`` answers what is
known of the caller's own operation under that key: its state, when it was
created and when it expires, and once COMPLETED or FAILED the stored
response. The caller is the tenant that ``IDEMPOTENCY["TENANT"]`` resolves
for this request, exactly as for the protected request itself, so a key is
only ever looked up inside the caller's own key space: a key unknown to the
caller is 404, whatever other tenants hold, from the same single indexed
query and with the same body.

The record is read from the database that holds it for this caller
(``DATABASE``, or the routers' ``db_for_write``), named explicitly: never a
replica, whose lag could answer "not seen yet" for an operation that ran.

The serializers are both the renderer of the answers and their OpenAPI
schema (``_openapi/status.py``), so the two cannot drift apart.

A stored body is given in the form a client can use at once, and says which
(``body_encoding``):

- ``"json"``: the stored ``Content-Type`` is JSON (``application/json`` or
  ``*/*+json``) and the body parses into strict JSON (no ``1e999``, no lone
  surrogate, which the answer could not be rendered with): the parsed value. Equal to the
  original as JSON, not byte for byte (a replay of the request itself gives
  the bytes);
- ``"text"``: a textual media type (``text/*``, XML, form data, or JSON that
  does not parse), decoded with its ``charset`` (UTF-8 if none), and an
  empty body of any type;
- ``"base64"``: anything else (an image, a PDF, text in an unknown
  charset or one decoding into lone surrogates), the bytes in standard base64;
- ``"omitted"``: the body was not stored (larger than ``MAX_STORED_BODY``,
  or streamed); ``body`` is null.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

from django.db.models import Q
from django.utils.http import parse_header_parameters
from django.utils.translation import gettext_lazy as _
from rest_framework import serializers, status
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import _store as store
from django_idempotency._protection.answers import (
    UNAVAILABLE_RETRY_AFTER,
    UNREACHABLE_ERRORS,
    problem_response,
)
from django_idempotency._protection.keys import parse_key
from django_idempotency._protection.refused import principal_of, sent_by
from django_idempotency._store.database_time import with_read_time
from django_idempotency._store.digests import principal_digests
from django_idempotency._store.routing import database_for
from django_idempotency.conf import idempotency_settings
from django_idempotency.exceptions import (
    UNREADABLE_RECORD,
    IdempotencyRefusal,
    KeyMissing,
    OperationInvalid,
    StoreUnavailable,
)
from django_idempotency.models import OPERATION_MAX_LENGTH, IdempotencyRecord
from django_idempotency.scope import (
    ANONYMOUS_TENANT,
    Scope,
    operation_name_fault,
    resolve_tenant,
)

__all__ = [
    "AMBIGUOUS_CODE",
    "MAX_LISTED_OPERATIONS",
    "AuthenticatedCaller",
    "KeyUnknown",
    "OperationStatusView",
]

logger = logging.getLogger("django_idempotency")

MAX_LISTED_OPERATIONS = 20
"""At most this many operation names are listed for a key the caller used under several."""

AMBIGUOUS_CODE = "idempotency_operation_ambiguous"
"""The ``code`` of the 300 answer for a key the caller used under several operations."""

_ANONYMOUS_REFUSED = _(
    "Authenticate to ask about your operations: the operations of clients that do not "
    "authenticate are not told apart."
)


class KeyUnknown(IdempotencyRefusal):
    """404 ``idempotency_key_unknown``: the caller has no operation under this key.

    The same answer whether or not another tenant holds the key.
    """

    status_code = status.HTTP_404_NOT_FOUND
    default_code = "idempotency_key_unknown"
    default_detail = _(
        "No operation with this Idempotency-Key is known for you: the request has not "
        "reached the server, or was released to be retried. Retry it with the same key."
    )


class AuthenticatedCaller(BasePermission):
    """Callers that authenticated: as a user, or with a credential that names no user.

    The principals ``default_tenant`` tells apart: a signed-in user, and an
    ``(AnonymousUser, credential)`` pair from an authentication class (an
    API key, a machine client's token), whose requests are protected under
    a tenant of the credential's own. A request no authentication class
    accepted is refused, even with DRF's ``UNAUTHENTICATED_TOKEN`` set.
    """

    def has_permission(self, request: Request, view: APIView) -> bool:
        if request.user is not None and request.user.is_authenticated:
            return True
        return request.auth is not None and request.successful_authenticator is not None


class OperationStatusView(APIView):
    """The state and outcome of the caller's operation under an Idempotency-Key.

    Query parameters: ``key`` (required), ``operation`` (needed only when the
    caller used the key for several operations). Answers 200 with the
    operation's state; 404 ``idempotency_key_unknown`` for a key the caller
    has no operation under; 300 ``idempotency_operation_ambiguous``, listing
    the operations, when the key names several and no ``operation`` was
    given.

    Mounted under any prefix: URL arguments the prefix captures (an
    organiser's slug, DRF's ``URLPathVersioning`` version) are the project's,
    and take no part in the lookup.

    Authentication and throttling are the project's (``REST_FRAMEWORK``
    defaults). Permission: ``AuthenticatedCaller``, callers that
    authenticated as a user or with a credential. Subclass and mount the
    subclass to change it (for a tenant that comes from something other
    than the authenticated user, say). Whatever the permission, the tenant
    ``"anonymous"`` that the default ``TENANT`` gives every unauthenticated
    request is never answered: its records are every anonymous client's.
    """

    permission_classes: list[type[BasePermission]] = [AuthenticatedCaller]

    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        conf = idempotency_settings
        raw_key = request.query_params.get("key")
        if not raw_key:
            raise KeyMissing("Give the Idempotency-Key to look up as the query parameter key.")
        key = parse_key(raw_key, conf.KEY_MAX_LENGTH)
        operation = request.query_params.get("operation") or None
        fault = None if operation is None else operation_name_fault(operation)
        if fault is not None:
            # Judged before the query: PostgreSQL refuses a NUL in a query's text.
            raise OperationInvalid(
                f"The operation parameter {fault}: an operation name is 1 to "
                f"{OPERATION_MAX_LENGTH} printable characters, as a 300 answer lists them."
            )
        tenant = resolve_tenant(request, conf.TENANT)
        if tenant == ANONYMOUS_TENANT:
            # Shared by every client that did not authenticate: an answer
            # would tell one of them what another did.
            self.permission_denied(request, message=str(_ANONYMOUS_REFUSED))
        # With routers choosing the database, they get the scope as hints; a
        # router that needs the operation needs the client to name it.
        database = database_for(Scope(tenant, operation or "", key), request=request)
        principal = principal_of(request)
        try:
            records = _records(tenant, operation, key, database, principal)
            if len(records) > 1:
                return _ambiguous(tenant, key, database, principal)
        except UNREACHABLE_ERRORS as exc:
            raise StoreUnavailable(retry_after=UNAVAILABLE_RETRY_AFTER) from exc
        if not records or store.handed_back(records[0]):
            # Handed back to the client's retry (a reconciler's RetryFrom):
            # nothing runs it until the client retries, as after a release.
            raise KeyUnknown()
        return Response(OperationStatusSerializer(_answer(records[0])).data)

    def handle_exception(self, exc: Exception) -> Response:
        if isinstance(exc, IdempotencyRefusal) and idempotency_settings.ERROR_FORMAT == "problem":
            return problem_response(exc)  # type: ignore[return-value]
        return super().handle_exception(exc)

    def finalize_response(
        self, request: Request, response: Any, *args: Any, **kwargs: Any
    ) -> Response:
        finished: Response = super().finalize_response(request, response, *args, **kwargs)
        # The state changes, and the stored response may be personal.
        finished["Cache-Control"] = "no-store"
        return finished


def _records(
    tenant: str, operation: str | None, key: str, database: str, principal: str | None
) -> list[IdempotencyRecord]:
    """The caller's records under ``key`` (of ``operation`` if named), two at most.

    One query either way, on the unique index (tenant, operation, key), and
    the same query whoever else holds the key: the tenant is in it, so
    another tenant's row is never read. Of the tenant's records, those
    another principal sent are not the caller's (``_readable_by``).
    """
    if operation is not None:
        record = store.lookup(Scope(tenant, operation, key), using=database)
        if record is None or not _readable_by(record, principal):
            return []
        return [record]
    records = IdempotencyRecord.objects.using(database).filter(
        _readable_by_q(principal), tenant=tenant, key=key
    )
    return list(with_read_time(records.order_by("operation"))[:2])


def _readable_by(record: IdempotencyRecord, principal: str | None) -> bool:
    """Whether the caller, of the record's tenant, may read it.

    A tenant may be coarser than a principal (one per organisation, or per
    OAuth application): a colleague who learns a key must not read the
    response another principal was given (with a retry it would need the
    same input too, and past a refused permission it gets nothing). A
    record that names no principal (a plain Django view's, one written
    before 0008) is read by its tenant, as it always was.
    """
    return record.principal_digest is None or sent_by(record, principal)


def _readable_by_q(principal: str | None) -> Q:
    """``_readable_by`` as a filter: the same statement whoever holds the key."""
    readable = Q(principal_digest__isnull=True)
    if principal is not None:
        readable |= Q(principal_digest__in=principal_digests(principal))
    return readable


def _ambiguous(tenant: str, key: str, database: str, principal: str | None) -> Response:
    operations = (
        IdempotencyRecord.objects.using(database)
        .filter(_readable_by_q(principal), tenant=tenant, key=key)
        .order_by("operation")
        .values_list("operation", flat=True)[:MAX_LISTED_OPERATIONS]
    )
    body = {
        "detail": "This Idempotency-Key names several of your operations: ask again with "
        "one of them as the operation parameter.",
        "code": AMBIGUOUS_CODE,
        "operations": list(operations),
    }
    return Response(OperationChoicesSerializer(body).data, status=status.HTTP_300_MULTIPLE_CHOICES)


def _answer(record: IdempotencyRecord) -> dict[str, Any]:
    # A tombstone's response is gone; a resolved record past expires_at (at
    # the database's time of the read) is no longer replayed: both expired.
    # With TOMBSTONE_TTL, past_retention() waits for the tombstone's time
    # too; before that the record is kept_as_tombstone(), and a retry is
    # refused as idempotency_key_expired: expired as well.
    expired = store.kept_as_tombstone(record) or store.past_retention(record)
    if expired or not record.is_resolved:
        return status_of(record, expired=expired, stored=None)
    try:
        stored = store.unseal(
            record.response_headers, record.response_body, sealed=record.response_sealed
        )
    except store.UnreadableRecord as exc:
        logger.error("Cannot show the stored response of record %s: %s", record.pk, exc)
        raise StoreUnavailable(str(UNREADABLE_RECORD), retry_after=UNAVAILABLE_RETRY_AFTER) from exc
    return status_of(record, expired=False, stored=stored)


BODY_ENCODINGS = ("json", "text", "base64", "omitted")
"""The values of ``body_encoding`` in a stored response's description."""

#: Textual media types that neither start with ``text/`` nor end with ``+xml``.
_TEXTUAL = frozenset(
    {"application/xml", "application/x-www-form-urlencoded", "application/javascript"}
)


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are no JSON a client could take: the body goes as text.
    raise ValueError(f"{name} is not JSON")


def encode_body(headers: list[list[str]], body: bytes | None) -> tuple[str, Any]:
    """``(body_encoding, body)`` for a stored body and the stored headers."""
    if body is None:
        return "omitted", None
    if not body:
        return "text", ""
    content_type = next((value for name, value in headers if name.lower() == "content-type"), "")
    media_type, parameters = parse_header_parameters(content_type)
    is_json = media_type == "application/json" or media_type.endswith("+json")
    if is_json:
        try:
            return "json", _json_value(body)
        except (ValueError, RecursionError):  # UnicodeDecodeError and UnicodeEncodeError too
            pass  # as text, if it decodes
    if (
        is_json
        or media_type.startswith("text/")
        or media_type.endswith("+xml")
        or (media_type in _TEXTUAL)
    ):
        try:
            return "text", _text(body, parameters.get("charset") or "utf-8")
        except (LookupError, ValueError):  # ValueError: a NUL in the codec's name too
            pass
    return "base64", base64.b64encode(body).decode("ascii")


def _json_value(body: bytes) -> Any:
    """The stored JSON body as a value the answer can carry, or ValueError.

    Parsing is not enough: ``1e999`` parses as inf, which no JSON renderer
    writes, and an escaped lone surrogate (``"\\ud800"``, as a plain view's
    ``JsonResponse`` writes a client's string) as a string UTF-8 cannot
    encode. Either would fail the rendering of the answer (a 500): written
    here as the renderer writes, such a body is given as text instead.
    """
    value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    return value


def _text(body: bytes, charset: str) -> str:
    """The stored body decoded with ``charset``, if UTF-8 can encode it, else ValueError.

    Some codecs (``utf-7``, ``unicode_escape``) decode bytes into lone
    surrogates, which UTF-8 cannot encode: such a body is given in base64.
    """
    text = body.decode(charset)
    text.encode("utf-8")
    return text


def status_of(
    record: IdempotencyRecord,
    *,
    expired: bool,
    stored: tuple[list[list[str]], bytes | None] | None,
) -> dict[str, Any]:
    """The answer about ``record``: ``stored`` is its unsealed (headers, body) if resolved."""
    response = None
    if stored is not None and not expired:
        headers, body = stored
        encoding, shown = encode_body(headers, body)
        response = {
            "status": record.response_status,
            "headers": {name: value for name, value in headers},
            "body_encoding": encoding,
            "body": shown,
        }
    return {
        "key": record.key,
        "operation": record.operation,
        "state": record.state,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "expired": expired,
        "response": response,
    }


class StateField(serializers.ChoiceField):
    """A record's state.

    A class of its own so that the OpenAPI schema gives its values inline
    (``openapi_status``): as drf-spectacular's named ``StateEnum`` it would
    collide with the ``state`` fields of the project's own API, and rename
    their components.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(choices=IdempotencyRecord.State.choices, **kwargs)


class BodyEncodingField(serializers.ChoiceField):
    """How a stored body is given (``BODY_ENCODINGS``); inline in the schema, as ``StateField``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(choices=BODY_ENCODINGS, **kwargs)


class StoredAnswerSerializer(serializers.Serializer[dict[str, Any]]):
    """The stored response of a COMPLETED or FAILED operation, as a retry would be answered."""

    status = serializers.IntegerField(help_text=_("The stored HTTP status."))
    headers = serializers.DictField(
        child=serializers.CharField(),
        help_text=_(
            "The stored headers: Content-Type and Location when the view set them, and "
            "those of IDEMPOTENCY['STORED_HEADERS']."
        ),
    )
    body_encoding = BodyEncodingField(
        help_text=_(
            "How body is given: json, the parsed JSON value; text, the decoded text; "
            "base64, the bytes in base64; omitted, the body was not stored (too large, or "
            "streamed) and body is null."
        ),
    )
    body = serializers.JSONField(
        allow_null=True, help_text=_("The stored body, as body_encoding says.")
    )


class OperationStatusSerializer(serializers.Serializer[dict[str, Any]]):
    """What is known of one operation of the caller's."""

    key = serializers.CharField(help_text=_("The Idempotency-Key."))
    operation = serializers.CharField(help_text=_("The operation's name on this server."))
    state = StateField(
        help_text=_(
            "CLAIMED or IN_PROGRESS: it runs, wait. UNCERTAIN: the server is finding out "
            "whether an external call happened, wait. COMPLETED or FAILED: the outcome is in "
            "response."
        ),
    )
    created_at = serializers.DateTimeField(help_text=_("When the first request claimed the key."))
    expires_at = serializers.DateTimeField(
        help_text=_(
            "When a COMPLETED or FAILED outcome stops being replayed (for an expired key "
            "whose record is kept as a tombstone: when that goes)."
        )
    )
    expired = serializers.BooleanField(
        help_text=_(
            "The outcome's retention is over: response is null. A retry with this key is "
            "refused (idempotency_key_expired) while a tombstone is kept, else runs anew."
        )
    )
    response = StoredAnswerSerializer(
        allow_null=True,
        help_text=_("The stored response once COMPLETED or FAILED and not expired; else null."),
    )


class OperationChoicesSerializer(serializers.Serializer[dict[str, Any]]):
    """The key names several operations of the caller's: ask again with one of them."""

    detail = serializers.CharField()
    code = serializers.CharField()
    operations = serializers.ListField(
        child=serializers.CharField(),
        help_text=_("The operations holding this key; pass one as the operation parameter."),
    )
