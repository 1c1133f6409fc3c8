"""How many records there are in each state, and what needs an operator: read-only.

What ``idempotency_health``, the admin's overview page and the gauges of
``django_idempotency._observability.recording`` report (``observe_records``
sets the gauges). Every figure has a bounded cost
however large the table grows (a hundred million records a day is the
size we plan for):

- the unresolved states (CLAIMED, IN_PROGRESS, UNCERTAIN) are counted
  exactly: they are few, and the recovery index holds only them (partial
  on ``state``; on MySQL and MariaDB it leads with ``state``);
- the resolved ones (COMPLETED, FAILED) are taken from the planner's
  estimate (PostgreSQL's column statistics, InnoDB's index dives) when it
  says more than twice ``EXACT_UP_TO``, else counted, exactly up to
  ``EXACT_UP_TO`` (beyond it the larger of the count and the estimate);
  the ``estimated`` set names the estimates. Statistics lag behind: a
  table that just grew past the bar is counted up to it and reported as
  at least that; one a purge just emptied may be reported "about" its old
  size until the next ANALYZE (autovacuum's);
- the purge backlog is counted up to ``BACKLOG_CAP`` and reported as "at
  least" beyond it: a purge that fell behind by millions needs the same
  action as one behind by ten thousand.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import Count, Min, Q, QuerySet

from django_idempotency._store.database_time import DatabaseNow, database_now
from django_idempotency.models import RESOLVED_STATES, UNRESOLVED_STATES, IdempotencyRecord
from django_idempotency.recovery import reconciler_for

__all__ = [
    "BACKLOG_CAP",
    "EXACT_UP_TO",
    "Census",
    "observe_records",
    "stuck",
    "take_census",
]

EXACT_UP_TO = 100_000
"""COMPLETED and FAILED are counted exactly up to this; estimated past twice it."""

BACKLOG_CAP = 100_000
"""The purge backlog is counted up to this many records, and is "at least" beyond."""

#: On PostgreSQL no index holds the resolved states (the recovery index is
#: partial on the unresolved ones, the expiry index keyed on expires_at):
#: counting one reads the table. So past this many rows in the table (the
#: planner's figure) a resolved state's figure is the estimate, however
#: small: a count must not read a table of millions every minute.
_SCANNED_UP_TO = 200_000

#: At most this many operation names are read for the reconciler check.
_OPERATIONS_READ = 1_000

#: MySQL's and MariaDB's recovery index, (state, lease_expires_at): InnoDB's
#: estimates are its. Not in the model's indexes: those are partial, which
#: MySQL and MariaDB lack, and migration 0009 keeps this one there.
_STATE_INDEX = "django_idempotency_recovery"

#: States whose records recovery hands to a reconciler (a CLAIMED record is
#: released without one: its view never called out).
_RECONCILED_STATES = (IdempotencyRecord.State.IN_PROGRESS, IdempotencyRecord.State.UNCERTAIN)


def stuck() -> Q:
    """The records that need recovery or an operator: no owner is at work on them.

    Every UNCERTAIN record, whatever its lease: no owner will finish it, and
    a lease still running on one is recovery postponing it (no reconciler,
    a ``Retry``, a reconciler that raised: a provider outage leaves every
    such record there, five minutes at a time). And the CLAIMED and
    IN_PROGRESS records whose owner's lease ran out (by the database's
    clock): the owner died. Not a CLAIMED or IN_PROGRESS record whose lease
    runs: its owner is at work, or a reconciler handed it back to the
    client's retry (``RetryFrom``).
    """
    State = IdempotencyRecord.State
    return Q(state=State.UNCERTAIN) | Q(
        state__in=(State.CLAIMED, State.IN_PROGRESS), lease_expires_at__lte=DatabaseNow()
    )


@dataclass(frozen=True)
class Census:
    """The records of one database, as of ``taken_at`` (the database's clock)."""

    database: str
    taken_at: datetime
    #: Records per state, every state present (0 when there are none).
    counts: Mapping[str, int]
    #: The states whose count is the planner's estimate, not a count.
    estimated: frozenset[str]
    #: When the oldest record of each unresolved state was created; absent: none.
    oldest: Mapping[str, datetime]
    #: Resolved records past retention that a purge would now delete or
    #: make tombstones of, counted up to ``BACKLOG_CAP``.
    purge_backlog: int
    #: Whether there are more than ``purge_backlog`` (the count stopped at the cap).
    purge_backlog_capped: bool
    #: Operations with IN_PROGRESS or UNCERTAIN records and no reconciler:
    #: recovery cannot settle those records (sorted).
    unreconciled_operations: tuple[str, ...] = field(default=())
    #: The unresolved records that need recovery or an operator (``stuck()``):
    #: an exact count.
    stuck: int = 0

    @property
    def unresolved(self) -> int:
        """Records still CLAIMED, IN_PROGRESS or UNCERTAIN: an exact count."""
        return sum(self.counts[state] for state in UNRESOLVED_STATES)

    def age(self, state: str) -> timedelta | None:
        """How long ago the oldest record in unresolved ``state`` was created; None: none."""
        created = self.oldest.get(state)
        return None if created is None else max(self.taken_at - created, timedelta(0))

    @property
    def oldest_unresolved_age(self) -> timedelta | None:
        """The age of the oldest unresolved record, whatever its state."""
        ages = [age for state in UNRESOLVED_STATES if (age := self.age(state)) is not None]
        return max(ages, default=None)


def take_census(database: str) -> Census:
    """Count the records of ``database`` (a records alias), in a few bounded queries."""
    records = IdempotencyRecord.objects.using(database)
    taken_at = database_now(database)
    counts = dict.fromkeys(IdempotencyRecord.State.values, 0)
    oldest: dict[str, datetime] = {}
    stuck_count = 0
    for row in (
        records.filter(state__in=UNRESOLVED_STATES)
        .values("state")
        .annotate(count=Count("pk"), oldest=Min("created_at"), stuck=Count("pk", filter=stuck()))
        .order_by()
    ):
        counts[row["state"]] = row["count"]
        oldest[row["state"]] = row["oldest"]
        stuck_count += row["stuck"]
    estimated: set[str] = set()
    too_large_to_scan = too_large_to_count_resolved(database)
    for state in RESOLVED_STATES:
        count, is_estimate = _count_or_estimate(records, state, too_large_to_scan)
        counts[state] = count
        if is_estimate:
            estimated.add(state)
    backlog = _count_up_to(
        records.filter(state__in=RESOLVED_STATES, expires_at__lte=DatabaseNow()), BACKLOG_CAP
    )
    return Census(
        database=database,
        taken_at=taken_at,
        counts=counts,
        estimated=frozenset(estimated),
        oldest=oldest,
        purge_backlog=min(backlog, BACKLOG_CAP),
        purge_backlog_capped=backlog > BACKLOG_CAP,
        unreconciled_operations=_unreconciled_operations(records),
        stuck=stuck_count,
    )


def _count_up_to(records: QuerySet[IdempotencyRecord], cap: int) -> int:
    """``records.count()``, reading at most ``cap + 1`` rows (a count over a LIMIT)."""
    return records.order_by()[: cap + 1].count()


def too_large_to_count_resolved(database: str) -> bool:
    """Whether counting a resolved state of ``database`` would read too much of its table.

    On PostgreSQL only: there no index holds the resolved states
    (``_SCANNED_UP_TO``); MySQL and MariaDB count them on their recovery
    index, SQLite holds a demo's or a test's records.
    """
    connection = connections[database]
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)",
            [connection.ops.quote_name(IdempotencyRecord._meta.db_table)],
        )
        row = cursor.fetchone()
    # -1: never analysed (a new table, which autovacuum analyses as it grows).
    return row is not None and row[0] > _SCANNED_UP_TO


def planner_estimate(database: str, state: str) -> int | None:
    """How many records in ``state`` the database's planner expects; None: no planner."""
    return _planner_estimate(database, state)


def _count_or_estimate(
    records: QuerySet[IdempotencyRecord], state: str, too_large_to_scan: bool = False
) -> tuple[int, bool]:
    """The planner's estimate well past ``EXACT_UP_TO``; else a count, exact up to there.

    The estimate comes first: counting even ``EXACT_UP_TO`` rows of a state
    spread over the whole table reads a heap page per row wherever the
    visibility map is not set (autovacuum behind): 0.5 s for FAILED at
    10,000,000 records (benchmarks/health.py), against 1 ms for EXPLAIN.
    Near the bar (up to twice it) the count decides, since estimates run
    high: InnoDB's include deleted rows its purge has not removed yet. In a
    table too large to scan (``too_large_to_count_resolved``) the estimate
    is the figure whatever it says.
    """
    records = records.filter(state=state)
    estimate = _planner_estimate(records.db, state)
    if estimate is None:
        return records.count(), False
    if estimate > 2 * EXACT_UP_TO or too_large_to_scan:
        return estimate, True
    count = _count_up_to(records, EXACT_UP_TO)
    if count <= EXACT_UP_TO:
        return count, False
    # At least what the count saw, whatever stale statistics say.
    return max(estimate, count), True


def _planner_estimate(database: str, state: str) -> int | None:
    """How many records in ``state`` the database's planner expects; None: no planner."""
    connection = connections[database]
    table = connection.ops.quote_name(IdempotencyRecord._meta.db_table)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # The column's statistics (most common values), as of the last ANALYZE.
            cursor.execute(f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {table} WHERE state = %s", [state])
            plan = cursor.fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            return int(plan[0]["Plan"]["Plan Rows"])
        if connection.vendor == "mysql":
            return _innodb_estimate(cursor, table, connection.ops.quote_name(_STATE_INDEX), state)
    # SQLite (and any other backend) has no row estimate: the embedded
    # database holds a demo's or a test's records, which count quickly.
    return None


def _innodb_estimate(cursor: Any, table: str, index: str, state: str) -> int:
    """InnoDB's index dives on the recovery index (which leads with ``state``).

    Forced onto the index: a full scan's "rows" would be the whole table's.
    InnoDB caps a range's estimate at half the table's rows, which the state
    of most records (COMPLETED) reaches: that one is the table's rows less
    the rest's, a range well under the cap.
    """

    def rows(sql: str, params: list[str]) -> int:
        cursor.execute(f"EXPLAIN {sql}", params)
        names = [column[0].lower() for column in cursor.description]
        return int(cursor.fetchone()[names.index("rows")] or 0)

    where = f"SELECT 1 FROM {table} FORCE INDEX ({index}) WHERE state"
    estimate = rows(f"{where} = %s", [state])
    total = rows(f"SELECT 1 FROM {table}", [])
    # Asked whether needed or not: the census makes as many queries however
    # the records are spread (a query count the tests can hold it to).
    others = rows(f"{where} <> %s", [state])
    if 2 * estimate + 1 < total:
        return estimate
    return max(total - others, estimate)


def _unreconciled_operations(records: QuerySet[IdempotencyRecord]) -> tuple[str, ...]:
    operations = (
        records.filter(state__in=_RECONCILED_STATES)
        .order_by()
        .values_list("operation", flat=True)
        .distinct()[:_OPERATIONS_READ]
    )
    return tuple(sorted(name for name in set(operations) if reconciler_for(name) is None))


def observe_records(database: str | None = None) -> dict[str, dict[str, Any]]:
    """Take the census of each records database and set the metrics' gauges.

    What the Celery task ``django_idempotency.tasks.observe_records`` runs,
    importable without Celery: call it every minute from one long-lived
    process of yours that exports metrics (docs/observability.md).

    Args:
        database: Only this records database; ``None``: every one.

    Returns:
        Per database: ``counts`` per state, ``estimated`` (the states whose
        count is an estimate), ``oldest_unresolved_age`` (seconds or None),
        ``purge_backlog`` and ``unreconciled_operations``.
    """
    from django_idempotency._observability.recording import publish_census
    from django_idempotency._store.routing import records_database_named, sweep

    observed: dict[str, dict[str, Any]] = {}

    def observe(alias: str) -> None:
        census = take_census(alias)
        publish_census(census)
        age = census.oldest_unresolved_age
        observed[alias] = {
            "counts": dict(census.counts),
            "estimated": sorted(census.estimated),
            "oldest_unresolved_age": None if age is None else age.total_seconds(),
            "purge_backlog": census.purge_backlog,
            "unreconciled_operations": list(census.unreconciled_operations),
        }

    sweep(records_database_named(database), observe)
    return observed
