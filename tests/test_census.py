"""The census: counts per state, oldest unresolved records, purge backlog, missing reconcilers.

``census.take_census`` on the suite's database (SQLite, PostgreSQL or
MariaDB), over records the tests make. The resolved states' estimate and
the backlog's cap are reached by lowering ``EXACT_UP_TO`` and
``BACKLOG_CAP``: the code paths are those of a table of millions, the
figures checked against the records really there.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from django_idempotency import census, purge, recovery
from django_idempotency._observability.opentelemetry import OpenTelemetrySink
from django_idempotency._store.database_time import DatabaseLater, uses_host_clock
from django_idempotency.census import take_census
from django_idempotency.metrics import INSTRUMENTS
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory
from tests.telemetry import Readings
from tests.test_health_command import aged, make
from tests.utils import REPO, database_url

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
UNRESOLVED = [State.CLAIMED, State.IN_PROGRESS, State.UNCERTAIN]
RESOLVED = [State.COMPLETED, State.FAILED]
UNRESOLVED_FIELDS: dict[str, Any] = {
    "lease_owner": "host:1:1",
    "lease_expires_at": timezone.now() + timedelta(minutes=2),
    "response_status": None,
    "response_body": None,
    "response_headers": [],
}


def record(
    state: str = State.COMPLETED, *, using: str = "default", **fields: Any
) -> IdempotencyRecord:
    """A record in ``state`` in ``using``; an unresolved one has an owner and no response."""
    values: dict[str, Any] = {"state": state, **({} if state in RESOLVED else UNRESOLVED_FIELDS)}
    values.update(fields)
    made = RecordFactory.build(**values)
    made.save(using=using)
    return made


def records(count: int, state: str = State.COMPLETED, **fields: Any) -> list[IdempotencyRecord]:
    return [record(state, **fields) for _ in range(count)]


def many(count: int, state: str) -> None:
    """``count`` records in ``state``, in one INSERT."""
    IdempotencyRecord.objects.bulk_create(
        RecordFactory.build(state=state, **({} if state in RESOLVED else UNRESOLVED_FIELDS))
        for _ in range(count)
    )


def set_times(made: list[IdempotencyRecord], **ago: timedelta) -> None:
    """Set each named time field ``ago`` before the database's now (its clock, not ours)."""
    IdempotencyRecord.objects.using(made[0]._state.db).filter(
        pk__in=[one.pk for one in made]
    ).update(**{name: DatabaseLater(-value) for name, value in ago.items()})


def analyze() -> None:
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"ANALYZE {table}")
        elif connection.vendor == "mysql":
            cursor.execute(f"ANALYZE TABLE {table}")
            cursor.fetchall()


@contextlib.contextmanager
def host_clock(offset: timedelta) -> Iterator[None]:
    """This process's clock runs ``offset`` off; the database's does not."""
    real = timezone.now
    with mock.patch("django.utils.timezone.now", lambda: real() + offset):
        yield


# --- counts ----------------------------------------------------------------


def test_an_empty_table_has_every_state_at_zero_and_nothing_to_report() -> None:
    taken = take_census("default")

    assert taken.counts == dict.fromkeys(State.values, 0)
    assert taken.estimated == frozenset()
    assert taken.oldest == {}
    assert [taken.age(state) for state in UNRESOLVED] == [None, None, None]
    assert taken.oldest_unresolved_age is None
    assert (taken.purge_backlog, taken.purge_backlog_capped) == (0, False)
    assert taken.unreconciled_operations == ()
    assert taken.unresolved == 0
    assert taken.database == "default"


def test_each_state_is_counted_exactly() -> None:
    for state, count in [
        (State.CLAIMED, 3),
        (State.IN_PROGRESS, 2),
        (State.UNCERTAIN, 1),
        (State.COMPLETED, 5),
        (State.FAILED, 4),
    ]:
        records(count, state)

    taken = take_census("default")

    assert taken.counts == {
        "CLAIMED": 3,
        "IN_PROGRESS": 2,
        "UNCERTAIN": 1,
        "COMPLETED": 5,
        "FAILED": 4,
    }
    assert taken.unresolved == 6
    assert taken.estimated == frozenset()


def test_a_resolved_state_up_to_exact_up_to_is_counted_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(census, "EXACT_UP_TO", 4)
    records(4, State.COMPLETED)
    records(2, State.FAILED)
    analyze()

    taken = take_census("default")

    assert (taken.counts["COMPLETED"], taken.counts["FAILED"]) == (4, 2)
    assert taken.estimated == frozenset()


def test_past_exact_up_to_a_resolved_count_is_the_planners_estimate_near_the_truth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(census, "EXACT_UP_TO", 40)
    many(200, State.COMPLETED)
    many(10, State.FAILED)
    many(2, State.UNCERTAIN)
    analyze()

    taken = take_census("default")

    # Unresolved states are never estimated, nor a resolved one under the bar.
    assert (taken.counts["UNCERTAIN"], taken.counts["FAILED"]) == (2, 10)
    if connection.vendor == "sqlite":
        # No planner estimate: the few records of an embedded database are counted.
        assert taken.estimated == frozenset()
        assert taken.counts["COMPLETED"] == 200
    else:
        assert taken.estimated == {"COMPLETED"}
        assert abs(taken.counts["COMPLETED"] - 200) <= 20, taken.counts


def test_on_postgresql_a_table_too_large_to_scan_has_its_resolved_states_estimated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No index holds the resolved states on PostgreSQL (the recovery and
    # expiry indexes are partial): a count of even a few FAILED records
    # would read the whole table. MySQL and MariaDB count on their
    # (state, lease_expires_at) index; SQLite holds few records.
    monkeypatch.setattr(census, "_SCANNED_UP_TO", 20)
    many(30, State.COMPLETED)
    many(3, State.FAILED)
    many(2, State.UNCERTAIN)
    analyze()

    taken = take_census("default")

    assert taken.counts["UNCERTAIN"] == 2  # unresolved: always exact
    if connection.vendor == "postgresql":
        assert taken.estimated == set(RESOLVED)
        assert abs(taken.counts["FAILED"] - 3) <= 3, taken.counts
    else:
        assert taken.estimated == frozenset()
        assert (taken.counts["COMPLETED"], taken.counts["FAILED"]) == (30, 3)


def test_an_estimate_below_what_was_counted_is_raised_to_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no planner estimate")
    # Statistics taken on an empty table, then a bulk load: the planner says
    # (nearly) none, the capped count saw more than EXACT_UP_TO.
    analyze()
    monkeypatch.setattr(census, "EXACT_UP_TO", 5)
    monkeypatch.setattr(census, "_planner_estimate", lambda database, state: 1)
    records(9, State.FAILED)

    taken = take_census("default")

    assert taken.counts["FAILED"] == 6
    assert taken.estimated == {"FAILED"}


# --- oldest unresolved records ---------------------------------------------


def test_the_oldest_record_of_each_unresolved_state_and_its_age() -> None:
    set_times(records(2, State.CLAIMED), created_at=timedelta(minutes=5))
    set_times([record(State.CLAIMED)], created_at=timedelta(minutes=1))
    set_times([record(State.UNCERTAIN)], created_at=timedelta(hours=3))
    # Older still, but resolved: not "unresolved" for anybody.
    set_times([record(State.COMPLETED)], created_at=timedelta(days=2))

    taken = take_census("default")

    assert set(taken.oldest) == {"CLAIMED", "UNCERTAIN"}
    claimed, uncertain = taken.age("CLAIMED"), taken.age("UNCERTAIN")
    assert claimed is not None and uncertain is not None
    # Seconds of slack for the statements between the update and the census.
    assert timedelta(minutes=5) <= claimed < timedelta(minutes=5, seconds=30)
    assert timedelta(hours=3) <= uncertain < timedelta(hours=3, seconds=30)
    assert taken.age("IN_PROGRESS") is None
    assert taken.age("COMPLETED") is None
    assert taken.oldest_unresolved_age == uncertain
    assert taken.oldest["UNCERTAIN"] == taken.taken_at - uncertain


def test_ages_are_judged_by_the_databases_clock_not_this_hosts() -> None:
    if uses_host_clock(connection):
        pytest.skip("this database's times come from this host's clock")
    set_times([record(State.IN_PROGRESS)], created_at=timedelta(minutes=10))

    with host_clock(timedelta(hours=1)):
        taken = take_census("default")

    age = taken.age("IN_PROGRESS")
    assert age is not None and timedelta(minutes=10) <= age < timedelta(minutes=10, seconds=30)
    assert abs(taken.taken_at - timezone.now()) < timedelta(minutes=1)


def test_a_record_created_after_the_census_clock_was_read_has_age_zero_not_negative() -> None:
    set_times([record(State.CLAIMED)], created_at=timedelta(seconds=-60))  # a minute ahead

    assert take_census("default").age("CLAIMED") == timedelta(0)


# --- purge backlog ---------------------------------------------------------


def test_the_backlog_is_resolved_records_past_expiry_only() -> None:
    set_times(records(2, State.COMPLETED) + records(1, State.FAILED), expires_at=timedelta(hours=1))
    records(3, State.COMPLETED)  # expires in an hour
    # Unresolved and long past expiry: recovery's business, never purged.
    set_times([record(state) for state in UNRESOLVED], expires_at=timedelta(days=3))

    taken = take_census("default")

    assert (taken.purge_backlog, taken.purge_backlog_capped) == (3, False)
    assert taken.purge_backlog == purge.expired_count(database="default")


def test_the_backlog_is_counted_up_to_the_cap_and_says_so_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(census, "BACKLOG_CAP", 3)
    expired = records(3, State.COMPLETED)
    set_times(expired, expires_at=timedelta(minutes=1))

    assert (take_census("default").purge_backlog, take_census("default").purge_backlog_capped) == (
        3,
        False,
    )

    set_times(records(2, State.FAILED), expires_at=timedelta(minutes=1))
    taken = take_census("default")

    assert (taken.purge_backlog, taken.purge_backlog_capped) == (3, True)


def test_with_tombstones_the_backlog_is_what_the_purge_would_delete_or_make_tombstones(
    settings: Any,
) -> None:
    ttl = timedelta(days=7)
    settings.IDEMPOTENCY = {**getattr(settings, "IDEMPOTENCY", {}), "TOMBSTONE_TTL": ttl}
    # Past retention only: to be made a tombstone.
    set_times(records(2, State.COMPLETED), expires_at=timedelta(hours=1))
    # Past retention and the tombstone's time: to be deleted outright.
    set_times(records(1, State.FAILED), expires_at=ttl + timedelta(hours=1))
    # A tombstone past its own expiry: to be deleted.
    set_times(
        records(1, State.COMPLETED, tombstone=True, response_body=None),
        expires_at=timedelta(minutes=1),
    )
    # A tombstone still refusing retries, and a live record: not due.
    records(1, State.COMPLETED, tombstone=True, response_body=None)
    records(1, State.COMPLETED)

    taken = take_census("default")

    assert purge.expired_count(database="default") == 2
    assert purge.tombstone_count(database="default") == 2
    assert taken.purge_backlog == 4
    assert taken.counts["COMPLETED"] == 5  # tombstones stay COMPLETED


# --- operations without a reconciler ----------------------------------------


@pytest.fixture
def reconciled_operation() -> Iterator[str]:
    operation = "POST census-test/reconciled"

    @recovery.register_reconciler(operation)
    def settle(record: IdempotencyRecord) -> recovery.ReconcilerOutcome:
        return recovery.Completed(status=201, body={})

    yield operation
    del recovery._reconcilers[operation]


def test_operations_with_in_progress_or_uncertain_records_and_no_reconciler_are_named(
    reconciled_operation: str,
) -> None:
    record(State.IN_PROGRESS, operation=reconciled_operation)
    record(State.UNCERTAIN, operation=reconciled_operation)
    records(2, State.IN_PROGRESS, operation="POST v1/refunds")
    record(State.UNCERTAIN, operation="POST v1/charges")
    # CLAIMED records are released without a reconciler; resolved ones need none.
    record(State.CLAIMED, operation="POST v1/orders")
    record(State.COMPLETED, operation="POST v1/payouts")

    taken = take_census("default")

    assert taken.unreconciled_operations == ("POST v1/charges", "POST v1/refunds")


def test_registering_the_missing_reconciler_clears_the_operation() -> None:
    record(State.UNCERTAIN, operation="POST census-test/late")
    assert take_census("default").unreconciled_operations == ("POST census-test/late",)

    recovery.register_reconciler("POST census-test/late")(lambda record: recovery.Release())
    try:
        assert take_census("default").unreconciled_operations == ()
    finally:
        del recovery._reconcilers["POST census-test/late"]


# --- cost --------------------------------------------------------------------


def census_queries(alias: str = "default") -> int:
    with CaptureQueriesContext(connections[alias]) as queries:
        take_census(alias)
    return len(queries.captured_queries)


def some_of_everything(count: int) -> None:
    for state in State.values:
        records(count, state, operation=f"POST v1/{state.lower()}")
    set_times(records(count, State.COMPLETED), expires_at=timedelta(hours=1))


def test_a_census_takes_a_few_queries_however_many_records_there_are() -> None:
    empty = census_queries()
    some_of_everything(2)
    few = census_queries()
    some_of_everything(20)
    most = census_queries()

    # The clock, the unresolved states, per resolved state the planner's
    # estimate and (near or under EXACT_UP_TO) a count, the backlog, the
    # operations; on PostgreSQL also the table's size (no index holds the
    # resolved states there: past a size their count would read the table).
    # SQLite: no clock query (the host's), no estimate.
    if connection.vendor == "mysql":
        # Also the table's rows per resolved state, and for a state holding
        # half of them or more the rest's (InnoDB's cap; the table's rows
        # are themselves an estimate, so which state reaches it varies on
        # tables this small): up to 2 more queries.
        assert all(10 <= queries <= 12 for queries in (empty, few, most))
    else:
        assert empty == few == most == {"sqlite": 5, "postgresql": 9}[connection.vendor]


def test_the_estimate_path_saves_the_count_of_each_estimated_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    some_of_everything(10)
    analyze()
    exact = census_queries()
    monkeypatch.setattr(census, "EXACT_UP_TO", 2)
    monkeypatch.setattr(census, "BACKLOG_CAP", 2)

    with CaptureQueriesContext(connection) as queries:
        taken = take_census("default")

    # Past EXACT_UP_TO the estimate is the figure: no count (on SQLite, which
    # has no estimate, a full count instead of one up to the bar).
    assert len(queries.captured_queries) == (exact if connection.vendor == "sqlite" else exact - 2)
    assert taken.estimated == (set() if connection.vendor == "sqlite" else set(RESOLVED))
    assert taken.purge_backlog_capped


@pytest.mark.django_db(databases=["default", "shard_a"], transaction=True)
def test_a_census_reads_only_its_own_database() -> None:
    records(2, State.UNCERTAIN, using="shard_a")
    records(1, State.CLAIMED)

    with CaptureQueriesContext(connection) as on_default:
        shard = take_census("shard_a")
    default = take_census("default")

    assert (shard.counts["UNCERTAIN"], shard.counts["CLAIMED"]) == (2, 0)
    assert (default.counts["UNCERTAIN"], default.counts["CLAIMED"]) == (0, 1)
    assert shard.database == "shard_a"
    assert on_default.captured_queries == []
    assert census_queries("shard_a") == census_queries("default")


# The census gauges under Celery's default (prefork) pool.
#
# docs/observability.md: "one process takes them: the Celery task
# observe_records ... It sets the gauges in the worker that runs it; with the
# OpenTelemetry sink, that worker's SDK exports them." Celery's default pool
# is prefork: each run of the task lands in one of several child processes,
# and each child's SDK keeps exporting the last values that child set (a
# synchronous gauge, cumulative temporality: the last value is kept). The
# alert rules read the gauges with ``max by (database)``.

#: A worker child: runs observe_records when told to, reports what its SDK exports.
CHILD = textwrap.dedent(
    """
    import json, sys
    import django
    django.setup()
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from django_idempotency._observability import opentelemetry as metrics_opentelemetry
    from django_idempotency.tasks import observe_records
    metrics_opentelemetry.CENSUS_REPORTED_FOR = 1.0  # 150 s in production
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

    def exported():
        found = {}
        data = reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        labels = dict(point.attributes)
                        if labels.get("state") == "UNCERTAIN":
                            found[metric.name] = point.value
        return found

    for line in sys.stdin:
        if line.strip() == "census":
            observe_records.run()
        print(json.dumps(exported()), flush=True)
    """
)


class Child:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            cwd=REPO,
            env={
                **os.environ,
                "DATABASE_URL": database_url(),
                "DJANGO_SETTINGS_MODULE": "tests.settings",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, what: str) -> dict[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(what + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, "the child process died"
        return dict(json.loads(line))

    def close(self) -> None:
        with self.process:  # closes the pipes, then waits for the process
            assert self.process.stdin is not None
            self.process.stdin.close()


def test_a_resolved_uncertain_record_stops_showing_in_what_the_worker_exports() -> None:
    """Child A's census saw an UNCERTAIN record 20 minutes old; an operator resolved
    it; child B's census (the next minute) saw none. What the workers export,
    read as the alerts read it (``max by (database)``), must be the latest
    census: it is A's stale one, which A keeps exporting until the task
    happens to land on A again, so ``IdempotencyUncertainRecordsOld`` keeps
    firing for a record that is gone. (Fixed: a process reports its census
    for ``CENSUS_REPORTED_FOR`` only, shortened here.)
    """
    stuck = aged(make(State.UNCERTAIN), created_at=timedelta(minutes=20))
    first, second = Child(), Child()
    try:
        assert first.ask("census")["idempotency.records"] == 1
        IdempotencyRecord.objects.filter(pk=stuck.pk).update(state=State.FAILED)
        assert second.ask("census")["idempotency.records"] == 0

        time.sleep(1.2)  # A's census is past CENSUS_REPORTED_FOR; B takes the next one
        exports = [first.ask("collect"), second.ask("census")]
    finally:
        first.close()
        second.close()

    for name in ("idempotency.records", "idempotency.oldest_unresolved.age"):
        assert max(export.get(name, 0) for export in exports) == 0, (name, exports)


# The OpenTelemetry gauges are observable: every reader of the meter provider sees them.


def test_every_reader_of_the_meter_provider_sees_the_census() -> None:
    """A project exporting to two places (OTLP and Prometheus, OTLP and the console).

    ``OpenTelemetrySink.observe`` hands each census over once, to whichever
    reader collects first: the SDK runs the callbacks per reader and gives
    their measurements to that reader only
    (``SynchronousMeasurementConsumer.collect``). The other reader never
    sees the gauges, so its alert rules see ``IdempotencyCensusMissing``.
    """
    first, second = InMemoryMetricReader(), InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[first, second])
    try:
        sink = OpenTelemetrySink(provider.get_meter("django_idempotency"))
        records = next(i for i in INSTRUMENTS if i.name == "idempotency.records")
        # What publish_census does with a census: one value per state.
        sink.set(records, 7, {"database": "default", "state": "UNCERTAIN"})

        seen_first = Readings(first).value("idempotency.records", state="UNCERTAIN")
        seen_second = Readings(second).value("idempotency.records", state="UNCERTAIN")
    finally:
        provider.shutdown()

    assert (seen_first, seen_second) == (7, 7)
