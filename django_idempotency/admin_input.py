"""What the admin accepts from a URL or a form it did not write itself.

The admin's own pages only send back values they showed; anything else was
made by hand. Each such value is checked here before it reaches a query, so
that it is refused (400) or skipped, never turned into a database error (a
500): PostgreSQL refuses NUL in text, the fencing token column is a 64-bit
integer, and Python's ``int()`` reads any Unicode digits ("١٢٣" is 123) and
refuses strings of more than 4,300.
"""

from __future__ import annotations

from datetime import MAXYEAR, MINYEAR, date

from django.http import QueryDict

from django_idempotency.models import IdempotencyRecord

__all__ = [
    "MAX_BIGINT",
    "ascii_integer",
    "date_drilldown_allowed",
    "record_state",
    "storable",
]

#: PositiveBigIntegerField's range on every backend: 0 to 2**63 - 1.
MAX_BIGINT = 2**63 - 1
_DATE_PARTS = ("year", "month", "day")


def ascii_integer(text: str, *, maximum: int = MAX_BIGINT) -> int | None:
    """``text`` as an integer from 0 to ``maximum``, if it is spelled in ASCII digits."""
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(maximum)):
        return None
    number = int(text)
    return number if number <= maximum else None


def record_state(text: str) -> str | None:
    return text if text in IdempotencyRecord.State.values else None


def storable(text: str, max_length: int) -> bool:
    """Whether a column of ``max_length`` characters could hold ``text`` on every backend."""
    return "\x00" not in text and len(text) <= max_length


def date_drilldown_allowed(field: str, lookup: str, query: QueryDict) -> bool:
    """Whether ``lookup`` is part of a date the date hierarchy itself links to.

    Its links are a year, a year and month, or a year, month and day, each
    given once. Django turns them into a range from that date to the next
    year, month or day, so the year stays strictly between the first and
    the last one ``datetime`` has (the next one must exist, and a time zone
    shift must not leave the calendar).
    """
    names = [f"{field}__{part}" for part in _DATE_PARTS]
    if lookup not in names:
        return False
    given: list[int] = []
    for name in names:
        values = query.getlist(name)
        if not values:
            break
        number = ascii_integer(values[0], maximum=MAXYEAR) if len(values) == 1 else None
        if number is None:
            return False
        given.append(number)
    if any(name in query for name in names[len(given) :]):
        return False  # a month without its year, a day without its month
    year, month, day = (*given, 1, 1)[:3]
    if not MINYEAR < year < MAXYEAR:
        return False
    try:
        date(year, month, day)
    except ValueError:
        return False
    return True
