"""What the system-check modules share: the id format and the tests of a value.

The checks themselves live beside what they guard (``_store/checks.py``,
``_protection/checks.py``, ``_observability/checks.py``,
``_view_checks.py``); ``checks.py`` registers them. Imported only by those
modules. Private.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

from django.core.checks import CheckMessage, Error

from django_idempotency.conf import as_timedelta

#: Checks one setting's value (as given, or its default).
Validator = Callable[[Any], Iterator[CheckMessage]]
#: Checks what several settings (or Django's own) say together.
ConfigurationCheck = Callable[[Mapping[str, Any]], Iterator[CheckMessage]]

#: An RFC 9110 token: what a header name may be.
HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def error(id_: int, msg: str, hint: str) -> Error:
    return Error(msg, hint=hint, id=f"django_idempotency.E{id_:03d}")


def is_duration(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or isinstance(
        value, timedelta
    )


def positive_duration(value: Any) -> bool:
    return is_duration(value) and as_timedelta(value) > timedelta(0)


def is_count(value: Any, *, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
