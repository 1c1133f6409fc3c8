"""Fingerprints: property tests of the SPEC's definition."""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
import struct
from collections.abc import Callable
from decimal import Decimal
from typing import IO, Any, cast

import pytest
from django.test import RequestFactory
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.test import APIClient, APIRequestFactory

from django_idempotency._store.digests import Fingerprint
from django_idempotency.fingerprint import (
    _fingerprinted_input,
    canonical,
    fingerprint,
    request_fingerprint,
    select_fields,
    write_canonical,
)
from tests.utils import masked_csrf_token, post

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=5)


def shuffled(value: Any, rng: random.Random) -> Any:
    """The same value with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: shuffled(item, rng) for key, item in items}
    if isinstance(value, list):
        return [shuffled(item, rng) for item in value]
    return value


def respelled(value: Any, rng: random.Random) -> str:
    """JSON text for ``value`` with other whitespace and number spellings."""
    space = rng.choice(["", " ", "\n  ", "\t"])
    if isinstance(value, dict):
        members = [
            f"{space}{json.dumps(key)}{space}:{space}{respelled(item, rng)}"
            for key, item in value.items()
        ]
        return "{" + ",".join(members) + space + "}"
    if isinstance(value, list):
        return "[" + ",".join(space + respelled(item, rng) for item in value) + space + "]"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int):
        if abs(value) > 2**53:
            # Spelled with a fraction or exponent, JSON parsers read a float,
            # which cannot hold this integer: a different number to the view.
            return str(value)
        return rng.choice([str(value), f"{value}.0", f"{value}e0", f"{value}.000E+0"])
    exact = Decimal(repr(value))
    return rng.choice([repr(value), f"{exact:E}", f"{exact:e}", f"{exact:f}"])


def parsed_request_fingerprint(raw: str) -> Fingerprint:
    django_request = APIRequestFactory().post("/x", raw, content_type="application/json")
    request = Request(django_request, parsers=[JSONParser()])
    return request_fingerprint(request, None, (), {})


@settings(max_examples=300, deadline=None)
@given(json_objects, st.randoms(use_true_random=False))
def test_key_order_whitespace_and_number_spelling_never_change_it(
    value: dict[str, Any], rng: random.Random
) -> None:
    original = parsed_request_fingerprint(json.dumps(value))
    variant = respelled(shuffled(value, rng), rng)
    assert parsed_request_fingerprint(variant) == original, variant


def leaf_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict) and value:
        return [p for key, item in value.items() for p in leaf_paths(item, (*path, key))]
    if isinstance(value, list) and value:
        return [p for index, item in enumerate(value) for p in leaf_paths(item, (*path, index))]
    return [path]


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, *rest = path
    copy: Any = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = replaced(value[head], tuple(rest), new)
    return copy


def same_json_value(a: Any, b: Any) -> bool:
    """Equal as JSON values: 1 == 1.0, but True != 1 and "1" != 1."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return Decimal(repr(a) if isinstance(a, float) else a) == Decimal(
            repr(b) if isinstance(b, float) else b
        )
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(json_objects.filter(bool), json_values, st.data())
def test_any_changed_value_nested_or_not_changes_it(
    value: dict[str, Any], new: Any, data: st.DataObject
) -> None:
    path = data.draw(st.sampled_from(leaf_paths(value)))
    old = value
    for part in path:
        old = old[part]
    assume(not same_json_value(old, new))
    assume(not (isinstance(old, (dict, list)) and old == new))

    changed = replaced(value, path, new)

    assert parsed_request_fingerprint(json.dumps(changed)) != parsed_request_fingerprint(
        json.dumps(value)
    )


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (2**53, 2**53 + 1),
        (10**30, 10**30 + 1),
        (0.1, 0.10000000000000002),
        ("1", 1),
        (True, 1),
        (None, False),
        ([], {}),
        ([1, 2], [2, 1]),
        ("", None),
    ],
)
def test_values_that_differ_have_different_fingerprints(left: Any, right: Any) -> None:
    assert fingerprint({"a": left}) != fingerprint({"a": right})


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (1, 1.0),
        (100, 1e2),
        (-0.0, 0),
        (1.5e-7, Decimal("0.00000015")),
        (10**20, 1e20),
    ],
)
def test_numbers_of_equal_value_have_one_spelling(left: Any, right: Any) -> None:
    assert canonical(left) == canonical(right)


def test_canonical_form_is_sorted_and_compact() -> None:
    assert canonical({"b": [1, {"d": 2.50, "c": None}], "a": "é"}) == (
        b'{"a":"\\u00e9","b":[1,{"c":null,"d":2.5}]}'
    )


def test_non_finite_numbers_have_no_fingerprint() -> None:
    with pytest.raises(ValueError):
        canonical(float("nan"))


def test_selected_fields_tell_absent_from_null() -> None:
    data = {"a": {"b": None}, "items": [{"sku": "x"}]}
    assert select_fields(data, ["a.b", "a.c", "items.0.sku", "items.5.sku"]) != select_fields(
        {"a": {"b": None, "c": None}, "items": [{"sku": "x"}]},
        ["a.b", "a.c", "items.0.sku", "items.5.sku"],
    )
    assert fingerprint(select_fields(data, ["a.c"])) != fingerprint({"a.c": None})


def test_the_key_and_transport_headers_are_not_part_of_it() -> None:
    factory = APIRequestFactory()

    def of(**headers: str) -> Fingerprint:
        request = Request(
            factory.post("/x", '{"a": 1}', content_type="application/json", **headers),
            parsers=[JSONParser()],
        )
        return request_fingerprint(request, None, (), {})

    assert of(HTTP_IDEMPOTENCY_KEY="one", HTTP_TRACEPARENT="00-a-b-01") == of(
        HTTP_IDEMPOTENCY_KEY="two", HTTP_X_FORWARDED_FOR="10.0.0.1", HTTP_DATE="Mon"
    )


def test_url_arguments_are_part_of_it() -> None:
    request = Request(APIRequestFactory().post("/x", {}, format="json"), parsers=[JSONParser()])
    assert request_fingerprint(request, None, (), {"pk": 1}) != request_fingerprint(
        request, None, (), {"pk": 2}
    )


def test_a_callable_decides_the_input() -> None:
    request = Request(APIRequestFactory().post("/x?x=1", {"a": 1}, format="json"))
    assert request_fingerprint(request, lambda r: {"fixed": True}, (), {"pk": 1}) == fingerprint(
        {"fixed": True}
    )


def test_every_value_of_a_multi_value_dict_counts() -> None:
    from django.utils.datastructures import MultiValueDict

    assert fingerprint(MultiValueDict({"f": ["AAA", "BBB"]})) != fingerprint(
        MultiValueDict({"f": ["XXX", "BBB"]})
    )


# --- the canonical form: what a stored fingerprint digests, stable across releases --------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            '{"amount": 4200, "currency": "EUR", "order_id": "ORD-1001"}',
            "d69792dd837be95a06c0974155f1bb6b050ae88133bc19c990d0aec74006a9c0",
        ),
        (
            '{"a": [1, 2.5, -0.0, 1.5e-7, 1e20, 12345678901234567890123, 9007199254740993],'
            ' "b": {"c": null, "d": true, "e": "\\u00e9\\ud83d\\ude00"}}',
            "a41711726b4f75e57f56e0c16021233ed09ed9d9e986dd7db7198ee1bbb40740",
        ),
        (
            '{"x": 3.655760495095878e16, "y": 1e-30, "z": 123.456e30}',
            "93b7c8a4b5dcac1cbc04cc4c4f82d9cb9cbc2c2cd85cc0b9a4e952f1f9a3081c",
        ),
    ],
)
def test_json_requests_keep_their_canonical_form(body: str, expected: str) -> None:
    """The SHA-256 of each request's canonical form, pinned: a stored fingerprint is an HMAC of it,
    so a change of the form would turn a retry across an upgrade into a 422."""
    django_request = APIRequestFactory().post(
        "/x?b=2&a=1&a=0", body, content_type="application/json"
    )
    request = Request(django_request, parsers=[JSONParser()])
    canonical_form = hashlib.sha256()
    write_canonical(_fingerprinted_input(request, None, (), {"pk": 7}), canonical_form)
    assert canonical_form.hexdigest() == expected


def _drf_request(path: str, body: str, **extra: Any) -> Request:
    from rest_framework.parsers import FormParser, MultiPartParser
    from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer
    from rest_framework.views import APIView

    content_type = extra.pop("content_type", "application/json")
    request = Request(
        APIRequestFactory().post(path, body, content_type=content_type, **extra),
        parsers=[JSONParser(), FormParser(), MultiPartParser()],
    )
    view = APIView()
    view.renderer_classes = [JSONRenderer, BrowsableAPIRenderer]
    request.parser_context = {"view": view}
    request.accepted_renderer = (
        BrowsableAPIRenderer() if "text/html" in extra.get("HTTP_ACCEPT", "") else JSONRenderer()
    )
    return request


_LARGE_BODY = json.dumps({f"field{index}": [index, str(index)] for index in range(800)})


@pytest.mark.parametrize(
    ("path", "body", "args", "kwargs", "extra"),
    [
        ("/x", '{"amount": 4200, "currency": "EUR"}', (), {}, {}),
        ("/x?b=2&a=1&a=0", '{"a": [1, 2.5, -0.0, 1e20], "b": {"c": null}}', (), {"pk": 7}, {}),
        ("/x?format=json&b=2", '{"a": 1}', ("uuid", 3), {"pk": "7", "format": "json"}, {}),
        ("/x", '{"a": 1}', (), {"format": "json"}, {}),
        ("/x", '{"a": 1}', (), {}, {"HTTP_ACCEPT": "text/html"}),
        (
            "/x",
            "amount=5&amount=6&csrfmiddlewaretoken=t",
            (),
            {},
            {"content_type": "application/x-www-form-urlencoded"},
        ),
        ("/x?q=1", _LARGE_BODY, (1,), {"pk": 1}, {}),
        ("/x", '{"long": "' + "é" * 20000 + '"}', (), {}, {}),
    ],
)
def test_the_whole_input_is_fingerprinted_in_one_pass_as_its_canonical_dict_is(
    path: str, body: str, args: tuple[Any, ...], kwargs: dict[str, Any], extra: dict[str, Any]
) -> None:
    """``fingerprint=None`` writes the canonical form of ``{"body", "query", "renderer", "url"}``
    without building that dict: the same bytes, so the same fingerprints stored fingerprints
    are compared with (a long body's form is streamed in chunks, a short one's digested whole)."""
    request = _drf_request(path, body, **extra)
    expected = fingerprint(_fingerprinted_input(request, None, args, kwargs))

    assert request_fingerprint(request, None, args, kwargs) == expected


# --- form data is not JSON ----------------------------------------------------------------


def drf_request_fingerprint(django_request: Any, spec: Any = None) -> Fingerprint:
    from rest_framework.parsers import FormParser, MultiPartParser

    request = Request(django_request, parsers=[JSONParser(), FormParser(), MultiPartParser()])
    return request_fingerprint(request, spec, (), {})


@pytest.mark.parametrize("spec", [None, ["amount"], ["amount.0"]])
def test_a_form_body_and_the_json_spelling_of_its_lists_differ(spec: Any) -> None:
    factory = APIRequestFactory()
    form = factory.post("/x", "amount=5", content_type="application/x-www-form-urlencoded")
    json_body = factory.post("/x", '{"amount": ["5"]}', content_type="application/json")
    assert drf_request_fingerprint(form, spec) != drf_request_fingerprint(json_body, spec)


def test_a_plain_views_form_body_and_its_json_spelling_differ() -> None:
    from django.test import RequestFactory

    factory = RequestFactory()
    form = factory.post("/x", "amount=5", content_type="application/x-www-form-urlencoded")
    json_body = factory.post(
        "/x", '{"files": {}, "form": {"amount": ["5"]}}', content_type="application/json"
    )
    assert request_fingerprint(form, None, (), {}) != request_fingerprint(json_body, None, (), {})


def test_a_multipart_and_an_urlencoded_form_with_the_same_fields_are_one_request() -> None:
    from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart

    factory = APIRequestFactory()
    urlencoded = factory.post(
        "/x", "amount=5&note=a", content_type="application/x-www-form-urlencoded"
    )
    multipart = factory.post(
        "/x",
        encode_multipart(BOUNDARY, {"amount": "5", "note": "a"}),
        content_type=MULTIPART_CONTENT,
    )
    assert drf_request_fingerprint(urlencoded) == drf_request_fingerprint(multipart)


def test_the_csrf_token_of_a_form_is_not_part_of_it() -> None:
    """Django masks the token anew for every page: a form rendered again is the same request."""
    from django.middleware.csrf import _get_new_csrf_string
    from django.test import RequestFactory

    secret = _get_new_csrf_string()
    one, other = masked_csrf_token(secret), masked_csrf_token(secret)
    assert one != other
    factory = RequestFactory()

    def of(token: str) -> Fingerprint:
        request = factory.post("/x", {"amount": "5", "csrfmiddlewaretoken": token})
        return request_fingerprint(request, None, (), {})

    assert of(one) == of(other)


# --- content negotiation ------------------------------------------------------------------


@pytest.mark.django_db
def test_a_retry_asking_another_media_type_is_refused_not_answered_in_the_first_one() -> None:
    from rest_framework.test import APIClient

    api = APIClient()
    first = api.post(
        "/api-view/charges",
        {"amount": 5},
        format="json",
        HTTP_IDEMPOTENCY_KEY="negotiated",
        HTTP_ACCEPT="text/html",
    )
    assert first.status_code == 201
    assert first["Content-Type"].startswith("text/html")

    as_json = api.post(
        "/api-view/charges",
        {"amount": 5},
        format="json",
        HTTP_IDEMPOTENCY_KEY="negotiated",
        HTTP_ACCEPT="application/json",
    )

    assert as_json.status_code == 422
    assert as_json.json()["code"] == "idempotency_key_reused"


@pytest.mark.django_db
@pytest.mark.parametrize("accept", ["application/json", "*/*", "application/*", None])
def test_asking_for_the_default_media_type_is_the_same_request_as_asking_nothing(
    accept: str | None,
) -> None:
    from rest_framework.test import APIClient

    api = APIClient()
    first = api.post("/api-view/charges", {"amount": 5}, format="json", HTTP_IDEMPOTENCY_KEY="k")
    retry = api.post(
        "/api-view/charges",
        {"amount": 5},
        format="json",
        headers=None if accept is None else {"Accept": accept},
        HTTP_IDEMPOTENCY_KEY="k",
    )

    assert retry.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.content == first.content


# --- numbers: one bounded spelling per value ---------------------------------------------


@pytest.mark.parametrize(
    ("value", "spelling"),
    [
        (1e308, b"1E+308"),
        (5e-324, b"5E-324"),
        (-1.7976931348623157e308, b"-1.7976931348623157E+308"),
        (10**60, b"1E+60"),
        (10**60 + 1, b"1." + b"0" * 59 + b"1E+60"),
        (Decimal("1.50E+1000"), b"1.5E+1000"),
        # Small exponents keep the positional spelling earlier versions stored.
        (1e20, b"100000000000000000000"),
        (1.5e-7, b"0.00000015"),
        (1e-30, b"0.000000000000000000000000000001"),
        (2**53 + 1, b"9007199254740993"),
        (2**128, str(2**128).encode()),
    ],
)
def test_numbers_are_spelled_exactly_and_with_bounded_length(value: Any, spelling: bytes) -> None:
    assert canonical(value) == spelling


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-400, max_value=400), st.integers(min_value=1, max_value=10**20))
def test_an_integer_and_a_float_of_the_same_value_are_spelled_alike(
    exponent: int, digits: int
) -> None:
    value = digits * 10**exponent if exponent >= 0 else None
    as_float = float(f"{digits}e{exponent}")
    assume(math.isfinite(as_float) and as_float != 0)
    exact = Decimal(repr(as_float))
    assert canonical(as_float) == canonical(exact)
    if value is not None and Decimal(value) == exact:
        assert canonical(value) == canonical(as_float)
    assert canonical(as_float) != canonical(math.nextafter(as_float, math.inf))


def test_canonical_form_streams_in_bounded_chunks() -> None:
    from django_idempotency.fingerprint import write_canonical

    value = {"items": [{"n": index, "x": 1e308, "s": "é" * 10} for index in range(20_000)]}
    chunks: list[bytes] = []

    class Sink:
        def update(self, data: bytes) -> None:
            chunks.append(bytes(data))

    write_canonical(value, Sink())

    assert b"".join(chunks) == canonical(value)
    assert len(chunks) > 10
    assert max(len(chunk) for chunk in chunks) <= 256 * 1024


def hostile_float_body() -> bytes:
    """2.6 MB of the floats whose positional spelling is longest."""
    return ("[" + ",".join(["1e308", "5e-324"] * 220_000) + "]").encode()


@pytest.mark.parametrize(
    "body",
    [
        hostile_float_body(),
        # Each byte escaped to six characters ("\\u0001"): escaped in slices.
        json.dumps({"note": "\x01" * 2_600_000}).encode(),
        json.dumps([{"amount": index, "note": "x" * 20} for index in range(60_000)]).encode(),
    ],
    ids=["hostile-floats", "control-characters", "ordinary"],
)
def test_fingerprinting_a_large_body_needs_less_memory_than_the_body(body: bytes) -> None:
    import tracemalloc

    value = json.loads(body)
    tracemalloc.start()
    try:
        fingerprint(value)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # Before: 135 MB for the 2.6 MB hostile body, the whole canonical form
    # held at once. Now: bounded chunks, whatever the body holds.
    assert peak < len(body) // 2, (peak, len(body))


# --- forms behind CsrfViewMiddleware (it reads request.POST before the view) --------------


def csrf_client() -> tuple[Any, str]:
    """A test client that enforces CSRF, as browsers meet it, with a valid cookie."""
    from django.middleware.csrf import _get_new_csrf_string
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    secret = _get_new_csrf_string()
    client.cookies["csrftoken"] = secret
    return client, secret


@pytest.mark.django_db
@pytest.mark.parametrize("encoding", ["multipart", "urlencoded"])
def test_a_csrf_protected_plain_form_view_runs_replays_and_refuses_changed_input(
    encoding: str,
) -> None:
    from urllib.parse import urlencode

    from django.core.files.uploadedfile import SimpleUploadedFile

    from django_idempotency.models import IdempotencyRecord
    from tests.testapp.models import Charge

    client, secret = csrf_client()

    def post(amount: str, token: str) -> Any:
        fields = {"amount": amount, "csrfmiddlewaretoken": token}
        if encoding == "multipart":
            receipt = SimpleUploadedFile("receipt.txt", b"paid")
            return client.post(
                "/plain/form-charges", {**fields, "receipt": receipt}, HTTP_IDEMPOTENCY_KEY="form"
            )
        return client.post(
            "/plain/form-charges",
            urlencode(fields),
            content_type="application/x-www-form-urlencoded",
            HTTP_IDEMPOTENCY_KEY="form",
        )

    first = post("3", masked_csrf_token(secret))
    assert first.status_code == 201, first.content[:500]
    retry = post("3", masked_csrf_token(secret))  # the form rendered again
    changed = post("4", masked_csrf_token(secret))

    assert (retry.status_code, retry["Idempotent-Replayed"]) == (201, "true")
    assert retry.content == first.content
    assert changed.status_code == 422
    assert changed.json()["code"] == "idempotency_key_reused"
    assert Charge.objects.count() == IdempotencyRecord.objects.count() == 1


@pytest.mark.django_db
def test_a_csrf_protected_plain_view_still_refuses_a_post_without_a_token() -> None:
    client, _ = csrf_client()

    response = client.post("/plain/form-charges", {"amount": "3"}, HTTP_IDEMPOTENCY_KEY="form")

    assert response.status_code == 403


@settings(max_examples=2000, deadline=None)
@given(
    st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(0, 2**64 - 1).map(lambda bits: struct.unpack("<d", struct.pack("<Q", bits))[0])
)
def test_floats_are_spelled_as_their_exact_decimal_value_is(value: float) -> None:
    """The fast path for floats agrees with the Decimal one, at every exponent."""
    assume(math.isfinite(value))
    assert canonical(value) == canonical(Decimal(repr(value)))


@pytest.mark.django_db
def test_drfs_format_query_parameter_picks_a_renderer_like_the_suffix_does(
    api: APIClient,
) -> None:
    """``?format=json`` is the view's default renderer: the same request as none."""
    first = post(api, "/api-view/charges", {"amount": 1}, "format-query")
    retry = api.post(
        "/api-view/charges?format=json",
        {"amount": 1},
        format="json",
        HTTP_IDEMPOTENCY_KEY="format-query",
    )

    assert first.status_code == 201
    assert retry["Idempotent-Replayed"] == "true"


# -- files of any kind, and other values parsers deliver --------------------------------


def test_any_django_file_is_its_name_and_the_digest_of_its_content() -> None:
    from django.core.files.base import ContentFile
    from django.core.files.uploadedfile import SimpleUploadedFile

    def of(file: Any) -> Fingerprint:
        return fingerprint({"file": file})

    assert of(ContentFile(b"abc", name="a.txt")) == of(ContentFile(b"abc", name="a.txt"))
    # An upload and any other File of the same name and content are one value.
    assert of(ContentFile(b"abc", name="a.txt")) == of(SimpleUploadedFile("a.txt", b"abc"))
    assert of(ContentFile(b"abc", name="a.txt")) != of(ContentFile(b"abx", name="a.txt"))
    assert of(ContentFile(b"abc", name="a.txt")) != of(ContentFile(b"abc", name="b.txt"))
    assert of(ContentFile(b"abc")) != of(ContentFile(b"abc", name="None"))
    # Text content is its UTF-8 bytes.
    assert of(ContentFile("é", name="a.txt")) == of(ContentFile("é".encode(), name="a.txt"))


def test_a_file_is_rewound_after_it_is_read_for_its_fingerprint() -> None:
    from django.core.files.base import ContentFile

    file = ContentFile(b"x" * 200_000, name="big.bin")
    file.read(10)  # wherever the parser left it
    first = fingerprint(file)

    assert file.read() == b"x" * 200_000
    assert fingerprint(file) == first  # read whole again, from the start


def test_a_file_that_cannot_be_rewound_has_no_fingerprint() -> None:
    """Reading it would take its content from the view."""
    from django.core.files.base import File

    from django_idempotency.fingerprint import NonCanonicalValue

    class Pipe(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return False

    with pytest.raises(NonCanonicalValue, match="cannot be read twice"):
        fingerprint(File(cast(IO[bytes], Pipe()), name="pipe"))


class _ReadOnly:
    """A stream with read() alone: no seek(), no seekable(), no closed."""

    def read(self, size: int = -1) -> bytes:
        return b""


@pytest.mark.parametrize(
    "stream",
    [
        # A parser handing on the stream DRF gives it: the request itself.
        lambda: RequestFactory().post("/", b"abc", content_type="application/octet-stream"),
        _ReadOnly,
    ],
    ids=["the-request-stream", "read-only"],
)
def test_a_file_over_a_stream_that_is_no_full_file_object_has_no_fingerprint(
    stream: Callable[[], Any],
) -> None:
    """Django's File asks the stream for ``closed``, which neither has: an AttributeError, a 500."""
    from django.core.files.base import File

    from django_idempotency.fingerprint import NonCanonicalValue

    with pytest.raises(NonCanonicalValue, match="cannot be read twice"):
        fingerprint(File(stream(), name="upload"))


def test_dates_times_and_uuids_are_their_exact_text_tagged_with_their_type() -> None:
    import datetime
    import uuid

    moment = datetime.datetime(2026, 3, 1, 12, 30, 0, 5, tzinfo=datetime.UTC)
    ref = uuid.UUID("5f1c2d1e-0000-4000-8000-000000000001")

    assert canonical({"at": moment, "ref": ref}) == (
        b'{"at":datetime("2026-03-01T12:30:00.000005+00:00"),'
        b'"ref":uuid("5f1c2d1e-0000-4000-8000-000000000001")}'
    )
    assert canonical(moment.date()) == b'date("2026-03-01")'
    assert canonical(moment.timetz()) == b'time("12:30:00.000005+00:00")'
    # Never the string a client could spell.
    assert canonical(moment) != canonical(moment.isoformat())
    assert fingerprint(moment) != fingerprint(moment.replace(microsecond=6))


@pytest.mark.django_db(transaction=True)
def test_a_file_a_drf_parser_delivers_without_a_name_is_fingerprinted(api: APIClient) -> None:
    """Weblate's upload parser: a ContentFile in request.FILES; the view still reads it."""
    from tests.testapp.models import Charge

    def upload(content: bytes, key: str) -> Any:
        return api.post(
            "/parsed/upload",
            content,
            content_type="application/octet-stream",
            HTTP_IDEMPOTENCY_KEY=key,
        )

    first = upload(b"translation file", "upload-1")
    retry = upload(b"translation file", "upload-1")
    changed = upload(b"another file", "upload-1")

    assert first.status_code == 201, first.content[:300]
    assert first.json()["size"] == len(b"translation file")
    assert retry["Idempotent-Replayed"] == "true"
    assert changed.status_code == 422
    assert Charge.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_dates_and_uuids_a_drf_parser_delivers_are_fingerprinted(api: APIClient) -> None:
    def send(body: bytes) -> Any:
        return api.post(
            "/parsed/upload", body, content_type="application/x-dated", HTTP_IDEMPOTENCY_KEY="d-1"
        )

    ref = b" 5f1c2d1e-0000-4000-8000-000000000001"
    first = send(b"2026-03-01 12:30:00+00:00" + ref)
    retry = send(b"2026-03-01 12:30:00+00:00" + ref)
    other = send(b"2026-03-01 12:30:01+00:00" + ref)

    assert first.status_code == 201, first.content[:300]
    assert retry["Idempotent-Replayed"] == "true"
    assert other.status_code == 422


@pytest.mark.django_db(transaction=True)
def test_a_value_a_drf_parser_delivers_with_no_canonical_form_is_a_client_error(
    api: APIClient, caplog: pytest.LogCaptureFixture
) -> None:
    from django_idempotency.models import IdempotencyRecord
    from tests.testapp.models import Charge

    response = api.post(
        "/parsed/upload", b"?", content_type="application/x-opaque", HTTP_IDEMPOTENCY_KEY="o-1"
    )

    assert response.status_code == 400, response.content[:300]
    assert response.json()["code"] == "parse_error"
    assert "Opaque" in response.json()["detail"]
    assert not IdempotencyRecord.objects.exists()
    assert Charge.objects.count() == 0
    # The operators learn which view needs a fingerprint= of its own.
    assert "fingerprint=" in caplog.text
