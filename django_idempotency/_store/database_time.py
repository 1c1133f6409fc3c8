"""The time every lease and retention decision is judged by: the database's.

App servers' clocks drift. A host whose clock runs ten minutes ahead would
find a two-minute lease long over and take over a record whose owner is
still at work: the view would run twice. One clock decides instead, the
one that holds the records: every lease end, retention end and "has it run
out?" is computed inside the statement that writes or reads it.

- PostgreSQL: ``STATEMENT_TIMESTAMP()``, the time the statement began, as
  Django's ``Now()`` compiles to. Never ``now()``/``CURRENT_TIMESTAMP``:
  that is the time the *transaction* began, and the completion, the
  optimistic mode's one write and a caller's transaction all run late
  inside long transactions. Durations are added with ``make_interval(secs => ...)``,
  an exact number of seconds (an interval of days would follow the
  session's time zone across daylight saving). The columns are
  ``timestamptz``, so this holds under either ``USE_TZ``.
- MySQL/MariaDB with ``USE_TZ=True``: ``UTC_TIMESTAMP(6)``, since Django
  stores naive UTC there and sets no connection time zone (``NOW()`` is the
  server's local time).
- MySQL/MariaDB storing another zone's times (``USE_TZ=False`` with a
  ``TIME_ZONE`` other than UTC, or ``DATABASES[alias]["TIME_ZONE"]``):
  values are naive wall-clock times the server cannot produce without its
  time zone tables; the host's clock is used, and check
  ``django_idempotency.W007`` says so.
- SQLite: the file lives on one host, and its clock is that host's.

Where Python itself must judge a record (a looked-up record's retention, an
abandoned claim), the lookup returns the database's time beside the row
(``IdempotencyRecord.read_at``), so no query is added. It judges instants,
as the database does (``instant``, ``time_left``): on PostgreSQL under
``USE_TZ=False`` the times arrive as naive wall times of ``TIME_ZONE``,
which a daylight-saving change repeats or skips.
"""

from __future__ import annotations

import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import DateTimeField, Func, QuerySet, Value
from django.db.models.sql.compiler import SQLCompiler
from django.utils import timezone

from django_idempotency._store.clock import ahead

if TYPE_CHECKING:
    from django_idempotency.models import IdempotencyRecord


def uses_host_clock(connection: BaseDatabaseWrapper) -> bool:
    """Whether times for ``connection`` come from this host's clock, not the server's."""
    if connection.vendor == "postgresql":
        return False
    if connection.vendor == "mysql":
        # Django stores naive times of the connection's zone there: UTC unless
        # USE_TZ=False or DATABASES[alias]["TIME_ZONE"] names another zone.
        return connection.timezone_name != "UTC"
    return True


@dataclass(frozen=True)
class DatabaseClock:
    """The current time, and a time ahead of it, as SQL for one connection.

    On a host clock both are placeholders for values computed here.
    """

    #: SQL for the current time.
    now: str
    #: SQL for the current time plus one duration parameter.
    later: str
    host: bool

    def now_params(self, connection: BaseDatabaseWrapper) -> list[Any]:
        if not self.host:
            return []
        return [connection.ops.adapt_datetimefield_value(timezone.now())]

    def later_params(self, connection: BaseDatabaseWrapper, duration: timedelta) -> list[Any]:
        if self.host:
            return [connection.ops.adapt_datetimefield_value(ahead(duration))]
        if connection.vendor == "postgresql":
            return [duration.total_seconds()]
        return [_microseconds(duration)]


_POSTGRESQL = DatabaseClock(
    now="STATEMENT_TIMESTAMP()",
    later="(STATEMENT_TIMESTAMP() + make_interval(secs => %s))",
    host=False,
)
_MYSQL_UTC = DatabaseClock(
    now="UTC_TIMESTAMP(6)", later="(UTC_TIMESTAMP(6) + INTERVAL %s MICROSECOND)", host=False
)
_HOST = DatabaseClock(now="%s", later="%s", host=True)


def clock_of(connection: BaseDatabaseWrapper) -> DatabaseClock:
    if uses_host_clock(connection):
        return _HOST
    return _POSTGRESQL if connection.vendor == "postgresql" else _MYSQL_UTC


def _microseconds(duration: timedelta) -> int:
    return (duration.days * 86_400 + duration.seconds) * 1_000_000 + duration.microseconds


class DatabaseNow(Func):
    """The records database's current time, in a query or an update."""

    output_field = DateTimeField()

    def as_sql(  # type: ignore[override]
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra_context: Any
    ) -> tuple[str, Any]:
        clock = clock_of(connection)
        if clock.host:
            return compiler.compile(Value(timezone.now(), output_field=DateTimeField()))
        return clock.now, []


class DatabaseLater(Func):
    """The records database's current time plus ``duration``."""

    output_field = DateTimeField()

    def __init__(self, duration: timedelta) -> None:
        super().__init__()
        self.duration = duration

    def as_sql(  # type: ignore[override]
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra_context: Any
    ) -> tuple[str, Any]:
        clock = clock_of(connection)
        if clock.host:
            return compiler.compile(Value(ahead(self.duration), output_field=DateTimeField()))
        return clock.later, clock.later_params(connection, self.duration)


def with_read_time(records: QuerySet[Any], name: str = "read_at") -> QuerySet[Any]:
    """``records``, each read with the database's time of the read as ``name``.

    On a host clock nothing is added (a parameter of ours would come back
    untyped, a string on MySQL): the caller reads this host's time instead.
    """
    if clock_of(connections[records.db]).host:
        return records
    annotated: QuerySet[Any] = records.annotate(**{name: DatabaseNow()})
    return annotated


def database_now(using: str) -> datetime:
    """The records database's current time, read with one query (none on a host clock).

    For what is shown to operators or computed once per action; decisions
    on the hot path put ``DatabaseNow()`` in their own statement instead.
    """
    return _read_time(using, timedelta(0))


def database_later(using: str, duration: timedelta) -> datetime:
    """The records database's current time plus ``duration``, as ``database_now``."""
    return _read_time(using, duration)


def _read_time(using: str, duration: timedelta) -> datetime:
    connection = connections[using]
    clock = clock_of(connection)
    if clock.host:
        return ahead(duration)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {clock.later}", clock.later_params(connection, duration))
        value = cursor.fetchone()[0]
    field = DateTimeField()
    for convert in connection.ops.get_db_converters(Value(value, output_field=field)):
        value = convert(value, None, connection)
    if settings.USE_TZ and timezone.is_naive(value):
        value = timezone.make_aware(value, UTC)
    return value  # type: ignore[no-any-return]


def instant(value: datetime, using: str) -> datetime:
    """``value``, a time read from database ``using``, as an instant Python compares exactly.

    PostgreSQL keeps instants (``timestamptz``), and judges them so in SQL.
    Under ``USE_TZ=False`` Django hands them over as naive wall times of
    ``TIME_ZONE``: the hour a daylight-saving change repeats has each wall
    time twice (the second marked ``fold=1``, which Python's comparisons of
    naive times ignore), and the hour it skips makes a difference an hour
    too long. Those come back as UTC, their fold honoured. Everything else
    is returned as it is: aware times, and the naive ones of SQLite and
    MySQL, whose columns hold wall times, compared so by their SQL too.
    """
    if value.tzinfo is not None:
        return value
    connection = connections[using]
    if connection.vendor != "postgresql":
        return value
    return value.replace(tzinfo=zoneinfo.ZoneInfo(connection.timezone_name)).astimezone(UTC)


def time_left(record: IdempotencyRecord, until: datetime) -> timedelta:
    """From the database's time of the read that found ``record`` to ``until``, one of its times.

    Negative once ``until`` has passed. Judged at ``record.read_at``, this
    host's time where the database's clock is this host's.
    """
    using = record._state.db or "default"
    now = record.read_at if record.read_at is not None else timezone.now()
    return instant(until, using) - instant(now, using)


def shifted(value: datetime, duration: timedelta, using: str) -> datetime:
    """``value`` plus ``duration`` (exact seconds, as the database adds), as Django reads it."""
    moment = instant(value, using) + duration
    if moment.tzinfo is None or value.tzinfo is not None:
        return moment
    # A PostgreSQL wall time (USE_TZ=False): back to one, in TIME_ZONE.
    zone = zoneinfo.ZoneInfo(connections[using].timezone_name)
    return moment.astimezone(zone).replace(tzinfo=None)
