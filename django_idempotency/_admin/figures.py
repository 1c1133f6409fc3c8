"""What the admin's overview page shows, gathered in a few bounded queries: read-only.

Beside the census (``census.py``) of every records database, for one of
them:

- the records created per hour over the last ``HOURS`` hours, by final
  state. The hours are those of UTC, truncated by the database (from the
  database's clock: ``Census.taken_at``). The unresolved ones are counted
  exactly (few, and the recovery index leads with ``state``). The resolved
  ones are counted exactly when the planner expects at most
  ``EXACT_WINDOW_UP_TO`` records in the window (PostgreSQL reads them
  through the BRIN index on ``created_at``, migration 0007); beyond that a
  GROUP BY over the window would read most of the table (seconds at ten
  million records), so PostgreSQL counts a ``TABLESAMPLE SYSTEM`` sample of
  the table's pages and scales it up, and ``HourlyCounts.sample_percent``
  says so. MySQL, MariaDB and SQLite count the window exactly: no sampling
  clause there reads fewer pages;
- how long the unresolved records have been waiting, in ``AGE_BUCKETS``;
- the oldest unresolved records, a few, for their change pages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connections
from django.db.models import Count, Q, QuerySet
from django.db.models.functions import Trunc

from django_idempotency._store.routing import record_databases
from django_idempotency.census import Census, take_census
from django_idempotency.models import RESOLVED_STATES, UNRESOLVED_STATES, IdempotencyRecord

#: How many hours the hourly chart covers, the current (partial) hour last.
HOURS = 48
#: The series of the hourly chart: the resolved states, and all unresolved ones together.
UNRESOLVED = "UNRESOLVED"
SERIES = (*RESOLVED_STATES, UNRESOLVED)
#: Resolved records in the window are counted exactly up to about this many
#: (the planner's estimate); beyond it they are estimated from a sample.
EXACT_WINDOW_UP_TO = 200_000
#: About how many rows of the window a sample should hold: the hourly bars
#: then rest on about 3,000 rows each, a few percent of error.
SAMPLED_ROWS = 150_000
#: The sample never reads more than about this many rows of the table, however
#: small a share of it the window is (a long retention): a wider error, a
#: bounded time.
SAMPLE_READ_CAP = 1_000_000
#: (label, upper bound of the age) of the age histogram; None: older.
AGE_BUCKETS: tuple[tuple[str, timedelta | None], ...] = (
    ("< 1 min", timedelta(minutes=1)),
    ("< 5 min", timedelta(minutes=5)),
    ("< 1 h", timedelta(hours=1)),
    ("< 1 day", timedelta(days=1)),
    ("older", None),
)
#: How many of the oldest unresolved records the page lists.
OLDEST_SHOWN = 10


@dataclass(frozen=True)
class HourlyCounts:
    """Records created per hour, oldest hour first, per series (``SERIES``)."""

    #: The start of each hour (UTC; with ``USE_TZ = False`` the site's
    #: ``TIME_ZONE``, see ``chart_zone``); the last one is the current hour.
    hours: tuple[datetime, ...]
    #: Series -> a count per hour. Resolved series are estimates when sampled.
    counts: Mapping[str, tuple[int, ...]]
    #: The percentage of the table's pages the resolved counts were scaled up
    #: from; None: counted exactly.
    sample_percent: float | None = None

    def total(self, series: str) -> int:
        return sum(self.counts[series])


@dataclass(frozen=True)
class AgeCounts:
    """Unresolved records per age bucket (``AGE_BUCKETS``' labels, in order)."""

    labels: tuple[str, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class Overview:
    """Everything the overview page shows."""

    #: The database the charts and the list are about.
    database: str
    #: The census of every records database, in ``record_databases()`` order.
    censuses: Sequence[Census]
    hourly: HourlyCounts
    ages: AgeCounts
    oldest: Sequence[IdempotencyRecord]

    @property
    def census(self) -> Census:
        """The census of ``database``."""
        return next(census for census in self.censuses if census.database == self.database)


def overview_of(database: str) -> Overview:
    """The overview of the records databases, with ``database``'s charts and oldest records."""
    censuses = [take_census(alias) for alias in record_databases()]
    chosen = next((c for c in censuses if c.database == database), None) or take_census(database)
    if chosen not in censuses:
        censuses.append(chosen)
    now = chosen.taken_at
    return Overview(
        database=database,
        censuses=censuses,
        hourly=hourly_counts(database, now, resolved_at_most=_resolved_at_most(chosen)),
        ages=unresolved_ages(database, now),
        oldest=oldest_unresolved(database),
    )


def _resolved_at_most(census: Census) -> int | None:
    """The census's exact count of resolved records; None: estimated."""
    if census.estimated:
        return None
    return sum(census.counts[state] for state in RESOLVED_STATES)


def _hour_start(moment: datetime) -> datetime:
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.replace(minute=0, second=0, microsecond=0)


def hourly_counts(
    database: str, now: datetime, *, resolved_at_most: int | None = None
) -> HourlyCounts:
    """Records of ``database`` created per hour, the ``HOURS`` hours up to ``now`` (its clock).

    ``resolved_at_most``: how many resolved records the whole table holds, if
    known (the census's exact count), which spares asking the planner.
    """
    last = _hour_start(now)
    hours = tuple(last - timedelta(hours=back) for back in range(HOURS - 1, -1, -1))
    window = IdempotencyRecord.objects.using(database).filter(created_at__gte=hours[0])
    per_hour: dict[str, dict[datetime, int]] = {series: {} for series in SERIES}
    for hour, count in _per_hour(window.filter(state__in=UNRESOLVED_STATES)):
        per_hour[UNRESOLVED][hour] = per_hour[UNRESOLVED].get(hour, 0) + count
    resolved = window.filter(state__in=RESOLVED_STATES)
    small = resolved_at_most is not None and resolved_at_most <= EXACT_WINDOW_UP_TO
    percent = None if small else _sample_percent(resolved)
    for hour, state, count in _per_hour_and_state(resolved, percent):
        per_hour[state][hour] = count
    return HourlyCounts(
        hours=hours,
        counts={
            series: tuple(per_hour[series].get(hour, 0) for hour in hours) for series in SERIES
        },
        sample_percent=percent,
    )


def chart_zone() -> str:
    """The zone the chart's hours are in: UTC, or the site's with ``USE_TZ = False``.

    Without time zone support the records hold the site's wall-clock times
    and the database truncates those.
    """
    return "UTC" if settings.USE_TZ else settings.TIME_ZONE


def _truncated(records: QuerySet[IdempotencyRecord]) -> QuerySet[Any]:
    # Truncated by the database in the zone the column is stored in (UTC,
    # unless DATABASES[alias]["TIME_ZONE"] says otherwise on MySQL/MariaDB):
    # truncating in another zone would need CONVERT_TZ and the server's time
    # zone tables, which many servers lack (it answers NULL). The hours are
    # made UTC here (_normal).
    connection = connections[records.db]
    zone = connection.timezone if settings.USE_TZ and connection.vendor == "mysql" else UTC
    hour = Trunc("created_at", "hour", tzinfo=zone if settings.USE_TZ else None)
    return records.annotate(hour=hour).order_by()


def _normal(hour: datetime) -> datetime:
    if hour.tzinfo is not None:
        return hour.astimezone(UTC)
    # Read without the ORM's converters (the sample): truncated in UTC.
    return hour.replace(tzinfo=UTC) if settings.USE_TZ else hour


def _per_hour(records: QuerySet[IdempotencyRecord]) -> list[tuple[datetime, int]]:
    rows = _truncated(records).values("hour").annotate(count=Count("pk"))
    return [(_normal(row["hour"]), row["count"]) for row in rows]


def _per_hour_and_state(
    records: QuerySet[IdempotencyRecord], percent: float | None
) -> list[tuple[datetime, str, int]]:
    rows = _truncated(records).values("hour", "state").annotate(count=Count("pk"))
    if percent is None:
        return [(_normal(row["hour"]), row["state"], row["count"]) for row in rows]
    # Compiled for the records' database, not "default" (sql_with_params()).
    sql, params = rows.query.get_compiler(records.db).as_sql()
    table = connections[records.db].ops.quote_name(IdempotencyRecord._meta.db_table)
    assert sql.count(f"FROM {table}") == 1, sql
    # The ORM has no TABLESAMPLE; the percentage is a float of ours, not input.
    sampled = sql.replace(f"FROM {table}", f"FROM {table} TABLESAMPLE SYSTEM ({percent:.6f})")
    scale = 100 / percent
    with connections[records.db].cursor() as cursor:
        cursor.execute(sampled, params)
        names = [column[0] for column in cursor.description]
        found = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    return [(_normal(row["hour"]), row["state"], round(row["count"] * scale)) for row in found]


def _sample_percent(window: QuerySet[IdempotencyRecord]) -> float | None:
    """None to count ``window`` exactly; else the percentage of pages to sample."""
    connection = connections[window.db]
    if connection.vendor != "postgresql":
        return None
    expected = _planner_rows(window)
    if expected <= EXACT_WINDOW_UP_TO:
        return None
    share = SAMPLED_ROWS / expected
    table_rows = _table_rows(window.db)
    if table_rows > 0:
        share = min(share, SAMPLE_READ_CAP / table_rows)
    return max(min(share * 100, 100.0), 0.01)


def _planner_rows(records: QuerySet[IdempotencyRecord]) -> int:
    sql, params = records.order_by().values("pk").query.get_compiler(records.db).as_sql()
    with connections[records.db].cursor() as cursor:
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return int(plan[0]["Plan"]["Plan Rows"])


def _table_rows(database: str) -> int:
    """PostgreSQL's estimate of the table's rows (-1: never analysed)."""
    with connections[database].cursor() as cursor:
        cursor.execute(
            "SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)",
            [IdempotencyRecord._meta.db_table],
        )
        row = cursor.fetchone()
    return -1 if row is None or row[0] is None else int(row[0])


def unresolved_ages(database: str, now: datetime) -> AgeCounts:
    """Unresolved records of ``database`` by how long ago they were created (one query)."""
    buckets: dict[str, Any] = {}
    newer_than: datetime | None = None
    for index, (_, bound) in enumerate(AGE_BUCKETS):
        older = Q() if newer_than is None else Q(created_at__lte=newer_than)
        newer = Q() if bound is None else Q(created_at__gt=now - bound)
        buckets[f"bucket_{index}"] = Count("pk", filter=older & newer)
        newer_than = None if bound is None else now - bound
    found = (
        IdempotencyRecord.objects.using(database)
        .filter(state__in=UNRESOLVED_STATES)
        .aggregate(**buckets)
    )
    return AgeCounts(
        labels=tuple(label for label, _ in AGE_BUCKETS),
        counts=tuple(found[f"bucket_{index}"] or 0 for index in range(len(AGE_BUCKETS))),
    )


def oldest_unresolved(database: str, limit: int = OLDEST_SHOWN) -> list[IdempotencyRecord]:
    """The ``limit`` unresolved records of ``database`` created first, oldest first."""
    records = IdempotencyRecord.objects.using(database).filter(state__in=UNRESOLVED_STATES)
    return list(
        records.order_by("created_at", "pk").only(
            "tenant", "operation", "key", "state", "created_at", "lease_owner", "lease_expires_at"
        )[:limit]
    )
