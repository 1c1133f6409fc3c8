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
(so ``1.0``, ``1e0`` and ``1`` are one number), written in positional
notation up to an exponent of 40 and in E-notation beyond. Values are those
the parser delivered to the view: JSON parsers read ``9007199254740993.0``
as the float 9007199254740992.0, and so does the fingerprint.

The canonical form is never built whole: ``write_canonical()`` streams it,
in chunks of bounded size, into anything with an ``update(bytes)`` method
(a hashlib or hmac object), so that a hostile body costs memory in
proportion to a chunk, not to its canonical form.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal
from typing import TYPE_CHECKING, Any, Protocol, cast

from django.core.files.base import File
from django.http import RawPostDataException
from django.utils.datastructures import MultiValueDict
from django.utils.translation import gettext

from django_idempotency._store.digests import Fingerprint, FingerprintHasher

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "CSRF_FORM_FIELD",
    "MAX_POSITIONAL_EXPONENT",
    "FingerprintSpec",
    "NestedTooDeeply",
    "NonCanonicalValue",
    "Sink",
    "canonical",
    "fingerprint",
    "request_fingerprint",
    "select_fields",
    "write_canonical",
]

logger = logging.getLogger("django_idempotency")

FingerprintSpec = None | Sequence[str] | Callable[["HttpRequest"], Any]
"""What ``idempotent(fingerprint=...)`` accepts.

``None``: the whole canonical input (body, query parameters, URL
arguments); a list of field names, dotted for nested ones (``"card.token"``),
with the URL arguments; or a callable taking the request and returning the
JSON-like value to fingerprint, alone.
"""


class NonCanonicalValue(ValueError):
    """Input with no canonical form; the message says why, to the client."""


class NestedTooDeeply(NonCanonicalValue):
    """Input nested deeper than the parser or the encoder can follow."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or gettext("The request body is nested too deeply to be read."))


class _UnsupportedValue(TypeError):
    """A value of a type with no canonical form (a ``TypeError``, as documented)."""

    def __init__(self, value: object) -> None:
        self.type_name = type(value).__name__
        super().__init__(f"{self.type_name} cannot be part of a fingerprint")


class Sink(Protocol):
    """What the canonical form is written into: ``hashlib.sha256()``, ``hmac.new(...)``."""

    def update(self, data: bytes, /) -> None:
        """Take the next chunk of the canonical form."""


class _Absent:
    """A selected field that the request did not send (distinct from ``null``)."""


_ABSENT = _Absent()


class _FormValue:
    """A value selected out of form data (a list of strings, or one of them)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


#: Beyond this decimal exponent numbers are spelled in E-notation (1E+308):
#: positional digits would make the 5 bytes "1e308" cost 309 characters.
#: Up to it the positional spelling of earlier versions is kept, so that
#: their stored fingerprints stay valid, and every 128-bit integer (39
#: digits) is still written as it is.
MAX_POSITIONAL_EXPONENT = 40
_POSITIONAL_INTEGERS = 10 ** (MAX_POSITIONAL_EXPONENT + 1)
#: The parts buffered before they are hashed: a chunk stays within tens of
#: kilobytes (a part is a number, a punctuation mark or a short string).
_PARTS_PER_CHUNK = 1024
#: Strings longer than this (in characters) go out on their own, escaped in
#: slices of ``_STRING_SLICE``: escaping can grow a string sixfold ("\\u0001").
_LONG_STRING = 256
_STRING_SLICE = 16384
#: The form field Django's CsrfViewMiddleware reads: masked anew for every
#: page rendered, so a form's retry carries another one. Transport, not input.
CSRF_FORM_FIELD = "csrfmiddlewaretoken"


def _non_finite() -> NonCanonicalValue:
    return NonCanonicalValue(
        gettext("The request body holds a number with no finite value (such as 1e999 or NaN).")
    )


def _decimal_spelling(normalised: Decimal) -> str:
    """Positional up to ``MAX_POSITIONAL_EXPONENT``, E-notation beyond."""
    if abs(normalised.adjusted()) > MAX_POSITIONAL_EXPONENT:
        return f"{normalised:E}"
    return f"{normalised:f}"


def _float(value: float) -> str:
    """What ``_number(Decimal(repr(value)))`` spells, twice as fast (floats are common).

    ``repr`` is the shortest spelling that round-trips, read as an exact
    decimal: 3.655760495095878e16 is 36557604950958780, as the client wrote
    it, not the binary float's 36557604950958784. Its significand has no
    trailing zeros but for a lone ".0".
    """
    if not math.isfinite(value):
        raise _non_finite()
    if not value:
        return "0"
    text = repr(value)
    mantissa, e, exponent_text = text.partition("e")
    if not e:  # positional already: "123.456", "100.0", "0.0001"
        return text[:-2] if text.endswith(".0") else text
    exponent = int(exponent_text)
    if abs(exponent) > MAX_POSITIONAL_EXPONENT:  # "1e+308" is 1E+308, "5e-324" 5E-324
        return f"{mantissa}E{exponent_text[0]}{exponent_text[1:].lstrip('0')}"
    sign, digits = ("-", mantissa[1:]) if mantissa[0] == "-" else ("", mantissa)
    digits = digits.replace(".", "")
    point = exponent + 1  # digits before the decimal point
    if point >= len(digits):
        return sign + digits + "0" * (point - len(digits))
    if point > 0:
        return f"{sign}{digits[:point]}.{digits[point:]}"
    return f"{sign}0.{'0' * -point}{digits}"


def _number(value: int | float | Decimal) -> str:
    if isinstance(value, int):
        if -_POSITIONAL_INTEGERS < value < _POSITIONAL_INTEGERS:
            return str(value)
        value = Decimal(value)
    elif isinstance(value, float):
        return _float(value)
    if not value.is_finite():
        raise _non_finite()
    if value.is_zero():
        return "0"
    # Normalise at the value's own precision: the default context (28
    # digits) would round long values into each other.
    digits = len(value.as_tuple().digits)
    return _decimal_spelling(value.normalize(Context(prec=digits, Emax=MAX_EMAX, Emin=MIN_EMIN)))


def _file_token(file: File[Any]) -> str:
    """Any Django ``File`` (an upload, a parser's ``ContentFile``): its name and content's digest.

    Read in chunks from the start, and rewound for the view. A file that
    cannot be rewound (a pipe) would reach the view empty: it is refused.
    """
    if not _rewindable(file):
        raise NonCanonicalValue(
            gettext(
                "The request holds a file (%(name)s) that cannot be read twice, once for its "
                "fingerprint and once by the view."
            )
            % {"name": json.dumps(file.name)}
        )
    digest = hashlib.sha256()
    for chunk in file.chunks():  # from the start: chunks() rewinds first
        # A ContentFile made from text yields str: its UTF-8 bytes.
        digest.update(chunk.encode() if isinstance(chunk, str) else chunk)
    file.seek(0)
    return f"file({json.dumps(file.name)},{digest.hexdigest()})"


def _rewindable(file: File[Any]) -> bool:
    """Whether ``file`` can be read for its fingerprint and then again by the view.

    Not a closed file, nor a pipe; nor a ``File`` over an object that is no
    full file: a parser may wrap the stream it is given (the request itself,
    which has no ``closed``, ``seekable()`` or ``seek()``), and Django's
    ``File`` then raises AttributeError where it asks.
    """
    if not callable(getattr(file.file, "seek", None)):
        return False
    try:
        return bool(file.seekable())  # False for a closed file
    except (AttributeError, ValueError):
        return False


def _text_token(value: datetime.date | datetime.time | uuid.UUID) -> str:
    """Dates, times and UUIDs (YAML and XML parsers deliver them): exact text, tagged.

    The ISO form keeps every digit and the UTC offset, so a changed value
    changes it; the tag keeps it apart from the same text sent as a string.
    """
    if isinstance(value, uuid.UUID):
        return f"uuid({_json_string(str(value))})"
    if isinstance(value, datetime.datetime):  # a date too: asked first
        tag = "datetime"
    elif isinstance(value, datetime.date):
        tag = "date"
    else:
        tag = "time"
    return f"{tag}({_json_string(value.isoformat())})"


#: What ``json.dumps(text)`` returns for a string, without its layers.
_json_string = json.encoder.encode_basestring_ascii


class _Chunks(list[str]):
    """The parts not yet written; ``flush()`` hands them to the sinks."""

    __slots__ = ("sinks",)

    def __init__(self, sinks: Sequence[Sink]) -> None:
        super().__init__()
        self.sinks = sinks

    def flush(self) -> None:
        if self:
            self.write("".join(self).encode("ascii"))
            self.clear()

    def write(self, data: bytes) -> None:
        for sink in self.sinks:
            sink.update(data)


def _encode_string(value: str, out: _Chunks) -> None:
    if len(value) <= _LONG_STRING:
        out.append(_json_string(value))
        return
    out.append('"')
    out.flush()
    for start in range(0, len(value), _STRING_SLICE):
        # Code points are escaped one by one: a slice boundary changes nothing.
        out.write(_json_string(value[start : start + _STRING_SLICE])[1:-1].encode("ascii"))
    out.append('"')


# Values that parsed JSON cannot contain (absent fields, form data, uploads,
# raw bytes) are written as tokens that are not JSON, so they can never
# collide with anything a client spells in a body.
def _encode(value: Any, out: _Chunks) -> None:
    kind = type(value)
    # What parsers deliver, by exact type first: this runs for every value
    # of every protected request's body.
    if kind is str:
        _encode_string(value, out)
    elif kind is int:
        # Positional, as written, short of an overlong run of digits.
        out.append(
            str(value) if -_POSITIONAL_INTEGERS < value < _POSITIONAL_INTEGERS else _number(value)
        )
    elif kind is float:
        out.append(_float(value))
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
        _encode_string(value, out)
    elif isinstance(value, MultiValueDict):  # QueryDict, request.FILES: every value
        out.append("form")
        _encode_mapping(dict(value.lists()), out)
    elif isinstance(value, Mapping):
        _encode_mapping(value, out)
    elif isinstance(value, (list, tuple)):
        _encode_sequence(value, out)
    elif value is _ABSENT:
        out.append("absent")
    elif isinstance(value, _FormValue):
        out.append("form")
        _encode(value.value, out)
    elif isinstance(value, File):
        out.append(_file_token(value))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out.append(f"bytes({hashlib.sha256(value).hexdigest()})")
    elif isinstance(value, (datetime.date, datetime.time, uuid.UUID)):
        out.append(_text_token(value))
    else:
        raise _UnsupportedValue(value)


def _encode_mapping(value: Mapping[Any, Any], out: _Chunks) -> None:
    append = out.append
    append("{")
    separator = ""
    for name in sorted(value, key=str):
        text = name if type(name) is str else str(name)
        if len(text) <= _LONG_STRING:
            append(f"{separator}{_json_string(text)}:")
        else:
            append(separator)
            _encode_string(text, out)
            append(":")
        separator = ","
        item = value[name]
        # The scalars parsers deliver most, written here rather than by a
        # call of _encode each (as it writes them).
        kind = type(item)
        if kind is str and len(item) <= _LONG_STRING:
            append(_json_string(item))
        elif kind is int and -_POSITIONAL_INTEGERS < item < _POSITIONAL_INTEGERS:
            append(str(item))
        else:
            _encode(item, out)
        if len(out) > _PARTS_PER_CHUNK:
            out.flush()
    append("}")


def _encode_sequence(value: Sequence[Any], out: _Chunks) -> None:
    out.append("[")
    for index, item in enumerate(value):
        if index:
            out.append(",")
        _encode(item, out)
        if len(out) > _PARTS_PER_CHUNK:
            out.flush()
    out.append("]")


def write_canonical(value: Any, *sinks: Sink) -> None:
    """Stream the canonical serialisation of ``value`` (ASCII) into ``sinks``.

    Each sink's ``update()`` receives the same chunks, in order; a chunk is
    at most a few tens of kilobytes whatever the value holds.

    Args:
        value: What a parser delivers: mappings, lists, strings, numbers
            (``int``, ``float``, ``Decimal``), booleans and ``None``, and
            also form data, Django files (uploads, ``ContentFile``...),
            bytes, dates, times and UUIDs.
        *sinks: Objects with an ``update(bytes)`` method.

    Raises:
        NonCanonicalValue: The value holds a number with no finite value,
            or a file that cannot be rewound.
        TypeError: The value holds an object of another type.
    """
    out = _Chunks(sinks)
    _encode(value, out)
    out.flush()


def canonical(value: Any) -> bytes:
    """The canonical serialisation of a JSON-like value (ASCII bytes), whole."""
    chunks: list[bytes] = []

    class Collect:
        def update(self, data: bytes, /) -> None:
            chunks.append(data)

    write_canonical(value, Collect())
    return b"".join(chunks)


def fingerprint(value: Any) -> Fingerprint:
    hasher = FingerprintHasher()
    out = _Chunks((hasher,))
    _encode(value, out)
    return _finished(hasher, out)


def _finished(hasher: FingerprintHasher, out: _Chunks) -> Fingerprint:
    """The fingerprint of what ``out`` wrote to ``hasher`` and of what it still holds."""
    return hasher.finish("".join(out).encode("ascii"))


def select_fields(data: Any, fields: Sequence[str]) -> dict[str, Any]:
    """Pick dotted paths (``"card.last4"``) out of parsed input.

    A value picked out of form data is marked as such: the form field
    ``amount=5`` is not the JSON ``{"amount": ["5"]}``.
    """
    selected: dict[str, Any] = {}
    for path in fields:
        node: Any = data
        from_form = False
        for part in path.split("."):
            if isinstance(node, MultiValueDict):
                node = node.getlist(part) if part in node else _ABSENT
                from_form = True
            elif isinstance(node, Mapping):
                node = node.get(part, _ABSENT)
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                node = _ABSENT
            if node is _ABSENT:
                break
        selected[path] = _FormValue(node) if from_form and node is not _ABSENT else node
    return selected


def _without_csrf_token(form: MultiValueDict[str, Any]) -> MultiValueDict[str, Any]:
    if CSRF_FORM_FIELD not in form:
        return form
    return MultiValueDict(
        {name: values for name, values in form.lists() if name != CSRF_FORM_FIELD}
    )


def _parsed_body(request: HttpRequest) -> Any:
    """The body as the view will see it.

    DRF requests are parsed by the view's own parsers (a malformed body
    raises DRF's ``ParseError``, a 400, before anything is claimed). Plain
    Django requests are parsed here: JSON and form bodies by value, anything
    else (or JSON that does not parse) by the digest of its bytes.
    """
    if hasattr(request, "query_params"):  # a DRF Request
        data = cast(Any, request).data
        return _without_csrf_token(data) if isinstance(data, MultiValueDict) else data
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
            # A middleware (CsrfViewMiddleware, for one) may have parsed a
            # multipart form already: then the view, too, can only read
            # request.POST, and so do we.
            with contextlib.suppress(RawPostDataException):
                request.body  # noqa: B018
        return {"form": _without_csrf_token(request.POST), "files": request.FILES}
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
        length = int(request.headers.get("content-length") or 0)
    except ValueError:
        return False
    return limit is None or length <= limit


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _negotiated_renderer(request: HttpRequest) -> dict[str, str] | None:
    """The renderer DRF chose for the response, if not the view's default one.

    A retry asking for another media type (``Accept: text/html`` after
    JSON) is another request: it gets 422, never the first response in a
    media type it did not ask for. The default renderer is left out so that
    the fingerprints of ordinary requests stay what earlier versions stored.
    """
    renderer = getattr(request, "accepted_renderer", None)
    view = (getattr(request, "parser_context", None) or {}).get("view")
    if renderer is None or view is None or not hasattr(view, "get_renderers"):
        return None
    renderers = view.get_renderers()
    chosen = (str(renderer.media_type), str(renderer.format))
    if renderers and chosen == (str(renderers[0].media_type), str(renderers[0].format)):
        return None
    return {"media_type": chosen[0], "format": chosen[1]}


def request_fingerprint(
    request: HttpRequest,
    spec: FingerprintSpec,
    view_args: Sequence[Any],
    view_kwargs: Mapping[str, Any],
) -> Fingerprint:
    """Fingerprint a request as ``idempotent(fingerprint=spec)`` asks.

    Raises ``NonCanonicalValue`` for input that has no fingerprint: among
    it a value of a type with no canonical form that the view's parsers
    delivered (the request is refused with 400, never answered 500). A
    ``fingerprint=`` callable that returns one raises ``TypeError``: that
    value is the view's own.
    """
    try:
        if spec is None:
            return _whole_input_fingerprint(request, view_args, view_kwargs)
        return fingerprint(_fingerprinted_input(request, spec, view_args, view_kwargs))
    except RecursionError as exc:
        # The parser (DRF's, inside request.data) or the encoder gave up.
        raise NestedTooDeeply() from exc
    except _UnsupportedValue as exc:
        if callable(spec):
            raise
        logger.warning(
            "Refused a request to %s with 400: its parsed body holds a %s, which has no "
            "fingerprint. Give the view fingerprint= (the fields that define the operation, "
            "or a callable returning JSON-like values).",
            request.path,
            exc.type_name,
        )
        raise NonCanonicalValue(
            gettext(
                "The request body, as parsed, holds a value that cannot be fingerprinted "
                "(a %(type)s), so the request was not run. Send it as JSON or a form, or "
                "tell the API's operators."
            )
            % {"type": exc.type_name}
        ) from exc


def _whole_input_fingerprint(
    request: HttpRequest, view_args: Sequence[Any], view_kwargs: Mapping[str, Any]
) -> Fingerprint:
    """The fingerprint of the whole input (``fingerprint=None``), written in one pass.

    The bytes ``fingerprint()`` writes for ``{"body": ..., "query": ...,
    "renderer": ..., "url": {"args": ..., "kwargs": ...}}`` (the keys in the
    canonical order, the renderer only when negotiated), with no such dict,
    list of URL values or copy of the query built first: every protected
    request with a key pays for this.
    """
    body = _parsed_body(request)
    query_params = getattr(request, "query_params", None)  # a DRF Request's
    hasher = FingerprintHasher()
    out = _Chunks((hasher,))
    out.append('{"body":')
    _encode(body, out)
    out.append(',"query":')
    query = request.GET if query_params is None else query_params
    if query:
        # Never JSON, so no form token: a plain mapping of lists, as earlier
        # versions wrote it. DRF's ``?format=`` picks a renderer, as the
        # suffix does: the negotiated renderer below stands for both.
        lists = dict(query.lists())
        if query_params is not None:
            lists.pop(_format_override(), None)
        _encode_mapping(lists, out)
    else:
        out.append("{}")
    renderer = _negotiated_renderer(request)
    if renderer is not None:
        out.append(',"renderer":')
        _encode_mapping(renderer, out)
    out.append(',"url":{"args":')
    if view_args:
        _encode_sequence([_url_value(value) for value in view_args], out)
    else:
        out.append("[]")
    out.append(',"kwargs":')
    # DRF's format suffix (".json") picks a renderer, not an operation.
    if view_kwargs and (len(view_kwargs) > 1 or "format" not in view_kwargs):
        kwargs = {name: _url_value(value) for name, value in view_kwargs.items()}
        kwargs.pop("format", None)
        _encode_mapping(kwargs, out)
    else:
        out.append("{}")
    out.append("}}")
    return _finished(hasher, out)


def _format_override() -> str | None:
    from rest_framework.settings import api_settings

    return cast("str | None", api_settings.URL_FORMAT_OVERRIDE)


def _fingerprinted_input(
    request: HttpRequest,
    spec: FingerprintSpec,
    view_args: Sequence[Any],
    view_kwargs: Mapping[str, Any],
) -> Any:
    if callable(spec):
        return spec(request)
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
        query = cast("MultiValueDict[str, Any]", getattr(request, "query_params", request.GET))
        # The query string is never JSON, so it needs no form token: written
        # as a plain mapping of lists, as earlier versions wrote it. DRF's
        # ``?format=`` picks a renderer, as the suffix does: the negotiated
        # renderer below stands for both.
        lists = dict(query.lists())
        override = _format_override() if hasattr(request, "query_params") else None
        if override is not None:
            lists.pop(override, None)
        value = {"body": body, "query": lists, "url": url}
    else:
        value = {"fields": select_fields(body, spec), "url": url}
    renderer = _negotiated_renderer(request)
    if renderer is not None:
        value["renderer"] = renderer
    return value
