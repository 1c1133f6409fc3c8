#!/usr/bin/env python3
"""How fast the admin's changelist renders on a large table.

    .venv/bin/python benchmarks/admin_changelist.py [--rows 1000000] [--repeat 7]

1. creates a fresh PostgreSQL database (``idem_bench_<random>``) on the
   server given by ``--postgres-url`` (default ``IDEMPOTENCY_TEST_POSTGRES_URL``,
   else the local server) and migrates the demo project (testproject) into it;
2. inserts ``--rows`` IdempotencyRecord rows with one ``INSERT ... SELECT
   generate_series`` (a fixed seed, so every run builds the same table): about
   95 % COMPLETED, 5 % FAILED and 0.4 % unresolved (CLAIMED, IN_PROGRESS,
   UNCERTAIN; half of them with an expired lease), over 5,000
   tenants (skewed) and 8 operations (from 50 % down to 0.1 % of the rows),
   created over the last 75 hours and kept for 72 hours;
3. runs ``VACUUM ANALYZE`` (what autovacuum does to a table in steady state);
4. logs in a superuser with Django's test client and requests each changelist
   URL (the plain list, page 2, each filter, a search, the date hierarchy's
   drill-down to a day, and "Show counts") once to warm up, then ``--repeat``
   times, printing the median and maximum milliseconds of the whole request,
   the number of SQL queries, the time spent in SQL, and the slowest query.
   Every statement runs under ``statement_timeout`` (``--statement-timeout``,
   30 s like gunicorn's default worker timeout): a page whose query runs
   longer is reported as cancelled, not waited for;
5. for every page whose median is above ``--slow-ms``, prints
   ``EXPLAIN (ANALYZE, BUFFERS)`` of its slowest query (plain ``EXPLAIN`` of
   a cancelled one);
6. drops the database (unless ``--keep``).

Times are those of the request inside Django (URL routing, the admin's
queries, template rendering), without a network hop or a web server.
Nothing here asserts a time: the figures go into docs/admin.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

REPO_ROOT = Path(__file__).resolve().parents[1]
# This directory holds an http.py: off the path, or it shadows the standard
# library's (requests, imported below, fails on it).
sys.path[:] = [
    entry for entry in sys.path if Path(entry or ".").resolve() != REPO_ROOT / "benchmarks"
]
for path in (str(REPO_ROOT), str(REPO_ROOT / "testproject")):
    if path not in sys.path:
        sys.path.insert(0, path)

from tests.live.server import LiveDatabase  # noqa: E402
from tests.live.services import postgres_url  # noqa: E402

CHANGELIST = "/admin/django_idempotency/idempotencyrecord/"

#: (operation, share of the rows, whether it calls a provider), most common first.
OPERATIONS = [
    ("POST v1/payments", 0.50, True),
    ("POST v1/payments/<int:pk>/refunds", 0.20, True),
    ("POST v1/payouts", 0.10, True),
    ("POST v1/customers", 0.08, False),
    ("PATCH v1/customers/<int:pk>", 0.06, False),
    ("POST v1/transfers", 0.05, True),
    ("POST v1/invoices/<int:pk>/finalize", 0.009, False),
    ("POST v1/disputes/<int:pk>/evidence", 0.001, False),
]
TENANTS = 5000
CREATED_OVER = timedelta(hours=75)
TTL = timedelta(hours=72)
LEASE = timedelta(minutes=2)


def operation_case() -> tuple[str, str]:
    """SQL CASE expressions picking the operation and 'calls a provider' from r_op."""
    names, external, bound = [], [], 0.0
    for name, share, calls_provider in OPERATIONS[:-1]:
        bound += share
        names.append(f"WHEN r_op < {bound:.4f} THEN '{name}'")
        external.append(f"WHEN r_op < {bound:.4f} THEN {str(calls_provider).lower()}")
    last_name, _, last_external = OPERATIONS[-1]
    return (
        f"CASE {' '.join(names)} ELSE '{last_name}' END",
        f"CASE {' '.join(external)} ELSE {str(last_external).lower()} END",
    )


def insert_sql() -> str:
    operation, external = operation_case()
    # r_state: < 0.001 CLAIMED, < 0.002 IN_PROGRESS, < 0.004 UNCERTAIN,
    # < 0.05 FAILED, else COMPLETED. Unresolved rows: r_lease < 0.5 holds a
    # live lease, the others' ran out (stuck).
    return f"""
    INSERT INTO django_idempotency_record (
        tenant, operation, "key", fingerprint, state, lease_owner, lease_expires_at,
        fencing_token, provider_key, provider_operation_id, response_status,
        response_headers, response_body, created_at, updated_at, expires_at
    )
    SELECT
        'user:' || (1 + floor(r_tenant * r_tenant * r_tenant * {TENANTS}))::int,
        operation,
        substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-4' || substr(h, 14, 3) || '-a'
            || substr(h, 18, 3) || '-' || substr(h, 21, 12),
        md5(i::text || 'f') || md5(i::text || 'g'),
        state,
        CASE WHEN resolved THEN '' ELSE 'web-' || (i %% 8) || ':' || (10000 + i %% 977) END,
        CASE
            WHEN resolved THEN NULL
            WHEN r_lease < 0.5 THEN %(now)s + r_lease * interval '{int(LEASE.total_seconds())} s'
            ELSE created + interval '{int(LEASE.total_seconds())} s'
        END,
        1,
        CASE WHEN external THEN 'pk_' || substr(md5(i::text || 'p'), 1, 24) ELSE '' END,
        CASE
            WHEN external AND (resolved OR state = 'UNCERTAIN')
            THEN 'ch_' || substr(md5(i::text || 'c'), 1, 24)
            ELSE ''
        END,
        CASE
            WHEN state = 'COMPLETED' THEN CASE WHEN operation LIKE 'PATCH%%' THEN 200 ELSE 201 END
            WHEN state = 'FAILED' THEN (ARRAY[400, 402, 404, 409, 422])[1 + (i %% 5)]
        END,
        CASE
            WHEN resolved THEN jsonb_build_array(
                jsonb_build_array('Content-Type', 'application/json'),
                jsonb_build_array('Location', '/v1/payments/' || i))
            ELSE '[]'::jsonb
        END,
        CASE
            WHEN state = 'COMPLETED' THEN convert_to(
                '{{"id":' || i || ',"amount":' || (100 + i %% 99900) || ',"currency":"EUR",'
                || '"status":"succeeded","order_id":"ORD-' || i || '"}}', 'UTF8')
            WHEN state = 'FAILED' THEN convert_to(
                '{{"detail":"Card declined.","code":"card_declined"}}', 'UTF8')
        END,
        created,
        created + CASE WHEN resolved THEN interval '350 ms' ELSE interval '0' END,
        created + interval '{int(TTL.total_seconds())} s'
    FROM (
        SELECT *, state IN ('COMPLETED', 'FAILED') AS resolved FROM (
            SELECT
                i, r_tenant, r_lease, h,
                {operation} AS operation,
                {external} AS external,
                CASE
                    WHEN r_state < 0.001 THEN 'CLAIMED'
                    WHEN r_state < 0.002 THEN 'IN_PROGRESS'
                    WHEN r_state < 0.004 THEN 'UNCERTAIN'
                    WHEN r_state < 0.05 THEN 'FAILED'
                    ELSE 'COMPLETED'
                END AS state,
                %(now)s - %(span)s::interval * ((%(rows)s - i)::float / %(rows)s) AS created
            FROM (
                SELECT
                    i, random() AS r_state, random() AS r_op, random() AS r_tenant,
                    random() AS r_lease, md5(i::text) AS h
                FROM generate_series(1, %(rows)s) AS i
            ) AS draws
        ) AS picked
    ) AS rows_
    """


@dataclass
class Page:
    label: str
    query: str
    times_ms: list[float] = field(default_factory=list)
    queries: int = 0
    sql_ms: float = 0.0
    slowest_ms: float = 0.0
    slowest_sql: str = ""
    slowest_raw: tuple[str, Any] = ("", None)
    all_queries: list[tuple[float, str]] = field(default_factory=list)
    status: int = 0
    timed_out: bool = False

    def median(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else float("inf")

    @property
    def url(self) -> str:
        return CHANGELIST + self.query


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}"


def setup_django(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    import logging

    import django

    django.setup()
    # A page cancelled by the statement timeout is reported in the table; its
    # traceback ("Internal Server Error") would only bury the figures.
    logging.getLogger("django.request").setLevel(logging.CRITICAL)


def build_table(rows: int, now: datetime) -> None:
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0, interactive=False)
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("SELECT setseed(0.42)")
        cursor.execute(
            insert_sql(),
            {"now": now, "span": f"{CREATED_OVER.total_seconds():.0f} s", "rows": rows},
        )
    inserted = time.perf_counter() - started
    started = time.perf_counter()
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE django_idempotency_record")
        cursor.execute("SELECT pg_size_pretty(pg_total_relation_size('django_idempotency_record'))")
        size = cursor.fetchone()[0]
        cursor.execute(
            "SELECT state, count(*) FROM django_idempotency_record GROUP BY state ORDER BY 2 DESC"
        )
        states = ", ".join(f"{state} {count:,}" for state, count in cursor.fetchall())
        # census.stuck(): every UNCERTAIN record, and the others whose lease ran out.
        cursor.execute(
            "SELECT count(*) FROM django_idempotency_record WHERE state = 'UNCERTAIN' "
            "OR (state IN ('CLAIMED', 'IN_PROGRESS') AND lease_expires_at <= %s)",
            [now],
        )
        stuck = cursor.fetchone()[0]
    analyzed = time.perf_counter() - started
    print(
        f"inserted {rows:,} rows in {inserted:.1f} s, VACUUM ANALYZE {analyzed:.1f} s; "
        f"table with indexes {size}\n  {states}; stuck {stuck:,}",
        flush=True,
    )


def pages(now: datetime) -> list[Page]:
    from django_idempotency.models import IdempotencyRecord

    # A key from the middle of the table, and a day in the middle of the expiries.
    middle = IdempotencyRecord.objects.order_by("pk").values_list("key", flat=True)[
        IdempotencyRecord.objects.count() // 2
    ]
    day = (now + TTL - CREATED_OVER / 2).astimezone(UTC)
    common, rare = OPERATIONS[0][0], OPERATIONS[-1][0]
    return [
        Page("changelist", ""),
        Page("page 2", "?p=2"),
        Page("state = stuck", "?state=stuck"),
        Page("state = COMPLETED", "?state=COMPLETED"),
        Page("state = UNCERTAIN", "?state=UNCERTAIN"),
        Page("expiring within an hour", "?expires=hour"),
        Page(f"operation = {common} (50 %)", "?" + urlencode({"operation": common})),
        Page(f"operation = {rare} (0.1 %)", "?" + urlencode({"operation": rare})),
        Page("search: a key", "?q=" + quote(middle)),
        Page('"Show counts" (facets)', "?_facets=True"),
        Page(
            f"date hierarchy: {day:%Y-%m-%d}",
            f"?expires_at__day={day.day}&expires_at__month={day.month}&expires_at__year={day.year}",
        ),
    ]


class QueryLog:
    """Every SQL statement of a request, timed (``connection.execute_wrapper``)."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, str, Any]] = []

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        from django.db import connection

        started = time.perf_counter()
        failed = True
        try:
            result = execute(sql, params, many, context)
            failed = False
            return result
        finally:
            elapsed = (time.perf_counter() - started) * 1000
            shown = sql
            if not failed:
                shown = connection.ops.last_executed_query(context["cursor"], sql, params)
            self.entries.append((elapsed, shown, (sql, params)))


def measure(page: Page, client: Any, repeat: int) -> None:
    from django.db import OperationalError, connection

    for attempt in range(repeat + 1):  # the first one warms up
        log = QueryLog()
        with connection.execute_wrapper(log):
            started = time.perf_counter()
            try:
                response = client.get(page.url)
            except OperationalError as exc:
                if "statement timeout" not in str(exc):
                    raise
                # Cancelled by --statement-timeout: record it, and do not insist.
                page.timed_out = True
                page.queries = len(log.entries)
                page.slowest_ms, page.slowest_sql, page.slowest_raw = log.entries[-1]
                page.all_queries = [(ms, sql) for ms, sql, _ in log.entries]
                return
            elapsed = (time.perf_counter() - started) * 1000
        page.status = response.status_code
        if response.status_code != 200:
            raise SystemExit(f"{page.url} answered {response.status_code}")
        if attempt == 0:
            continue
        page.times_ms.append(elapsed)
        page.queries = len(log.entries)
        page.sql_ms = max(page.sql_ms, sum(entry[0] for entry in log.entries))
        slowest = max(log.entries, key=lambda entry: entry[0])
        if slowest[0] >= page.slowest_ms:
            page.slowest_ms, page.slowest_sql, page.slowest_raw = slowest
        page.all_queries = [(ms, sql) for ms, sql, _ in log.entries]


def explain(raw: tuple[str, Any], analyze: bool = True) -> str:
    from django.db import connection

    sql, params = raw
    options = "ANALYZE, BUFFERS" if analyze else "COSTS"
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN ({options}) {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


def shorten(sql: str, width: int = 240) -> str:
    sql = " ".join(sql.split())
    return sql if len(sql) <= width else sql[: width - 3] + "..."


def report(
    results: list[Page],
    rows: int,
    repeat: int,
    slow_ms: float,
    show_queries: bool,
    timeout_s: float,
) -> None:
    import django
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        server = cursor.fetchone()[0]
        cursor.execute("SHOW shared_buffers")
        buffers = cursor.fetchone()[0]
    print(
        f"\n{rows:,} records; PostgreSQL {server} (shared_buffers {buffers}); "
        f"Django {django.get_version()}; Python {platform.python_version()}; {machine()}\n"
        f"each page requested once to warm up, then {repeat} times; "
        f"statement_timeout {timeout_s:g} s\n"
    )
    print("| page | median ms | max ms | SQL queries | SQL ms (max) | slowest query ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for page in results:
        if page.timed_out:
            cancelled = f"> {timeout_s * 1000:.0f} (cancelled)"
            print(f"| {page.label} | {cancelled} | - | {page.queries} | - | {cancelled} |")
            continue
        print(
            f"| {page.label} | {page.median():.0f} | {max(page.times_ms):.0f} "
            f"| {page.queries} | {page.sql_ms:.0f} | {page.slowest_ms:.0f} |"
        )
    print("\nslowest query of each page:")
    for page in results:
        print(f"  {page.label} ({page.slowest_ms:.1f} ms): {shorten(page.slowest_sql)}")
    if show_queries:
        print("\nevery query of the last request of each page (ms, SQL):")
        for page in results:
            print(f"  -- {page.label}")
            for ms, sql in page.all_queries:
                print(f"  {ms:7.1f}  {shorten(sql, 160)}")
    slow = [page for page in results if page.median() > slow_ms]
    for page in slow:
        if page.timed_out:
            print(
                f"\n=== {page.label}: cancelled by the {timeout_s:g} s statement timeout; "
                f"the cancelled query (EXPLAIN without ANALYZE) ===\n{page.slowest_sql}\n\n"
                f"{explain(page.slowest_raw, analyze=False)}"
            )
            continue
        print(
            f"\n=== {page.label}: median {page.median():.0f} ms > {slow_ms:.0f} ms;"
            f" its slowest query ({page.slowest_ms:.0f} ms) ===\n{page.slowest_sql}\n\n"
            f"{explain(page.slowest_raw)}"
        )
    if not slow:
        print(f"\nno page took longer than {slow_ms:.0f} ms (median)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--slow-ms", type=float, default=300.0, help="EXPLAIN pages slower (ms)")
    parser.add_argument("--postgres-url", default=None, help="the server (a database URL)")
    parser.add_argument(
        "--show-queries", action="store_true", help="list every query of every page"
    )
    parser.add_argument(
        "--statement-timeout",
        type=float,
        default=30.0,
        help="seconds; a page whose query runs longer is reported as cancelled",
    )
    parser.add_argument("--keep", action="store_true", help="leave the database for inspection")
    args = parser.parse_args(argv)

    database = LiveDatabase(args.postgres_url or postgres_url(), prefix="idem_bench")
    database.__enter__()
    print(f"database {database.name}", flush=True)
    try:
        setup_django(database.url)
        from django.contrib.auth import get_user_model
        from django.db import connection
        from django.test import Client

        now = datetime.now(UTC)
        build_table(args.rows, now)
        admin = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")
        client = Client(HTTP_HOST="localhost")
        client.force_login(admin)
        with connection.cursor() as cursor:
            cursor.execute(f"SET statement_timeout = {int(args.statement_timeout * 1000)}")
        results = pages(now)
        load_before = os.getloadavg()
        for page in results:
            measure(page, client, args.repeat)
            shown = "cancelled" if page.timed_out else f"median {page.median():.0f} ms"
            print(f"  {page.label}: {shown}", flush=True)
        load = f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after the measurements"
        print(f"\nload average (1 min): {load}")
        report(
            results, args.rows, args.repeat, args.slow_ms, args.show_queries, args.statement_timeout
        )
    finally:
        from django.db import connections

        connections.close_all()
        if args.keep:
            print(f"\nkept database {database.name} ({database.url})")
        else:
            database.__exit__(None, None, None)
            print(f"\ndropped database {database.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
