"""Fuzzing the HTTP surface: whatever a client sends, the layer answers sanely.

Generated requests go through Django's test clients (the async view through
Django's ASGI handler) to protected views of every kind: robust echo views
(``tests/fuzzing.py``) and the test app's own views. Properties:

- never a 5xx from the layer (an exception raised by a test app view's own
  code, on garbage it was not built for, is that view's business);
- only documented answers: the view's own, 400 ``idempotency_key_missing`` /
  ``idempotency_key_invalid`` / ``parse_error``, DRF's 400 parse error and 415
  unsupported media type, 422 ``idempotency_key_reused``, replays;
- a refused request changes no record (the records table is compared, field
  by field, before and after) and runs no view;
- never a replay of another request's response: every request carries a
  unique marker the echo views return; a replay carries the marker (the
  exact bytes) of the request that created the record, a fresh execution
  its own.

The suite runs a fixed (derandomized) set of examples; ``scripts/fuzz.py``
runs the same tests with many more, random ones.
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import pytest
from django.http import RawPostDataException
from django.test.client import BOUNDARY, MULTIPART_CONTENT, encode_multipart
from hypothesis import example, given
from hypothesis import strategies as st

from django_idempotency.models import IdempotencyRecord
from tests import fuzzing
from tests.fuzzing import (
    ALL_TARGETS,
    ECHO_API_VIEW,
    ECHO_TARGETS,
    ECHO_VIEWSET,
    RELEASED,
    STATUS,
    Seen,
    Sent,
    Target,
    expected_key,
    records,
    refused_before_view,
    rolled_back,
    send,
    spellings,
    view_owned_failure,
)
from tests.testapp.models import Charge
from tests.utils import raw_body

pytestmark = [pytest.mark.django_db, pytest.mark.urls("tests.fuzzing")]
State = IdempotencyRecord.State
TARGETS_BY_NAME = {target.name: target for target in ALL_TARGETS}


@pytest.fixture(autouse=True, scope="module")
def _summary(request: pytest.FixtureRequest) -> None:
    fuzzing.install_summary(request.config)


def check_common(test: str, sent: Sent, seen: Seen) -> None:
    """What holds for every answer, whatever was sent."""
    fuzzing.note(test, seen)
    assert "UNEXPECTED" not in seen.label, (seen.label, seen.content[:300])
    if seen.status >= 500:
        assert view_owned_failure(seen), (seen.label, seen.content[:300])
    if sent.target.echo and seen.marker is not None and not seen.replayed:
        assert seen.marker == sent.marker, "a fresh answer carries another request's marker"
    if seen.refused_by_layer:
        assert set(seen.body) == {"detail", "code"}, seen.body


def new_records(before: list[tuple[Any, ...]]) -> list[IdempotencyRecord]:
    seen = {row[0] for row in before}
    return list(IdempotencyRecord.objects.exclude(pk__in=seen).order_by("pk"))


def _latin1(text: str) -> bool:
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def assert_stored(record: IdempotencyRecord, key: str, seen: Seen) -> None:
    assert record.key == key
    assert record.state == (State.COMPLETED if seen.status < 400 else State.FAILED)
    assert record.response_status == seen.status
    assert raw_body(record) == seen.content


# --- the Idempotency-Key header -------------------------------------------------------


@fuzzing.fuzz_settings(in_suite=150)
@given(
    raw=fuzzing.key_headers(),
    target_name=st.sampled_from(sorted(TARGETS_BY_NAME)),
    method=st.sampled_from(["POST"] * 7 + ["GET"]),
    spelling=st.integers(0, 5),
)
@example(raw="k1, k2", target_name="echo-api-view", method="POST", spelling=0)
@example(raw="k1,k2", target_name="echo-plain", method="POST", spelling=0)
@example(raw='"k1", "k2"', target_name="echo-viewset", method="POST", spelling=0)
@example(raw='"a,b"', target_name="echo-async", method="POST", spelling=1)
@example(raw='"a b"', target_name="echo-api-view", method="POST", spelling=0)
@example(raw="x" * 255, target_name="echo-api-view", method="POST", spelling=3)
@example(raw="x" * 256, target_name="echo-api-view", method="POST", spelling=0)
@example(raw=fuzzing.quoted("y" * 255), target_name="app-viewset", method="POST", spelling=4)
@example(raw="z" * 10_000, target_name="app-plain", method="POST", spelling=0)
@example(raw="", target_name="app-api-view", method="POST", spelling=0)
@example(raw='""', target_name="echo-viewset", method="POST", spelling=0)
@example(raw=None, target_name="app-async", method="POST", spelling=0)
@example(raw=None, target_name="echo-viewset", method="POST", spelling=0)
@example(raw=None, target_name="echo-plain", method="POST", spelling=0)
@example(raw="k\x00", target_name="echo-plain", method="POST", spelling=0)
@example(raw="cl\u00e9", target_name="echo-async", method="POST", spelling=0)
@example(raw="\t padded \t", target_name="echo-viewset", method="POST", spelling=2)
@example(raw='"q";p=1', target_name="echo-api-view", method="POST", spelling=0)
@example(raw="k1, k2", target_name="echo-api-view", method="GET", spelling=0)
def test_key_header_values(raw: str | None, target_name: str, method: str, spelling: int) -> None:
    """Any header value: the documented refusal, or a run whose retries replay it."""
    test = "hostile keys"
    fuzzing.note_input(test, fuzzing.key_kind(raw))
    target = TARGETS_BY_NAME[target_name]
    if target.kind == "async" and raw is not None and not _latin1(raw):
        # Nothing but latin-1 reaches an ASGI app (headers are bytes).
        target = ECHO_API_VIEW
    if method == "GET" and target not in (ECHO_API_VIEW, TARGETS_BY_NAME["app-api-view"]):
        method = "POST"
    sent = Sent(target, method, body=b'{"amount": 7}', key=raw)
    with rolled_back():
        before, charges = records(), Charge.objects.count()
        first = send(sent)
        check_common(test, sent, first)
        if method == "GET":
            # Never protected: the key, however hostile, is ignored.
            assert first.status == 200 and not first.replayed
            assert records() == before
            return
        key = None if raw is None else expected_key(raw)
        if key is None:
            code = "idempotency_key_missing" if raw is None else "idempotency_key_invalid"
            assert first.label == f"400 {code}", (raw[:80] if raw else raw, first.label)
            assert "Idempotency-Key" not in first.headers
            assert records() == before
            assert Charge.objects.count() == charges
            return
        assert first.status == 201 and not first.replayed, (raw[:80] if raw else raw, first.label)
        assert first.headers["Idempotency-Key"] == raw
        (record,) = new_records(before)
        assert_stored(record, key, first)
        after = records()

        # The same key, spelled another way (quoted, bare, padded): one record.
        forms = spellings(key)
        retry_sent = sent.again(key=forms[spelling % len(forms)])
        retry = send(retry_sent)
        check_common(test, retry_sent, retry)
        assert retry.replayed and retry.status == first.status
        assert retry.content == first.content
        assert records() == after


# --- bodies, content types, methods, query strings --------------------------------------

STATUSES = st.sampled_from([201] * 8 + [200, 202, 400, 402, 404, 422, 408, 429, 500, 503])
QUERIES = st.sampled_from(["", "", "a=1", "a=1&a=2", "q=%ff%fe", "%zz=&&=", "e=%C3%A9"])


def _method_and_target(target: Target, choice: int) -> tuple[str, Target]:
    """Other unsafe methods on the targets that have them."""
    if target is ECHO_API_VIEW:
        return ["POST", "POST", "PUT", "PATCH", "DELETE"][choice % 5], target
    if target is ECHO_VIEWSET and choice % 3 == 1:
        return "PUT", Target(
            "echo-viewset", "/fuzz/viewset/1", "drf", True, "PUT fuzz/viewset/<pk>"
        )
    return "POST", target


@fuzzing.fuzz_settings(in_suite=200)
@given(
    body=fuzzing.bodies(),
    target_name=st.sampled_from(sorted(TARGETS_BY_NAME)),
    status=STATUSES,
    query=QUERIES,
    method_choice=st.integers(0, 5),
)
def test_hostile_bodies(
    body: tuple[bytes, str, str],
    target_name: str,
    status: int,
    query: str,
    method_choice: int,
) -> None:
    """A body sent, sent again, and sent again with another input."""
    test = "hostile bodies"
    content, content_type, kind = body
    fuzzing.note_input(test, kind)
    method, target = _method_and_target(TARGETS_BY_NAME[target_name], method_choice)
    sent = Sent(
        target,
        method,
        body=content,
        content_type=content_type,
        key=f"fuzz-{uuid.uuid4().hex}",
        query=query,
        headers={STATUS: str(status)},
    )
    with rolled_back():
        before = records()
        first = send(sent)
        check_common(test, sent, first)
        after = records()
        stored = False
        if refused_before_view(first):
            assert after == before, first.label
            assert first.marker is None
        elif first.raised is not None or first.status in RELEASED or first.status >= 500:
            assert after == before, first.label  # released: nothing stored
        else:
            (record,) = new_records(before)
            assert_stored(record, sent.key or "", first)
            stored = True

        # The identical request again (the header and marker aside).
        second_sent = sent.again(headers={STATUS: "201"})
        second = send(second_sent)
        check_common(test, second_sent, second)
        if stored:
            assert second.replayed, second.label
            assert (second.status, second.content) == (first.status, first.content)
            assert second.headers.get("Content-Type") == first.headers.get("Content-Type")
            assert second.headers.get("Location") == first.headers.get("Location")
            assert records() == after
        elif refused_before_view(first):
            assert second.label == first.label
            assert records() == after
        else:
            assert not second.replayed

        # Another input under the same key: refused, unless nothing was stored.
        third_sent = sent.again(query=f"{query}&fuzz-variant=1".lstrip("&"))
        third = send(third_sent)
        check_common(test, third_sent, third)
        if stored:
            assert third.label == "422 idempotency_key_reused", third.label
            assert records() == after


# --- JSON spelled differently is one request; any changed value is another ---------------


@fuzzing.fuzz_settings(in_suite=80)
@given(
    value=fuzzing.json_objects,
    target=st.sampled_from(ECHO_TARGETS),
    seeds=st.tuples(st.integers(), st.integers(), st.integers()),
)
def test_respelled_json_replays_and_changed_json_is_refused(
    value: dict[str, object], target: Target, seeds: tuple[int, int, int]
) -> None:
    test = "json spellings"
    fuzzing.note_input(test)
    first_text = fuzzing.spell(value, random.Random(seeds[0]))
    respelled = fuzzing.spell(value, random.Random(seeds[1]))
    changed = fuzzing.mutate(value, random.Random(seeds[2]))
    assert json.loads(first_text) == json.loads(respelled)
    sent = Sent(target, body=first_text.encode(), key=f"fuzz-{uuid.uuid4().hex}")
    with rolled_back():
        first = send(sent)
        check_common(test, sent, first)
        assert first.label == "201 view"
        after = records()

        again_sent = sent.again(body=respelled.encode())
        again = send(again_sent)
        check_common(test, again_sent, again)
        assert again.replayed and again.content == first.content
        assert again.marker == sent.marker

        other_sent = sent.again(body=fuzzing.spell(changed, random.Random(seeds[0])).encode())
        other = send(other_sent)
        check_common(test, other_sent, other)
        assert other.label == "422 idempotency_key_reused", (value, changed)
        assert records() == after


# --- spot checks beyond what the generators reach cheaply ---------------------------------


@pytest.mark.parametrize("target", ALL_TARGETS, ids=lambda target: target.name)
def test_a_body_beyond_the_fingerprinted_limit(target: Target) -> None:
    """3 MB (over MAX_FINGERPRINTED_BODY, 2.5 MB by default): 413, nothing stored."""
    big = json.dumps({"amount": 1, "note": "x" * 3_000_000}).encode()
    sent = Sent(target, body=big, key=f"fuzz-{uuid.uuid4().hex}")
    before, charges = records(), Charge.objects.count()
    seen = send(sent)
    check_common("spot checks", sent, seen)
    assert seen.label == "413 idempotency_body_too_large"
    assert records() == before and Charge.objects.count() == charges


@pytest.mark.parametrize("target", [TARGETS_BY_NAME["app-plain"], TARGETS_BY_NAME["app-async"]])
def test_a_plain_view_can_read_a_multipart_body(target: Target) -> None:
    body = encode_multipart(BOUNDARY, {"amount": "3"})
    sent = Sent(target, body=body, content_type=MULTIPART_CONTENT, key="multipart")
    # The test app's plain views read request.body; a form body is not JSON,
    # so the view itself would answer 500 with JSONDecodeError, not
    # RawPostDataException, if it could read the body at all.
    seen = send(sent)
    assert not isinstance(seen.raised, RawPostDataException)


# --- messages that say what happened -------------------------------------------------------

APP_URLS = pytest.mark.urls("tests.testapp.urls")


@APP_URLS
@pytest.mark.parametrize(
    ("url", "body", "words"),
    [
        ("/api-view/charges", '{"amount": 1e999}', "no finite value"),
        ("/plain/charges", '{"amount": [-1e999]}', "no finite value"),
        # DRF's JSON parser gives up on these (RecursionError) inside request.data.
        ("/api-view/charges", "[" * 5000 + "]" * 5000, "nested too deeply"),
        ("/api-view/charges", '{"a":' * 3000 + "1" + "}" * 3000, "nested too deeply"),
    ],
    ids=["drf-1e999", "plain-1e999", "deep-list", "deep-object"],
)
def test_an_unreadable_body_is_refused_with_its_own_cause(url: str, body: str, words: str) -> None:
    from rest_framework.test import APIClient

    response = APIClient().post(
        url, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k"
    )

    assert response.status_code == 400, response.content[:300]
    assert response.json()["code"] == "parse_error"
    assert words in response.json()["detail"], response.json()
    assert records() == []


@APP_URLS
def test_a_record_no_key_decrypts_says_why_it_cannot_be_replayed(settings: object) -> None:
    from cryptography.fernet import Fernet
    from rest_framework.test import APIClient

    api = APIClient()
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [old]}  # type: ignore[attr-defined]
    api.post("/api-view/charges", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="k")
    settings.IDEMPOTENCY = {"ENCRYPTION_KEYS": [new]}  # type: ignore[attr-defined]

    retry = api.post("/api-view/charges", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="k")

    assert retry.status_code == 503
    assert retry.json()["code"] == "idempotency_store_unavailable"
    detail = retry.json()["detail"]
    assert "could not be stored" not in detail
    assert "cannot be read" in detail and "encryption key" in detail


@APP_URLS
@pytest.mark.parametrize("raw", ['"k1, k2"', '"k1,k2"', "k1, k2"])
def test_two_header_lines_joined_into_one_quoted_string_are_refused(raw: str) -> None:
    from rest_framework.test import APIClient

    response = APIClient().post(
        "/api-view/charges", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY=raw
    )

    assert response.status_code == 400
    assert response.json()["code"] == "idempotency_key_invalid"
    assert "comma" in response.json()["detail"]
    assert records() == []
