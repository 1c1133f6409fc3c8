"""At 1,000,000 records, recovery and eviction find their rows through indexes.

The recovery scan (``store.take_over_next_stale``: unresolved states whose
lease ran out, oldest first) and the purge batch (``store.purge_expired_batch``:
resolved records past ``expires_at``, oldest first; ``purge_to_tombstones_batch``
with ``TOMBSTONE_TTL``) run on tables holding
tens of millions of rows while requests claim keys. A sequential scan there
would read the whole table for every record recovered and every batch purged.
Both indexes are partial (``idempotency_unresolved_lease`` holds the
unresolved records, ``idempotency_resolved_expiry`` the resolved ones):
the planner uses one only where the query states its condition, which the
census, the admin's retention filters, its date hierarchy and its counts
do too; so does the admin's search, one index per arm of its OR.

The statements explained are the ones the store really runs: each store
function is called under ``CaptureQueriesContext`` and every statement it
sent to the records table is explained as it was sent, so the test follows
the code (a changed filter, ordering or lock shows up here). The rows are
loaded inside the test's transaction (``INSERT ... SELECT generate_series``,
then ``ANALYZE``, which PostgreSQL allows in a transaction) and vanish with
its rollback, statistics included; the million aborted rows stay in the
table's heap until a VACUUM, which the module runs when it is done: every
later test that scans the table (a hypothesis machine's invariant, the
admin's counts) would otherwise wade through them, minutes in all.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from django_idempotency import _store as store
from django_idempotency._store.routing import record_databases
from django_idempotency.census import take_census
from django_idempotency.models import IdempotencyRecord
from django_idempotency.scope import Scope

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

ROWS = 1_000_000
TABLE = IdempotencyRecord._meta.db_table
OPERATIONS = [
    "POST v1/payments",
    "POST v1/refunds",
    "POST v1/customers",
    "PATCH v1/customers/<int:pk>",
]

# About 96 % COMPLETED, 2 % FAILED and 0.3 % unresolved (their leases long
# run out, so all of those are stale), created over the last 75 hours and
# kept for 72: the oldest 4 % are past retention.
LOAD = f"""
INSERT INTO {TABLE} (
    tenant, operation, key, fingerprint, state, lease_owner, lease_expires_at,
    fencing_token, provider_key, provider_operation_id, response_status,
    response_headers, response_body, created_at, updated_at, expires_at
)
SELECT
    'user:' || (i % 5000),
    (ARRAY[{", ".join(f"'{name}'" for name in OPERATIONS)}])[1 + i % 4],
    md5(i::text),
    md5(i::text) || md5((i + 1)::text),
    s.state,
    CASE WHEN s.resolved THEN '' ELSE 'host:1:1' END,
    CASE WHEN s.resolved THEN NULL ELSE t.created + interval '2 minutes' END,
    1, '', '',
    CASE WHEN s.resolved THEN (CASE s.state WHEN 'FAILED' THEN 400 ELSE 201 END) END,
    '[["Content-Type", "application/json"]]'::jsonb,
    CASE WHEN s.resolved THEN convert_to('{{"id": ' || i || ', "status": "ok"}}', 'UTF8') END,
    t.created, t.created, t.created + interval '72 hours'
FROM generate_series(1, {ROWS}) AS i
CROSS JOIN LATERAL (
    SELECT now() - interval '75 hours' * (1 - i::float8 / {ROWS}) AS created
) AS t
CROSS JOIN LATERAL (
    SELECT state, state IN ('COMPLETED', 'FAILED') AS resolved FROM (
        SELECT CASE
            WHEN i % 1000 = 0 THEN 'CLAIMED'
            WHEN i % 1000 = 1 THEN 'IN_PROGRESS'
            WHEN i % 1000 = 2 THEN 'UNCERTAIN'
            WHEN i % 50 = 3 THEN 'FAILED'
            ELSE 'COMPLETED'
        END AS state
    ) AS picked
) AS s
"""

#: A plan step that reads the whole records table.
SEQ_SCAN = re.compile(rf"Seq Scan on {TABLE}\b")
INDEX_SCAN = re.compile(
    r"(Index Scan|Index Only Scan) (Backward )?using \w+|Bitmap Index Scan on \w+"
)


@pytest.fixture(autouse=True, scope="module")
def _vacuum_afterwards(django_db_blocker: Any) -> Any:
    """Reclaim the rolled-back rows once the module's transactions are over."""
    yield
    with django_db_blocker.unblock():
        connection = connections[record_databases()[0]]
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(f"VACUUM ANALYZE {TABLE}")


@pytest.fixture
def million_records() -> None:
    """Load the rows inside the test's transaction, fast: indexes built after the rows.

    Inserting 1,000,000 random keys into seven live indexes takes minutes;
    building the same indexes once the rows are in takes seconds. The
    definitions come from the catalog (i.e. from the migrations), and the
    rollback at the end of the test restores everything as it was.
    """
    with connections[record_databases()[0]].cursor() as cursor:
        cursor.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s "
            "AND indexname NOT IN (SELECT conname FROM pg_constraint)",
            [TABLE],
        )
        indexes = cursor.fetchall()
        cursor.execute(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = %s::regclass AND contype = 'u'",
            [TABLE],
        )
        constraints = cursor.fetchall()
        for name, _ in indexes:
            cursor.execute(f'DROP INDEX "{name}"')
        for name, _ in constraints:
            cursor.execute(f'ALTER TABLE {TABLE} DROP CONSTRAINT "{name}"')
        cursor.execute("SET LOCAL maintenance_work_mem = '256MB'")
        cursor.execute(LOAD)
        for name, definition in constraints:
            cursor.execute(f'ALTER TABLE {TABLE} ADD CONSTRAINT "{name}" {definition}')
        for _, definition in indexes:
            cursor.execute(definition)
        cursor.execute(f"ANALYZE {TABLE}")
        cursor.execute(f"SELECT count(*) FROM {TABLE}")
        assert cursor.fetchone()[0] >= ROWS


def statements_on_records(action: Callable[[], Any]) -> list[str]:
    """The SQL ``action`` sent that reads or writes the records table."""
    connection = connections[record_databases()[0]]
    with CaptureQueriesContext(connection) as captured:
        action()
    return [
        query["sql"]
        for query in captured.captured_queries
        if f'"{TABLE}"' in query["sql"]
        and query["sql"].lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "WITH"))
    ]


def explain(sql: str) -> str:
    with connections[record_databases()[0]].cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}")
        return "\n".join(row[0] for row in cursor.fetchall())


def plan_problem(sql: str) -> str | None:
    """Why the plan of ``sql`` is not an indexed access to the records table, or None."""
    plan = explain(sql)
    if SEQ_SCAN.search(plan):
        return f"sequential scan of {TABLE}:\n{sql}\n{plan}"
    if not INDEX_SCAN.search(plan):
        return f"no index used:\n{sql}\n{plan}"
    return None


def test_recovery_purge_and_lookup_use_indexes_at_a_million_rows(million_records: None) -> None:
    using = record_databases()[0]

    # Recovery: the oldest stale unresolved record, then its compare-and-set.
    taken: list[Any] = []
    recovery = statements_on_records(
        lambda: taken.append(store.take_over_next_stale(lease=timedelta(minutes=2), using=using))
    )
    assert taken[0] is not None, "the load holds stale records: one must be taken over"
    scans = [sql for sql in recovery if sql.upper().startswith("SELECT")]
    assert scans and all("lease_expires_at" in sql and "ORDER BY" in sql for sql in scans)

    # Eviction: one batch of resolved records past retention, then its DELETE.
    batches: list[tuple[int, Any]] = []
    purge = statements_on_records(
        lambda: batches.append(store.purge_expired_batch(limit=1000, using=using))
    )
    assert batches[0][0] == 1000, "the load holds 40,000 expired records: a full batch"
    # One statement: the DELETE of the first 1,000 by expiry, and its count.
    assert len(purge) == 1 and "ORDER BY" in purge[0] and "SKIP LOCKED" in purge[0]
    # The next batch starts its scan where this one ended.
    purge += statements_on_records(
        lambda: batches.append(
            store.purge_expired_batch(limit=1000, using=using, after=batches[0][1])
        )
    )
    assert batches[1][0] == 1000 and batches[1][1] >= batches[0][1]
    # With TOMBSTONE_TTL: one statement too, its DELETE and UPDATE on the same batch.
    made: list[Any] = []
    purge_to_tombstones = statements_on_records(
        lambda: made.append(
            store.purge_to_tombstones_batch(
                limit=1000, using=using, tombstone_ttl=timedelta(days=30), after=batches[1][1]
            )
        )
    )
    assert made[0].tombstoned == 1000 and len(purge_to_tombstones) == 1
    purge += purge_to_tombstones

    # The lookup every replay, mismatch and conflict makes (.first() adds ORDER BY id).
    i = 123_457  # a row of the load, its scope spelled as LOAD spells it
    key = hashlib.md5(str(i).encode()).hexdigest()
    found: list[Any] = []
    lookup = statements_on_records(
        lambda: found.append(
            store.lookup(Scope(f"user:{i % 5000}", OPERATIONS[i % 4], key), using=using)
        )
    )
    assert found[0] is not None

    problems = [
        problem
        for statements in (recovery, purge, lookup)
        for sql in statements
        if (problem := plan_problem(sql))
    ]
    assert not problems, "\n\n".join(problems)
    # Through the partial indexes: the scans state their conditions.
    assert all(
        "idempotency_unresolved_lease" in explain(sql)
        for sql in recovery
        if sql.startswith("SELECT")
    )
    assert all("idempotency_resolved_expiry" in explain(sql) for sql in purge)


def test_the_census_and_the_admins_pages_use_indexes_at_a_million_rows(
    million_records: None,
) -> None:
    """The unresolved states' counts, the backlog, the retention filters, dates and search."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    using = record_databases()[0]
    census = statements_on_records(lambda: take_census(using))
    user = get_user_model().objects.create_superuser("explain", "explain@example.com", "x")
    client = Client()
    client.force_login(user)
    key = hashlib.md5(b"123457").hexdigest()
    pages = [
        "?expires=hour",
        "?expires=expired",
        "?state=stuck",
        "?state=UNCERTAIN",
        f"?q={key}",
        "?expires_at__year=2030&expires_at__month=1&expires_at__day=2",
    ]
    admin: list[str] = []
    for page in pages:
        url = f"/admin/django_idempotency/idempotencyrecord/{page}"
        admin += statements_on_records(partial(client.get, url))
    problems = [
        problem
        for sql in census + admin
        # The resolved states' figures are the planner's estimates here (a
        # table this large): their EXPLAINs never reach this list.
        if (problem := plan_problem(sql))
    ]
    assert not problems, "\n\n".join(problems)
    plans = "\n".join(explain(sql) for sql in admin)
    assert "idempotency_resolved_expiry" in plans and "idempotency_unresolved_lease" in plans
    # The search: an index per arm of its OR (the key's, the tenant's, the
    # provider ids', the steps'), not a walk of the primary key past every row.
    searches = [sql for sql in admin if f"\"key\" = '{key}'" in sql]
    assert searches and all("BitmapOr" in explain(sql) for sql in searches)
