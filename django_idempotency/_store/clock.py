"""Points in time ahead of now (lease ends, retention ends, retry-after times).

``wall_clock`` and ``to_the_second`` show one to operators, under either
setting of ``USE_TZ``.

With ``USE_TZ=False`` Django's ``timezone.now()`` is the naive wall-clock
time of ``TIME_ZONE``, and naive arithmetic does not know about daylight
saving. A two-minute lease taken a minute before clocks spring forward
would end, by the wall clock, 58 minutes before it began: the next request
takes the claim over and runs the view a second time. So a moment ahead is
the later of the wall clock plus the duration and the real instant that
far ahead, read on the wall clock. Across a spring-forward change that is
the real instant; across a fall-back change (the wall clock repeats an
hour) it is the wall-clock sum, up to an hour late: a lease or a retention
that lasts longer than asked, never shorter. With ``USE_TZ=True`` (aware
UTC) there is nothing to correct.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.utils import dateformat, timezone


def ahead(duration: timedelta, *, now: datetime | None = None) -> datetime:
    """``now`` (default: the current time) plus ``duration``, never sooner in real time."""
    start = timezone.now() if now is None else now
    if settings.USE_TZ or timezone.is_aware(start):
        return start + duration
    real = timezone.make_naive(datetime.now(UTC) + duration, timezone.get_default_timezone())
    return max(start + duration, real)


def wall_clock(moment: datetime) -> datetime:
    """``moment`` on the wall clock of the current time zone.

    Under ``USE_TZ=False`` a stored time is already that (naive, in
    ``TIME_ZONE``), and ``timezone.localtime()`` refuses it.
    """
    return timezone.localtime(moment) if timezone.is_aware(moment) else moment


def to_the_second(moment: datetime) -> str:
    """``moment`` for operators: to the second (leases are that short), time zone named."""
    # A naive time's "T" is TIME_ZONE's abbreviation, which is what it is in.
    return dateformat.format(wall_clock(moment), "Y-m-d H:i:s T")
