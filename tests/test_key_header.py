from __future__ import annotations

import pytest

from django_idempotency._protection.answers import refusal_detail
from django_idempotency._protection.keys import parse_key
from django_idempotency.exceptions import KeyInvalid


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("abc", "abc"),
        ("8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        ('"8e03978e-40d5"', "8e03978e-40d5"),
        ('"with\\"quote"', 'with"quote'),
        ("  padded  ", "padded"),
        ("!#$%&'()*+-./:;<=>?@[]^_`{|}~", "!#$%&'()*+-./:;<=>?@[]^_`{|}~"),
    ],
)
def test_valid_keys(raw: str, key: str) -> None:
    assert parse_key(raw, 255) == key


@pytest.mark.parametrize(
    "raw",
    [
        "",
        '""',
        "a b",
        "\x00",
        "é",
        '"a";param=1',
        '"open',
        '"a" trailing',
        "x" * 11,
        "k1,k2",
        "k1, k2",
        '"k1", "k2"',
        '"with,comma"',
        '"k1, k2"',
        '"k1,k2"',
    ],
)
def test_invalid_keys(raw: str) -> None:
    with pytest.raises(KeyInvalid) as refusal:
        parse_key(raw, 10)
    assert refusal.value.get_codes() == {
        "detail": "idempotency_key_invalid",
        "code": "idempotency_key_invalid",
    }


@pytest.mark.parametrize("raw", ["k1, k2", '"k1, k2"', '"with,comma"'])
def test_a_comma_is_refused_with_the_reason(raw: str) -> None:
    """Two header lines ``"k1`` and ``k2"`` reach Django joined: ``"k1, k2"``, one valid string."""
    with pytest.raises(KeyInvalid) as refusal:
        parse_key(raw, 255)
    assert isinstance(refusal.value.detail, dict)
    detail = str(refusal_detail(refusal.value))
    assert "comma" in detail
    assert "joins" in detail
