from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = [
    "add_database_argument",
    "non_negative_float",
    "positive_float",
    "positive_int",
]


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number greater than 0."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not greater than 0")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not at least 0")
    return value


def _records_database(text: str) -> str:
    from django_idempotency._store.routing import UnknownRecordDatabase, records_database_named

    try:
        records_database_named(text)
    except UnknownRecordDatabase as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_database_argument(parser: Any) -> None:
    """``--database ALIAS``: only that records database (default: every one)."""
    parser.add_argument(
        "--database",
        type=_records_database,
        default=None,
        help="only this database alias (default: every database that holds records)",
    )
