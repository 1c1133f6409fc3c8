"""Fingerprints: property tests of the SPEC's definition."""

from __future__ import annotations

import json
import random
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory

from django_idempotency.fingerprint import (
    canonical,
    fingerprint,
    request_fingerprint,
    select_fields,
)

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


def parsed_request_fingerprint(raw: str) -> str:
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

    def of(**headers: str) -> str:
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
