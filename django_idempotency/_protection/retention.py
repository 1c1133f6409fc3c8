"""``ADVERTISE_RETENTION``: protected responses say how long their outcome is kept.

With ``IDEMPOTENCY["ADVERTISE_RETENTION"] = True`` a response whose outcome
is stored, a first execution's or a replay's, carries
``Idempotency-Key-Expires-In: <seconds>``: for how many more seconds, counted
from this response, a retry with the same key and input is answered with
this outcome. Responses whose outcome is not stored (released: a 5xx, a
408, 409, 423, 425 or 429; an unprotected run under ``FAIL_OPEN``) and refusals
carry none, since a retry runs anew.

Why a relative number of seconds, not a date: the record's ``expires_at``
is on the database's clock, which neither the app server nor the client
shares, and on a first execution it is set by the completion's own
statement (reading it back would cost a query). A duration is what both
sides can use without trusting each other's clock, as ``Retry-After`` and
``Cache-Control: max-age`` are; a client counts it from when it sent the
request, which errs on the safe side. The value is an RFC 9651 Integer,
rounded down:

- on a first execution, the retention of the operation (``ttl=`` or
  ``TTL``): the completion has just set ``expires_at`` to the database's
  time plus that (never shortening one an operator extended);
- on a replay, ``expires_at`` less the database's time of the lookup that
  found the record (``IdempotencyRecord.read_at``): what is left, with no
  extra query.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from django_idempotency._store.database_time import time_left
from django_idempotency.conf import idempotency_settings
from django_idempotency.responses import REPLAYED_HEADER, RETENTION_HEADER

if TYPE_CHECKING:
    from django.http import HttpResponseBase

    from django_idempotency.models import IdempotencyRecord

R = TypeVar("R", bound="HttpResponseBase")


def advertise_first_execution(
    response: HttpResponseBase, retention: timedelta, *, stored: bool
) -> None:
    """Put the header on a first execution whose outcome was ``stored``; else leave it.

    ``stored``: the request's own outcome was written (the outcome's
    ``stored_state``), whatever decided which answers are stored.
    """
    if not idempotency_settings.ADVERTISE_RETENTION or REPLAYED_HEADER in response:
        return
    if stored:
        response[RETENTION_HEADER] = str(_whole_seconds(retention))


def advertise_replay(response: R, record: IdempotencyRecord) -> R:
    """``response``, the replay of ``record``, with the header: the seconds it has left."""
    if idempotency_settings.ADVERTISE_RETENTION:
        response[RETENTION_HEADER] = str(seconds_left(record))
    return response


def seconds_left(record: IdempotencyRecord) -> int:
    """Whole seconds from the lookup that read ``record`` to its ``expires_at`` (0 if past).

    Judged at ``record.read_at``, the database's time of that lookup; on
    a database whose clock is this host's (SQLite), this host's time.
    """
    return _whole_seconds(time_left(record, record.expires_at))


def _whole_seconds(duration: timedelta) -> int:
    return max(0, math.floor(duration.total_seconds()))
