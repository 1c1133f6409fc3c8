"""Shared machinery of the fuzz tests and of ``scripts/fuzz.py``.

``tests/test_hostile_input.py`` and ``tests/test_tenant_isolation.py`` send
generated requests through Django's test clients to protected views and
check properties of what comes back. This module holds what they share:

- robust echo views of every kind ``@idempotent`` supports (a DRF
  ``@api_view``, a ViewSet, a plain Django view, an ``async def`` view). They
  never fail on garbage input, answer with the status the request asks for in
  ``X-Fuzz-Status`` and echo the request's unique ``X-Fuzz-Marker`` (a
  header, so not part of the fingerprint): a replay must carry the marker of
  the request that created the record, a fresh execution its own;
- ``urlpatterns`` (use ``pytest.mark.urls("tests.fuzzing")``): the echo
  views under ``fuzz/`` plus the test app's own views;
- generators of hostile input (key headers, bodies, content types), an
  independent oracle for what a key header means, the request sender and
  the outcome classifier;
- the counters behind the "generated inputs and outcomes" summary that
  pytest prints at the end of a run (and ``scripts/fuzz.py`` reads back).

In the suite every fuzz test is derandomized (a fixed set of examples) and
small. ``IDEMPOTENCY_FUZZ_EXAMPLES=N`` switches to fuzzing mode: N examples
per test, random seeds (pytest's ``--hypothesis-seed`` fixes one), and
``IDEMPOTENCY_FUZZ_REPORT=path`` writes the counters there as JSON.
"""

from __future__ import annotations

import json
import os
import random
import string
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asgiref.sync import async_to_sync
from django.db import transaction
from django.http import HttpRequest, JsonResponse, RawPostDataException
from django.test import AsyncClient
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart
from django.urls import include, path
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from rest_framework import viewsets
from rest_framework.decorators import api_view
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import SimpleRouter
from rest_framework.test import APIClient

from django_idempotency import idempotent
from django_idempotency.models import IdempotencyRecord
from django_idempotency.scope import default_tenant

MARKER = "X-Fuzz-Marker"
STATUS = "X-Fuzz-Status"
TENANT = "X-Fuzz-Tenant"
REPLAYED = "Idempotent-Replayed"

# --- echo views ---------------------------------------------------------------


def _who(request: Any) -> str:
    """The caller as the echo views report it (never used by the layer itself)."""
    header = request.headers.get(TENANT)
    return f"header:{header}" if header is not None else default_tenant(request)


def _requested_status(request: Any) -> int:
    try:
        status = int(request.headers.get(STATUS, "201"))
    except ValueError:
        return 201
    return status if 200 <= status <= 599 else 201


def _shape(data: Any) -> str:
    """A short, never failing summary of parsed input."""
    if isinstance(data, Mapping):
        names = sorted(str(name)[:16] for name in list(data.keys())[:32])[:4]
        return f"{type(data).__name__}[{len(data)}]:{','.join(names)}"
    if isinstance(data, (list, tuple, str, bytes)):
        return f"{type(data).__name__}[{len(data)}]"
    return type(data).__name__


def echo(request: Any, view: str, shape: str) -> dict[str, Any]:
    return {
        "view": view,
        "marker": request.headers.get(MARKER, ""),
        "method": request.method,
        "tenant": _who(request),
        "shape": shape,
    }


@api_view(["GET", "POST", "PUT", "PATCH", "DELETE"])
@idempotent
def echo_api_view(request: Request) -> Response:
    return Response(
        echo(request, "api-view", _shape(request.data)),
        status=200 if request.method == "GET" else _requested_status(request),
        headers={"Location": f"/fuzz/api-view/{request.headers.get(MARKER, '')}"},
    )


class EchoViewSet(viewsets.ViewSet):
    def list(self, request: Request) -> Response:
        return Response(echo(request, "viewset-list", ""))

    @idempotent
    def create(self, request: Request) -> Response:
        return Response(
            echo(request, "viewset-create", _shape(request.data)),
            status=_requested_status(request),
        )

    @idempotent
    def update(self, request: Request, pk: str | None = None) -> Response:
        return Response(
            echo(request, "viewset-update", _shape(request.data)),
            status=_requested_status(request),
        )

    @idempotent
    def destroy(self, request: Request, pk: str | None = None) -> Response:
        return Response(echo(request, "viewset-destroy", ""), status=_requested_status(request))


def _plain_shape(request: HttpRequest) -> tuple[str, bool]:
    """(summary, parsed) of a plain request's body; JSON that does not parse is refused."""
    content_type = request.content_type or ""
    if content_type == "application/json" or content_type.endswith("+json"):
        try:
            return _shape(json.loads(request.body)), True
        except (ValueError, RecursionError):
            return "", False
    if request.method == "POST" and content_type in (
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        return f"form:{_shape(request.POST)} files:{_shape(request.FILES)}", True
    return f"bytes[{len(request.body)}]", True


def _plain_answer(request: HttpRequest, view: str) -> JsonResponse:
    shape, parsed = _plain_shape(request)
    if not parsed:
        # The view's own definitive 4xx: stored as FAILED and replayed.
        return JsonResponse({**echo(request, view, ""), "error": "not JSON"}, status=400)
    return JsonResponse(echo(request, view, shape), status=_requested_status(request))


@idempotent
def echo_plain(request: HttpRequest) -> JsonResponse:
    return _plain_answer(request, "plain")


@idempotent
async def echo_async(request: HttpRequest) -> JsonResponse:
    return _plain_answer(request, "async")


# Two views sharing one explicit operation name share one key space (by design).
@api_view(["POST"])
@idempotent(operation="fuzz-shared")
def echo_shared_a(request: Request) -> Response:
    return Response(echo(request, "shared-a", ""), status=_requested_status(request))


@api_view(["POST"])
@idempotent(operation="fuzz-shared")
def echo_shared_b(request: Request) -> Response:
    return Response(echo(request, "shared-b", ""), status=_requested_status(request))


_router = SimpleRouter(trailing_slash=False)
_router.register("fuzz/viewset", EchoViewSet, basename="fuzz-viewset")

urlpatterns = [
    path("fuzz/api-view", echo_api_view),
    path("fuzz/plain", echo_plain),
    path("fuzz/async", echo_async),
    path("fuzz/shared-a", echo_shared_a),
    path("fuzz/shared-b", echo_shared_b),
    *_router.urls,
    path("", include("tests.testapp.urls")),
]


# --- targets --------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    path: str
    #: "drf", "django" (a plain view) or "async" (through Django's ASGI handler)
    kind: str
    #: an echo view (robust, echoes the marker) or one of the test app's views
    echo: bool
    #: the operation name the layer derives (default: method plus route)
    operation: str = ""


ECHO_API_VIEW = Target("echo-api-view", "/fuzz/api-view", "drf", True, "POST fuzz/api-view")
ECHO_VIEWSET = Target("echo-viewset", "/fuzz/viewset", "drf", True, "POST fuzz/viewset")
ECHO_PLAIN = Target("echo-plain", "/fuzz/plain", "django", True, "POST fuzz/plain")
ECHO_ASYNC = Target("echo-async", "/fuzz/async", "async", True, "POST fuzz/async")
ECHO_TARGETS = (ECHO_API_VIEW, ECHO_VIEWSET, ECHO_PLAIN, ECHO_ASYNC)
#: The test app's own protected views. Not built for garbage: an exception
#: raised by their own code is their business, not the layer's.
APP_TARGETS = (
    Target("app-api-view", "/api-view/charges", "drf", False),
    Target("app-viewset", "/viewset/charges/", "drf", False),
    Target("app-plain", "/plain/charges", "django", False),
    Target("app-async", "/async/charges", "async", False),
)
ALL_TARGETS = ECHO_TARGETS + APP_TARGETS
APP_VIEW_FILES = (str(Path(__file__).resolve().parent / "testapp" / "views.py"),)
PACKAGE_DIR = str(Path(__file__).resolve().parent.parent / "django_idempotency")


# --- sending and classifying ------------------------------------------------------

#: Our layer's refusal codes (the SPEC's HTTP behaviour table).
LAYER_CODES = {
    400: {"idempotency_key_missing", "idempotency_key_invalid", "parse_error"},
    409: {"idempotency_request_in_progress"},
    413: {"idempotency_body_too_large"},
    422: {"idempotency_key_reused"},
}
#: Statuses after which nothing is stored (the claim is released).
RELEASED = frozenset({408, 409, 423, 425, 429})
#: DRF's own refusals of a body it cannot read (raised while the layer reads
#: ``request.data`` for the fingerprint, before anything is claimed).
DRF_PARSE_ERRORS = ("JSON parse error", "Multipart form parse error", "Malformed request")


@dataclass
class Sent:
    target: Target
    method: str = "POST"
    body: bytes = b"{}"
    content_type: str = "application/json"
    #: The raw Idempotency-Key header value, None for no header.
    key: str | None = None
    query: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)

    def again(self, **changes: Any) -> Sent:
        """The same request, sent again (a fresh marker unless given)."""
        changes.setdefault("marker", uuid.uuid4().hex)
        return replace(self, **changes)


@dataclass
class Seen:
    status: int
    content: bytes
    headers: dict[str, str]
    label: str
    replayed: bool
    #: The echoed marker (echo views), None when the body has none.
    marker: str | None
    body: Any
    #: The exception the view raised (the test client re-raises it), if any.
    raised: BaseException | None = None

    @property
    def code(self) -> str | None:
        if isinstance(self.body, dict):
            code = self.body.get("code")
            return code if isinstance(code, str) else None
        return None

    @property
    def refused_by_layer(self) -> bool:
        return self.code in LAYER_CODES.get(self.status, ()) and not self.replayed


def _raised_in_view(exc: BaseException) -> bool:
    """Whether the innermost of the view's and the package's frames is the view's."""
    last = None
    for frame, _line in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if filename in APP_VIEW_FILES:
            last = "view"
        elif filename.startswith(PACKAGE_DIR):
            last = "package"
    return last == "view"


def _caused_by_the_layer(exc: BaseException) -> bool:
    """Raised in the view, but only because the layer got there first.

    RawPostDataException would mean that the layer read the body's stream
    for the fingerprint without keeping the bytes, so that the view could
    no longer read ``request.body`` (a bug this fuzzing found, fixed; see
    test_hostile_input.test_a_plain_view_can_read_a_multipart_body).
    """
    return isinstance(exc, RawPostDataException)


def send(request: Sent, client: APIClient | None = None) -> Seen:
    """Send ``request`` in-process and classify the answer."""
    headers = {MARKER: request.marker, **request.headers}
    if request.key is not None:
        headers["Idempotency-Key"] = request.key
    url = request.target.path + (f"?{request.query}" if request.query else "")
    try:
        if request.target.kind == "async":

            async def call() -> Any:
                return await AsyncClient().generic(
                    request.method,
                    url,
                    data=request.body,
                    content_type=request.content_type,
                    headers=headers,
                )

            response = async_to_sync(call)()
        else:
            response = (client or APIClient()).generic(
                request.method,
                url,
                # The raw bytes, as sent: Django encodes only a str, but DRF's
                # stubs declare str alone.
                data=request.body,  # type: ignore[arg-type]
                content_type=request.content_type,
                headers=headers,
            )
    except Exception as exc:
        if request.target.echo or not _raised_in_view(exc) or _caused_by_the_layer(exc):
            raise  # a 500 that is not the (non-echo) view's own: a finding
        label = f"500 view raised {type(exc).__name__}"
        return Seen(500, b"", {}, label, False, None, None, exc)
    return classify(request, response.status_code, response.content, dict(response.items()))


def classify(request: Sent, status: int, content: bytes, headers: dict[str, str]) -> Seen:
    lower = {name.lower(): value for name, value in headers.items()}
    replayed = lower.get(REPLAYED.lower()) == "true"
    body: Any = None
    if lower.get("content-type", "").startswith("application/json"):
        try:
            body = json.loads(content)
        except ValueError:
            body = None
    marker = body.get("marker") if isinstance(body, dict) else None
    code = body.get("code") if isinstance(body, dict) else None
    detail = body.get("detail") if isinstance(body, dict) else None
    if replayed:
        label = f"{status} replay"
    elif isinstance(code, str) and code in LAYER_CODES.get(status, ()):
        label = f"{status} {code}"
    elif request.target.echo and marker == request.marker:
        label = f"{status} view"
    elif (
        status == 400
        and isinstance(detail, str)
        and set(body) == {"detail"}
        and detail.startswith(DRF_PARSE_ERRORS)
    ):
        label = "400 drf parse_error"
    elif (
        status == 415
        and isinstance(detail, str)
        and set(body) == {"detail"}
        and detail.startswith("Unsupported media type")
    ):
        label = "415 drf unsupported_media_type"
    elif (
        status == 400
        and request.target.kind == "drf"
        and not request.target.echo
        and isinstance(body, dict)
        and body
        and "detail" not in body
        and all(isinstance(value, list) for value in body.values())
    ):
        # A serializer's ValidationError raised by the test app's view:
        # refused input, answered but not stored (outcomes.standard).
        label = "400 drf validation_error"
    elif status == 400 and lower.get("content-type", "").startswith("text/html"):
        # Django's own "Bad Request (400)" page: a body Django refused to
        # read at all (malformed multipart, too many fields, too large).
        label = "400 django bad_request"
    elif not request.target.echo and (status < 500 or code is None):
        # The test app's views: their own answer (they echo no marker).
        label = f"{status} view"
    else:
        label = f"{status} UNEXPECTED"
    return Seen(status, content, headers, label, replayed, marker, body)


#: Outcomes that mean "refused before the view ran" (nothing may change).
def refused_before_view(seen: Seen) -> bool:
    return (
        seen.refused_by_layer
        or seen.label.startswith(("400 drf", "415 drf", "400 django"))
        or seen.label == "400 parse_error"
    )


def view_owned_failure(seen: Seen) -> bool:
    """A 5xx the view produced itself (allowed), not one of the layer's."""
    if seen.raised is not None:
        return True
    return seen.label == f"{seen.status} view"


# --- records ----------------------------------------------------------------------

_RECORD_FIELDS = [f.attname for f in IdempotencyRecord._meta.concrete_fields]


def records() -> list[tuple[Any, ...]]:
    """Every record, in full, comparable before and after a request."""
    rows = IdempotencyRecord.objects.order_by("pk").values_list(*_RECORD_FIELDS)
    return [
        tuple(bytes(value) if isinstance(value, memoryview) else value for value in row)
        for row in rows
    ]


@contextmanager
def rolled_back() -> Iterator[None]:
    """Run one generated example in a savepoint that is rolled back afterwards."""
    with transaction.atomic():
        try:
            yield
        finally:
            transaction.set_rollback(True)


# --- the key header oracle ----------------------------------------------------------

VISIBLE_ASCII = "".join(chr(code) for code in range(0x21, 0x7F))
KEY_MAX_LENGTH = 255


def _unquote_sf_string(value: str) -> str | None:
    """RFC 8941 sf-string (the whole value, no parameters), or None."""
    out: list[str] = []
    index = 1
    while True:
        if index >= len(value):
            return None  # no closing quote
        char = value[index]
        if char == "\\":
            if index + 1 >= len(value) or value[index + 1] not in '"\\':
                return None
            out.append(value[index + 1])
            index += 2
            continue
        if char == '"':
            index += 1
            break
        if not " " <= char <= "~":
            return None
        out.append(char)
        index += 1
    if index != len(value):
        return None  # parameters, a second item, junk
    return "".join(out)


def expected_key(raw: str) -> str | None:
    """The key a header value carries under the SPEC, or None if it must be refused.

    Written from the SPEC, independently of ``key_header.py``: optional whitespace
    around the value; an RFC 8941 quoted string is unquoted; a value
    with a comma, quoted or not, may be two keys (the header sent twice) and
    is refused; the key must be 1 to 255 visible ASCII characters.
    """
    value = raw.strip(" \t")
    if value.startswith('"'):
        unquoted = _unquote_sf_string(value)
        if unquoted is None:
            return None
        value = unquoted
    if "," in value:
        return None
    if not 1 <= len(value) <= KEY_MAX_LENGTH:
        return None
    if any(char not in VISIBLE_ASCII for char in value):
        return None
    return value


def quoted(key: str) -> str:
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def spellings(key: str) -> list[str]:
    """Header values that all carry ``key`` (quoted, bare where possible, padded)."""
    forms = [quoted(key), f" {quoted(key)}\t", f"\t{quoted(key)}  "]
    if "," not in key and not key.startswith('"'):
        forms += [key, f"  {key}", f"{key}\t "]
    return forms


# --- generators -----------------------------------------------------------------------


def _stretch(text: str, length: int) -> str:
    """``text`` repeated to exactly ``length`` characters (long keys, cheaply)."""
    if not text:
        return ""
    return (text * (length // len(text) + 1))[:length]


_latin1 = st.characters(min_codepoint=0, max_codepoint=0xFF)
_visible = st.sampled_from(VISIBLE_ASCII)
_sf_chars = st.sampled_from([chr(c) for c in range(0x20, 0x7F)])
_controls = st.sampled_from([chr(c) for c in [*range(0x00, 0x20), 0x7F, 0x85, 0xA0]])


@st.composite
def _quoted_forms(draw: st.DrawFn) -> str:
    inner = draw(st.text(_sf_chars, max_size=300))
    form = quoted(inner)
    tweak = draw(st.integers(0, 9))
    if tweak == 1:
        form += draw(st.sampled_from([";a=1", ";a", ";", " ;x=?0", '"', "x", ' "b"']))
    elif tweak == 2:
        form = form[:-1]  # unterminated
    elif tweak == 3:
        form = '"' + inner  # unterminated, raw
    elif tweak == 4:  # a lone or invalid escape
        form = '"' + inner + draw(st.sampled_from(["\\", "\\n", "\\t", "\\u0041"])) + '"'
    elif tweak == 5:
        form = '"' + inner + draw(_controls | st.characters(min_codepoint=0x80)) + '"'
    return form


@st.composite
def key_headers(draw: st.DrawFn) -> str:
    """Idempotency-Key header values, mostly hostile, 0 to 10,000 characters."""
    kind = draw(st.integers(0, 9))
    if kind == 0:  # anything at all
        return draw(st.text(max_size=40))
    if kind == 1:  # visible ASCII around the length limit and far beyond it
        length = draw(
            st.sampled_from([0, 1, 2, 254, 255, 256, 257, 1000, 4096, 8190, 8192, 9999, 10000])
            | st.integers(0, 10_000)
        )
        return _stretch(draw(st.text(_visible, min_size=1, max_size=40)), length)
    if kind == 2:  # mostly good, with one hostile character
        good = draw(st.text(_visible, min_size=0, max_size=40))
        bad = draw(_controls | st.characters(min_codepoint=0x80) | st.sampled_from(" \t"))
        position = draw(st.integers(0, len(good)))
        return good[:position] + bad + good[position:]
    if kind == 3:
        return draw(_quoted_forms())
    if kind == 4:  # the header sent twice, joined by the server
        first = draw(st.text(_visible, min_size=1, max_size=20) | _quoted_forms())
        second = draw(st.text(_visible, min_size=1, max_size=20) | _quoted_forms())
        return first + draw(st.sampled_from([", ", ",", " , "])) + second
    if kind == 5:  # whitespace padding
        core = draw(st.text(_visible, min_size=0, max_size=40) | _quoted_forms())
        pad = st.text(st.sampled_from(" \t"), max_size=3)
        return draw(pad) + core + draw(pad)
    if kind == 6:  # latin-1, what a real server can deliver
        return draw(st.text(_latin1, max_size=60))
    if kind == 7:  # long unicode
        return _stretch(draw(st.text(min_size=1, max_size=10)), draw(st.integers(0, 10_000)))
    if kind == 8:  # long quoted
        inner = _stretch(
            draw(st.text(_visible, min_size=1, max_size=10)), draw(st.integers(0, 600))
        )
        return quoted(inner)
    return draw(st.text(_visible, min_size=1, max_size=64))  # plain good keys


# JSON values, and spellings of them that must fingerprint alike.
json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=16,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, min_size=0, max_size=5)


def spell(value: Any, rnd: random.Random) -> str:
    """A JSON text for ``value``: random key order, whitespace and number spelling."""

    def space() -> str:
        return rnd.choice(["", "", " ", "\n", "\t", "  "])

    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        forms = [str(value)]
        if abs(value) < 2**50:
            forms += [f"{value}.0", f"{value}e0", f"{value}E+0"]
        if 0 < abs(value) < 2**50:
            forms.append(f"{value}0e-1")  # not for 0: "00e-1" is not JSON
        if value == 0:
            forms += ["-0", "0.0e7", "-0.0"]
        return rnd.choice(forms)
    if isinstance(value, float):
        # Spellings that parse back to the same float. (Not "%.17g" of a
        # large integral float: "72057594037927936" is an integer literal,
        # another number than 7.205759403792794e16, the float's shortest form.)
        forms = [repr(value), f"{value:.17e}", f"{value:.17e}".upper()]
        if value.is_integer() and abs(value) < 2**50:
            forms.append(str(int(value)))
        return rnd.choice(forms)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=rnd.choice([True, False]))
    if isinstance(value, list):
        sep = space() + "," + space()
        return "[" + space() + sep.join(spell(item, rnd) for item in value) + space() + "]"
    items = list(value.items())
    rnd.shuffle(items)
    sep = space() + "," + space()
    inner = sep.join(
        json.dumps(name, ensure_ascii=rnd.choice([True, False]))
        + space()
        + ":"
        + space()
        + spell(item, rnd)
        for name, item in items
    )
    return "{" + space() + inner + space() + "}"


def mutate(value: dict[str, Any], rnd: random.Random) -> dict[str, Any]:
    """A copy of ``value`` with one change, somewhere, that changes its meaning."""

    def change(node: Any) -> Any:
        if isinstance(node, dict):
            if node and rnd.random() < 0.6:
                name = rnd.choice(list(node))
                return {**node, name: change(node[name])}
            fresh = "mutated" + "".join(rnd.choice(string.ascii_letters) for _ in range(6))
            return {**node, fresh: None}
        if isinstance(node, list):
            if node and rnd.random() < 0.6:
                index = rnd.randrange(len(node))
                return [*node[:index], change(node[index]), *node[index + 1 :]]
            return [*node, None]
        if node is None:
            return False
        if isinstance(node, bool):
            return None
        if isinstance(node, (int, float)):
            return "was a number"
        return node + "x"

    return change(value)  # type: ignore[no-any-return]


_WRONG_TYPES = [
    "text/plain",
    "application/xml",
    "application/octet-stream",
    "",
    "application/json; charset=utf-16",
    "application/json; charset=latin-1",
    "application/json;charset=bogus",
    "application/merge-patch+json",
    "APPLICATION/JSON",
    "application/json ; q=1",
    "multipart/form-data",
    "multipart/form-data; boundary=",
    "multipart/form-data; boundary=nope",
    "application/x-www-form-urlencoded; charset=utf-16",
    "*/*",
    'text/html; charset="utf-8"',
    "application/x-www-form-urlencoded",
]


def _nested(depth: int, style: int) -> str:
    if style == 0:
        return "[" * depth + "]" * depth
    if style == 1:
        return '{"a":' * depth + "1" + "}" * depth
    if style == 2:
        return "[" * depth  # unterminated
    return '{"a":[' * depth + "null" + "]}" * depth


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, str, str]:
    """(body, content type, kind) of a hostile request body."""
    kind = draw(
        st.sampled_from(
            [
                "json",
                "invalid-json",
                "nested",
                "huge-number",
                "nan-infinity",
                "duplicate-keys",
                "non-utf8",
                "form",
                "multipart",
                "broken-multipart",
                "wrong-type",
                "empty",
            ]
        )
    )
    json_type = draw(
        st.sampled_from(["application/json"] * 4 + ["application/json; charset=utf-8"])
    )
    if kind == "json":
        value = draw(json_objects | json_values)
        return spell(value, draw(st.randoms(use_true_random=False))).encode(), json_type, kind
    if kind == "invalid-json":
        text = draw(
            st.sampled_from(
                [
                    '{"a":',
                    "{'a': 1}",
                    '{"a" 1}',
                    "[1,]",
                    '{"a":1}}',
                    "01",
                    '"\\x"',
                    "tru",  # spellchecker:disable-line
                    "\ufeff{}",
                ]
            )
            | st.text(max_size=80)
        )
        return text.encode("utf-8", "surrogatepass"), json_type, kind
    if kind == "nested":
        depth = draw(st.sampled_from([10, 500, 900, 990, 1000, 2000, 10_000, 100_000]))
        return _nested(depth, draw(st.integers(0, 3))).encode(), json_type, kind
    if kind == "huge-number":
        number = draw(
            st.sampled_from(
                ["1e999", "-1e999", "1E400", "1e-999", "-0", "-0.0", "1e308", "2e308", "4.9e-324"]
            )
            | st.integers(300, 6000).map(lambda n: "9" * n)
            | st.integers(300, 6000).map(lambda n: "1." + "1" * n)
            | st.integers(0, 100_000).map(lambda n: f"1e{n}")
        )
        template = draw(st.sampled_from(['{"amount": %s}', "[%s]", "%s", '{"a": {"b": [%s]}}']))
        return (template % number).encode(), json_type, kind
    if kind == "nan-infinity":
        constant = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "nan", "inf"]))
        template = draw(st.sampled_from(['{"amount": %s}', "[%s]", "%s", '{"a": [1, %s]}']))
        return (template % constant).encode(), json_type, kind
    if kind == "duplicate-keys":
        first, second = draw(json_leaves), draw(json_leaves)
        text = f'{{"amount": {json.dumps(first)}, "amount": {json.dumps(second)}}}'
        return text.encode(), json_type, kind
    if kind == "non-utf8":
        raw = draw(
            st.sampled_from([b'{"note": "\xff\xfe"}', b"\xff\xfe{\x00}\x00", b'{"\xc3\x28": 1}'])
            | st.binary(max_size=64)
        )
        content_type = draw(
            st.sampled_from(
                [json_type, "application/x-www-form-urlencoded", "text/plain", MULTIPART_CONTENT]
            )
        )
        return raw, content_type, kind
    if kind == "form":
        pairs = draw(
            st.lists(st.tuples(st.text(max_size=10), st.text(max_size=10)), max_size=6)
            | st.integers(990, 1100).map(lambda n: [(f"f{i}", "x") for i in range(n)])
        )
        from urllib.parse import urlencode

        text = draw(st.just(urlencode(pairs)) | st.text(string.printable, max_size=60))
        return text.encode(), "application/x-www-form-urlencoded", kind
    if kind == "multipart":
        from django.core.files.uploadedfile import SimpleUploadedFile

        data: dict[str, Any] = draw(
            st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=20), max_size=4)
        )
        if draw(st.booleans()):
            name = draw(
                st.text(
                    st.characters(exclude_characters="/\\\x00", exclude_categories=["Cs"]),
                    min_size=1,
                    max_size=12,
                )
            ) + draw(st.sampled_from([".bin", ".txt", "_"]))
            data["upload"] = SimpleUploadedFile(name, draw(st.binary(max_size=200)))
        return encode_multipart(BOUNDARY, data), MULTIPART_CONTENT, kind
    if kind == "broken-multipart":
        whole = encode_multipart(BOUNDARY, {"a": "1", "b": "two"})
        cut = draw(st.integers(0, len(whole)))
        content_type = draw(
            st.sampled_from(
                [MULTIPART_CONTENT, "multipart/form-data", "multipart/form-data; boundary=other"]
            )
        )
        return whole[:cut], content_type, kind
    if kind == "wrong-type":
        value = draw(json_objects)
        content_type = draw(st.sampled_from(_WRONG_TYPES) | st.text(string.printable, max_size=30))
        return json.dumps(value).encode(), content_type.replace("\n", "").replace("\r", ""), kind
    return b"", draw(st.sampled_from([json_type, "", "text/plain"])), kind


# --- settings, counters and the summary ---------------------------------------------

EXAMPLES_ENV = "IDEMPOTENCY_FUZZ_EXAMPLES"
STATEFUL_EXAMPLES_ENV = "IDEMPOTENCY_FUZZ_STATEFUL_EXAMPLES"
REPORT_ENV = "IDEMPOTENCY_FUZZ_REPORT"
FUZZING = bool(os.environ.get(EXAMPLES_ENV))


def fuzz_settings(
    in_suite: int, *, stateful: bool = False, **overrides: Any
) -> hypothesis_settings:
    """Derandomized and small in the suite; long and random under scripts/fuzz.py.

    A state machine's example is a whole sequence of requests: in fuzzing
    mode they get ``IDEMPOTENCY_FUZZ_STATEFUL_EXAMPLES`` (default: a
    twentieth of the examples).
    """
    common: dict[str, Any] = {
        "deadline": None,
        "database": None,
        "suppress_health_check": list(HealthCheck),
    }
    if FUZZING:
        examples = int(os.environ[EXAMPLES_ENV])
        if stateful:
            examples = int(os.environ.get(STATEFUL_EXAMPLES_ENV) or max(10, examples // 20))
        common.update(max_examples=examples, derandomize=False)
    else:
        common.update(max_examples=in_suite, derandomize=True)
    common.update(overrides)
    return hypothesis_settings(**common)


@dataclass
class Stats:
    #: generated inputs (examples) per test
    inputs: Counter[str] = field(default_factory=Counter)
    #: outcome label -> requests, per test
    outcomes: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    #: kind of input -> generated inputs, per test
    kinds: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))


STATS = Stats()


def note_input(test: str, kind: str = "") -> None:
    STATS.inputs[test] += 1
    if kind:
        STATS.kinds[test][kind] += 1


def note(test: str, seen: Seen) -> None:
    STATS.outcomes[test][seen.label] += 1


def key_kind(raw: str | None) -> str:
    """A coarse class of a key header value, for the summary."""
    if raw is None:
        return "missing"
    if len(raw) > KEY_MAX_LENGTH + 2:
        return "long (>257)"
    if any(not " " <= char <= "~" for char in raw):
        return "control or non-ASCII"
    if "," in raw and not raw.strip(" \t").startswith('"'):
        return "bare with comma (sent twice)"
    if raw.strip(" \t").startswith('"'):
        return "quoted"
    return "bare"


class _Summary:
    """Prints the counters after the run (a plugin registered by the fuzz tests)."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not STATS.inputs:
            return
        terminalreporter.section("fuzzing: generated inputs and outcomes")
        for test in sorted(STATS.inputs):
            outcomes = STATS.outcomes[test]
            terminalreporter.write_line(
                f"{test}: {STATS.inputs[test]} generated inputs, {sum(outcomes.values())} requests"
            )
            for label, count in sorted(outcomes.items(), key=lambda item: (-item[1], item[0])):
                terminalreporter.write_line(f"  {count:8d}  {label}")
            kinds = STATS.kinds.get(test)
            if kinds:
                terminalreporter.write_line(
                    "  inputs by kind: "
                    + ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
                )
        report = os.environ.get(REPORT_ENV)
        if report:
            Path(report).write_text(
                json.dumps(
                    {
                        test: {
                            "inputs": STATS.inputs[test],
                            "requests": sum(STATS.outcomes[test].values()),
                            "outcomes": dict(STATS.outcomes[test]),
                            "kinds": dict(STATS.kinds.get(test, {})),
                        }
                        for test in STATS.inputs
                    },
                    indent=2,
                    sort_keys=True,
                )
            )


def install_summary(config: Any) -> None:
    if not config.pluginmanager.has_plugin("idempotency-fuzz-summary"):
        config.pluginmanager.register(_Summary(), "idempotency-fuzz-summary")
