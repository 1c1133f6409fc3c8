#!/usr/bin/env python3
"""How long the admin's overview page takes on a large table (PostgreSQL).

    .venv/bin/python benchmarks/overview.py [--records 10000000] [--rounds 5]

1. creates a database ``idem_overview_<pid>`` on the server given by
   ``--postgres-url`` (default ``IDEMPOTENCY_TEST_POSTGRES_URL``, else the
   local server) and migrates the demo project (testproject) into it;
2. inserts ``--records`` records created over the last 48 hours, in
   ``created_at`` order as claims append them, with ``INSERT ... SELECT
   generate_series`` in ``--batches`` statements: 95 % COMPLETED, 5 % FAILED
   and one in 25,000 unresolved (CLAIMED, IN_PROGRESS, UNCERTAIN; half of
   them with their lease run out), kept 47 hours (so that the oldest hour
   awaits the purge: the backlog's cap is reached);
3. runs ``VACUUM ANALYZE`` (what autovacuum does to a table in steady state:
   statistics, the visibility map, and the BRIN index's summaries of the
   new pages);
4. times each data function of ``django_idempotency._admin.figures`` and the whole
   page (Django's test client, a superuser) over ``--rounds`` rounds after one
   to warm up, printing the median and maximum milliseconds; once, the exact
   hourly count the sample replaces, and how far the sample's totals are
   from it;
5. drops the database (unless ``--keep``).

Nothing here asserts a time: the figures go into docs/admin.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# Not this directory: its http.py would hide the standard library's.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT / "benchmarks"]
for path in (str(REPO_ROOT), str(REPO_ROOT / "testproject")):
    if path not in sys.path:
        sys.path.insert(0, path)

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from tests.live.server import database_url  # noqa: E402
from tests.live.services import postgres_url  # noqa: E402

OVERVIEW = "/admin/django_idempotency/idempotencyrecord/overview/"
SPAN = timedelta(hours=48)
TTL = timedelta(hours=47)
LEASE = timedelta(minutes=2)
#: One record in this many is unresolved: 400 at ten million.
UNRESOLVED_EVERY = 25_000

INSERT = f"""
INSERT INTO django_idempotency_record (
    tenant, operation, "key", fingerprint, state, lease_owner, lease_expires_at,
    fencing_token, provider_key, provider_operation_id, response_status,
    response_headers, response_body, created_at, updated_at, expires_at
)
SELECT
    'user:' || (i %% 5000), operation, md5(i::text), md5(i::text || 'f'), state,
    CASE WHEN resolved THEN '' ELSE 'web-1:' || (i %% 977) END,
    CASE
        WHEN resolved THEN NULL
        WHEN i %% 2 = 0 THEN %(now)s + interval '{int(LEASE.total_seconds())} s'
        ELSE created + interval '{int(LEASE.total_seconds())} s'
    END,
    1, '', '',
    CASE WHEN state = 'COMPLETED' THEN 201 WHEN state = 'FAILED' THEN 402 END,
    CASE WHEN resolved THEN '[["Content-Type", "application/json"]]'::jsonb
        ELSE '[]'::jsonb END,
    CASE WHEN resolved THEN convert_to('{{"id":' || i || ',"status":"succeeded"}}', 'UTF8') END,
    created, created, created + interval '{int(TTL.total_seconds())} s'
FROM (
    SELECT *, state IN ('COMPLETED', 'FAILED') AS resolved FROM (
        SELECT
            i,
            (ARRAY['POST v1/payments', 'POST v1/refunds', 'POST v1/payouts'])[1 + i %% 3]
                AS operation,
            CASE
                WHEN i %% {UNRESOLVED_EVERY} = 7
                THEN (ARRAY['CLAIMED', 'IN_PROGRESS', 'UNCERTAIN'])
                    [1 + (i / {UNRESOLVED_EVERY}) %% 3]
                WHEN i %% 20 = 3 THEN 'FAILED'
                ELSE 'COMPLETED'
            END AS state,
            %(now)s - %(span)s::interval
                * ((%(records)s::bigint - i)::float / %(records)s::bigint) AS created
        FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i
    ) AS picked
) AS rows_
"""


def fill(url: str, records: int, batches: int, now: datetime) -> None:
    span = f"{SPAN.total_seconds():.0f} s"
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as connection:
        step = -(-records // batches)
        for first in range(1, records + 1, step):
            last = min(first + step - 1, records)
            connection.execute(
                INSERT,
                {"now": now, "span": span, "records": records, "first": first, "last": last},
            )
            print(f"  inserted up to {last:,}", flush=True)
        inserted = time.perf_counter() - started
        started = time.perf_counter()
        connection.execute("VACUUM ANALYZE django_idempotency_record")
        analysed = time.perf_counter() - started
        size = connection.execute(
            "SELECT pg_size_pretty(pg_total_relation_size('django_idempotency_record'))"
        ).fetchone()
        states = connection.execute(
            "SELECT state, count(*) FROM django_idempotency_record GROUP BY 1 ORDER BY 2 DESC"
        ).fetchall()
    shown = ", ".join(f"{state} {count:,}" for state, count in states)
    print(
        f"inserted {records:,} records in {inserted:.1f} s, VACUUM ANALYZE {analysed:.1f} s; "
        f"table with indexes {size[0] if size else '?'}\n  {shown}",
        flush=True,
    )


def timed(work: Callable[[], Any], rounds: int) -> tuple[list[float], Any]:
    result = work()  # warms up
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        result = work()
        times.append((time.perf_counter() - started) * 1000)
    return times, result


def line(label: str, times: list[float], extra: str = "") -> None:
    print(f"| {label} | {statistics.median(times):.0f} | {max(times):.0f} | {extra} |", flush=True)


def measure(rounds: int) -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection, reset_queries
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from django_idempotency._admin import figures as overview
    from django_idempotency._store.database_time import database_now
    from django_idempotency.census import take_census

    now = database_now("default")
    print("\n| what | median ms | max ms | notes |\n| --- | ---: | ---: | --- |")
    times, census = timed(lambda: take_census("default"), rounds)
    estimated = ", ".join(sorted(census.estimated)) or "none"
    backlog = f"{'at least ' if census.purge_backlog_capped else ''}{census.purge_backlog:,}"
    line("take_census", times, f"estimated: {estimated}; backlog {backlog}")
    times, hourly = timed(lambda: overview.hourly_counts("default", now), rounds)
    sampled = hourly.sample_percent
    how = "exact" if sampled is None else f"a {sampled:.3f} % sample"
    line("hourly_counts", times, how)
    times, ages = timed(lambda: overview.unresolved_ages("default", now), rounds)
    line("unresolved_ages", times, f"{sum(ages.counts)} unresolved")
    times, _ = timed(lambda: overview.oldest_unresolved("default"), rounds)
    line("oldest_unresolved", times)

    admin = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client(HTTP_HOST="localhost")
    client.force_login(admin)

    def page() -> int:
        response = client.get(OVERVIEW)
        assert response.status_code == 200, response.status_code
        return len(response.content)

    with CaptureQueriesContext(connection) as queries:
        reset_queries()
        times, size = timed(page, rounds)
    per_request = len(queries.captured_queries) // (rounds + 1)
    line("the page (GET, test client)", times, f"{per_request} queries, {size:,} bytes")

    original = overview.EXACT_WINDOW_UP_TO
    overview.EXACT_WINDOW_UP_TO = 10**12
    try:
        started = time.perf_counter()
        exact = overview.hourly_counts("default", now)
        exact_ms = (time.perf_counter() - started) * 1000
    finally:
        overview.EXACT_WINDOW_UP_TO = original
    print(f"\nthe exact hourly count the sample replaces: {exact_ms:.0f} ms (once)")
    for series in overview.SERIES:
        counted, estimate = exact.total(series), hourly.total(series)
        error = abs(estimate - counted) / counted * 100 if counted else 0.0
        print(f"  {series}: exact {counted:,}, from the sample {estimate:,} ({error:.2f} % off)")
    worst = max(
        abs(e - c) / c * 100
        for series in overview.RESOLVED_STATES
        for e, c in zip(hourly.counts[series], exact.counts[series], strict=True)
        if c >= 1000
    )
    print(f"  worst hour of a resolved series with >= 1,000 records: {worst:.1f} % off")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--batches", type=int, default=10, help="INSERT statements")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--postgres-url", default=None, help="the server (a database URL)")
    parser.add_argument("--keep", action="store_true", help="leave the database for inspection")
    parser.add_argument("--reuse", default=None, help="measure this kept database, no fill")
    args = parser.parse_args(argv)

    server = args.postgres_url or postgres_url()
    name = args.reuse or f"idem_overview_{os.getpid()}"
    url = database_url(server, name)
    if args.reuse is None:
        with psycopg.connect(server, autocommit=True, connect_timeout=5) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    print(f"database {name}", flush=True)
    try:
        os.environ["DATABASE_URL"] = url
        os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
        import django

        django.setup()
        if args.reuse is None:
            from django.core.management import call_command
            from django.db import connections

            call_command("migrate", verbosity=0, interactive=False)
            connections.close_all()
            fill(url, args.records, args.batches, datetime.now(UTC))
        else:
            from django.contrib.auth import get_user_model

            get_user_model().objects.filter(username="bench").delete()
        measure(args.rounds)
    finally:
        from django.db import connections

        connections.close_all()
        if args.keep or args.reuse:
            print(f"\nkept database {name} ({url})")
        else:
            with psycopg.connect(server, autocommit=True, connect_timeout=5) as admin:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
            print(f"\ndropped database {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
