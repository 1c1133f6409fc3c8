"""Fingerprints: what makes two requests "the same request".

A fingerprint is a keyed digest (``digests.py``: HMAC-SHA256 under a
server secret, versioned) of a canonical serialisation of the
operation-defining input: the parsed body, the query parameters and the URL
arguments. Canonical means sorted object keys, no insignificant whitespace
and one spelling per number, so ``{"a": 1.0}`` and ``{ "a" : 1e0 }`` are the
same request while any changed value, however deeply nested, is not.

Why not RFC 8785 (the ``rfc8785`` package)? JCS maps every number to an
IEEE double, so 9007199254740993 and 9007199254740992 would canonicalise
alike (the package refuses integers beyond 2**53 for that reason). Amounts in
minor units and snowflake ids live up there, and a changed amount must never
replay an old charge. Here every number is compared by its exact decimal
value: integers as they are, floats by their shortest round-trip spelling
(so ``1.0``, ``1e0`` and ``1`` are one number), written in plain positional
notation. Values are those the parser delivered to the view: JSON parsers
read ``9007199254740993.0`` as the float 9007199254740992.0, and so does
the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from decimal import Context, Decimal
from typing import TYPE_CHECKING, Any, cast

from django.core.files.uploadedfile import UploadedFile
from django.http import QueryDict
from django.utils.datastructures import MultiValueDict

from django_idempotency.digests import Fingerprint, FingerprintHasher

if TYPE_CHECKING:
    from django.http import HttpRequest

FingerprintSpec = None | Sequence[str] | Callable[["HttpRequest"], Any]


class NonCanonicalValue(ValueError):
    """A value with no canonical JSON form: NaN or an infinity."""


class _Absent:
    """A selected field that the request did not send (distinct from ``null``)."""


_ABSENT = _Absent()


def _number(value: int | float | Decimal) -> str:
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NonCanonicalValue(f"{value!r} has no canonical JSON form")
        # The shortest spelling that round-trips, read as an exact decimal:
        # 3.655760495095878e16 is 36557604950958780, as the client wrote
        # it, not the binary float's 36557604950958784.
        value = Decimal(repr(value))
    if not value.is_finite():
        raise NonCanonicalValue(f"{value!r} has no canonical JSON form")
    if value.is_zero():
        return "0"
    # Normalise at the value's own precision: the default context (28
    # digits) would round long values into each other.
    normalised = value.normalize(Context(prec=len(value.as_tuple().digits)))
    # Positional notation keeps 1e2 and 100 alike; beyond this exponent the
    # digits would be a denial of service, so switch to E-form.
    if abs(normalised.adjusted()) > 400:
        return f"{normalised:E}"
    return f"{normalised:f}"


def _file_token(upload: UploadedFile[Any]) -> str:
    digest = hashlib.sha256()
    for chunk in upload.chunks():
        digest.update(chunk)
    upload.seek(0)
    return f"file({json.dumps(upload.name)},{digest.hexdigest()})"


#: What ``json.dumps(text)`` returns for a string, without its layers.
_json_string = json.encoder.encode_basestring_ascii


# Values that parsed JSON cannot contain (absent fields, uploads, raw bytes)
# are written as tokens that are not JSON, so they can never collide with
# anything a client spells in a body.
def _encode(value: Any, out: list[str]) -> None:
    kind = type(value)
    # What parsers deliver, by exact type first: this runs for every value
    # of every protected request's body.
    if kind is str:
        out.append(_json_string(value))
    elif kind is int:
        out.append(str(value))
    elif kind is dict:
        _encode_mapping(value, out)
    elif kind is list:
        _encode_sequence(value, out)
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, (int, float, Decimal)):
        out.append(_number(value))
    elif isinstance(value, str):
        out.append(_json_string(value))
    elif isinstance(value, MultiValueDict):  # QueryDict, request.FILES: every value
        _encode(dict(value.lists()), out)
    elif isinstance(value, Mapping):
        _encode_mapping(value, out)
    elif isinstance(value, (list, tuple)):
        _encode_sequence(value, out)
    elif value is _ABSENT:
        out.append("absent")
    elif isinstance(value, UploadedFile):
        out.append(_file_token(value))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out.append(f"bytes({hashlib.sha256(value).hexdigest()})")
    else:
        raise TypeError(f"{type(value).__name__} cannot be part of a fingerprint")


def _encode_mapping(value: Mapping[Any, Any], out: list[str]) -> None:
    out.append("{")
    for index, name in enumerate(sorted(value, key=str)):
        if index:
            out.append(",")
        out.append(_json_string(str(name)))
        out.append(":")
        _encode(value[name], out)
    out.append("}")


def _encode_sequence(value: Sequence[Any], out: list[str]) -> None:
    out.append("[")
    for index, item in enumerate(value):
        if index:
            out.append(",")
        _encode(item, out)
    out.append("]")


def canonical(value: Any) -> bytes:
    """The canonical serialisation of a JSON-like value (ASCII bytes)."""
    out: list[str] = []
    _encode(value, out)
    return "".join(out).encode("ascii")


def fingerprint(value: Any) -> Fingerprint:
    hasher = FingerprintHasher()
    hasher.update(canonical(value))
    return hasher.finish()


def select_fields(data: Any, fields: Sequence[str]) -> dict[str, Any]:
    """Pick dotted paths (``"card.last4"``) out of parsed input."""
    selected: dict[str, Any] = {}
    for path in fields:
        node: Any = data
        for part in path.split("."):
            if isinstance(node, QueryDict):
                node = node.getlist(part) if part in node else _ABSENT
            elif isinstance(node, Mapping):
                node = node.get(part, _ABSENT)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                node = _ABSENT
            if node is _ABSENT:
                break
        selected[path] = node
    return selected


def _parsed_body(request: HttpRequest) -> Any:
    """The body as the view will see it.

    DRF requests are parsed by the view's own parsers (a malformed body
    raises DRF's ``ParseError``, a 400, before anything is claimed). Plain
    Django requests are parsed here: JSON and form bodies by value, anything
    else (or JSON that does not parse) by the digest of its bytes.
    """
    if hasattr(request, "query_params"):  # a DRF Request
        return cast(Any, request).data
    content_type = request.content_type or ""
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            return json.loads(request.body, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return request.body  # the view will refuse it; its bytes identify it
    if request.method == "POST" and content_type in (
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        if _body_fits_in_memory(request):
            # Read (and cache) the raw body first: Django parses the form
            # from it, and the view may still read request.body after us.
            request.body  # noqa: B018
        return {"form": request.POST, "files": request.FILES}
    return request.body


def _url_value(value: Any) -> Any:
    """URL arguments as path converters deliver them (a UUID, a date...)."""
    if value is None or isinstance(value, (str, int, float, Decimal)):
        return value
    return str(value)


def _body_fits_in_memory(request: HttpRequest) -> bool:
    from django.conf import settings

    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return False
    return limit is None or length <= limit


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def request_fingerprint(
    request: HttpRequest,
    spec: FingerprintSpec,
    view_args: Sequence[Any],
    view_kwargs: Mapping[str, Any],
) -> Fingerprint:
    """Fingerprint a request as ``idempotent(fingerprint=spec)`` asks."""
    if callable(spec):
        return fingerprint(spec(request))
    url = {
        "args": [_url_value(value) for value in view_args],
        "kwargs": {
            name: _url_value(value)
            for name, value in view_kwargs.items()
            # DRF's format suffix (".json") picks a renderer, not an operation.
            if name != "format"
        },
    }
    body = _parsed_body(request)
    if spec is None:
        query = getattr(request, "query_params", request.GET)
        return fingerprint({"body": body, "query": query, "url": url})
    return fingerprint({"fields": select_fields(body, spec), "url": url})
