#!/usr/bin/env python3
"""How long ``take_census`` and ``manage.py idempotency_health`` take on a large table.

    .venv/bin/python benchmarks/health.py [--records 10000000] [--rounds 5] [--keep]
    .venv/bin/python benchmarks/health.py --database NAME   # time a table kept before

1. creates a PostgreSQL database of its own, ``idem_bench_health_<pid>``
   (on 127.0.0.1:5432 or ``IDEMPOTENCY_BENCH_POSTGRES_URL``), and migrates
   the benchmark project (benchmarks/benchproject) into it;
2. fills the records table with ``--records`` rows by ``INSERT ... SELECT
   generate_series``, in statements of at most 2,000,000 rows, with the
   indexes dropped and rebuilt afterwards (as benchmarks/scale.py does):
   created over the last 48 hours and kept 24, so that half of the resolved
   records are past ``expires_at`` (a large purge backlog); 2 % FAILED, 300
   each of CLAIMED, IN_PROGRESS and UNCERTAIN (no reconciler registered:
   every operation with one of the last two is reported), the rest COMPLETED;
3. runs ANALYZE only, not VACUUM: the visibility map stays empty, as on a
   table autovacuum has not reached yet, so index-only scans still visit
   the heap (the slow case); ``--vacuum`` runs ``VACUUM (ANALYZE)`` instead;
4. times, over ``--rounds`` rounds after one warm-up round:
   ``take_census("default")`` in this process, the command in this process
   (``call_command``), and the command as a Kubernetes exec probe runs it,
   ``python -m django idempotency_health`` in a new process (interpreter and
   Django start-up included);
5. prints the census, the true counts beside the estimated ones (the
   estimate's error), and ``EXPLAIN (ANALYZE, BUFFERS)`` of each of the
   census's statements, slowest first;
6. drops the database (unless ``--keep`` or ``--database``).

Figures depend on the machine and on what else it runs; nothing is asserted.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This directory holds an http.py: off the path, or it shadows the standard library's.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    BENCH_SETTINGS,
    Database,
    database_url,
    django_env,
    machine,
    median,
    migrate,
    postgres_url,
    server_facts,
)
from benchmarks.scale import indexes_dropped  # noqa: E402

TABLE = "django_idempotency_record"
OPERATIONS = ["POST v1/payments", "POST v1/refunds", "POST v1/customers", "POST v1/payouts"]
UNRESOLVED_EACH = 300
CHUNK = 2_000_000


def fill_sql(first: int, last: int, records: int) -> str:
    """Rows ``first`` to ``last`` of ``records``: states and times as the module docstring says."""
    stride = max(records // UNRESOLVED_EACH, 3)
    operations = ", ".join(f"'{name}'" for name in OPERATIONS)
    return f"""
INSERT INTO {TABLE} (
    tenant, operation, key, fingerprint, state, lease_owner, lease_expires_at,
    fencing_token, provider_key, provider_operation_id, response_status,
    response_headers, response_body, response_sealed, created_at, updated_at, expires_at,
    tombstone
)
SELECT
    'user:' || (i % 5000),
    (ARRAY[{operations}])[1 + i % 4],
    md5(i::text),
    'v1:' || md5(i::text) || md5(i::text),
    s.state,
    CASE WHEN s.resolved THEN '' ELSE 'host:1:1' END,
    CASE WHEN s.resolved THEN NULL ELSE t.created + interval '2 minutes' END,
    1, '', '',
    CASE WHEN s.resolved THEN (CASE s.state WHEN 'FAILED' THEN 400 ELSE 201 END) END,
    '[["Content-Type", "application/json"]]'::jsonb,
    CASE WHEN s.resolved THEN convert_to('{{"id": ' || i || ', "status": "ok"}}', 'UTF8') END,
    false, t.created, t.created, t.created + interval '24 hours', false
FROM generate_series({first}, {last}) AS i
CROSS JOIN LATERAL (
    SELECT now() - interval '48 hours' * (1 - i::float8 / {records}) AS created
) AS t
CROSS JOIN LATERAL (
    SELECT state, state IN ('COMPLETED', 'FAILED') AS resolved FROM (
        SELECT CASE
            WHEN i % {stride} = 0 AND i / {stride} <= {UNRESOLVED_EACH} THEN 'CLAIMED'
            WHEN i % {stride} = 1 AND i / {stride} < {UNRESOLVED_EACH} THEN 'IN_PROGRESS'
            WHEN i % {stride} = 2 AND i / {stride} < {UNRESOLVED_EACH} THEN 'UNCERTAIN'
            WHEN i % 50 = 3 THEN 'FAILED'
            ELSE 'COMPLETED'
        END AS state
    ) AS picked
) AS s
"""


def fill(database: Database, records: int, *, vacuum: bool) -> None:
    started = time.monotonic()
    with database.connect() as connection:
        with indexes_dropped(connection):
            for first in range(1, records + 1, CHUNK):
                last = min(first + CHUNK - 1, records)
                connection.execute(fill_sql(first, last, records))
                print(f"  {last:,} rows ({time.monotonic() - started:.0f} s)", flush=True)
        print(f"  indexes rebuilt ({time.monotonic() - started:.0f} s)", flush=True)
        connection.execute(f"VACUUM (ANALYZE) {TABLE}" if vacuum else f"ANALYZE {TABLE}")
        size = connection.execute(
            "SELECT pg_size_pretty(pg_table_size(%s)), pg_size_pretty(pg_indexes_size(%s))",
            [TABLE, TABLE],
        ).fetchone()
    print(
        f"filled in {time.monotonic() - started:.0f} s: table {size[0]}, indexes {size[1]}",
        flush=True,
    )


def setup_django(database: Database) -> None:
    os.environ.update(django_env(database))
    import django

    django.setup()


def time_rounds(rounds: int, work: Any) -> list[float]:
    work()  # warm-up: connection, catalog caches, plans
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return times


def report(name: str, times: list[float]) -> None:
    print(
        f"{name:<44} median {median(times) * 1000:8.1f} ms   max {max(times) * 1000:8.1f} ms"
        f"   ({len(times)} rounds)",
        flush=True,
    )


def subprocess_command(database: Database, *extra: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "django",
            "idempotency_health",
            "--settings",
            BENCH_SETTINGS,
            *extra,
        ],
        cwd=_HERE.parent,
        env=django_env(database),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode not in (0, 1):
        raise RuntimeError(f"idempotency_health exited {result.returncode}:\n{result.stderr}")


def true_counts(database: Database) -> dict[str, int]:
    with database.connect() as connection:
        rows = connection.execute(f"SELECT state, count(*) FROM {TABLE} GROUP BY state").fetchall()
        backlog = connection.execute(
            f"SELECT count(*) FROM {TABLE} WHERE state IN ('COMPLETED', 'FAILED') "
            "AND expires_at <= statement_timestamp()"
        ).fetchone()
    return dict(rows) | {"purge backlog": backlog[0]}


def explain_census(database: Database) -> None:
    """EXPLAIN ANALYZE of each statement ``take_census`` runs, slowest first."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_idempotency.census import take_census

    with CaptureQueriesContext(connection) as queries:
        take_census("default")
    plans = []
    with database.connect() as raw:
        for query in queries.captured_queries:
            sql = query["sql"]
            if sql.startswith("EXPLAIN"):
                plans.append((float(query["time"]), sql, "(the planner's estimate itself)"))
                continue
            lines = raw.execute(f"EXPLAIN (ANALYZE, BUFFERS) {sql}").fetchall()
            plans.append((float(query["time"]), sql, "\n".join(line[0] for line in lines)))
    print(f"\n{len(plans)} statements per census; each with its plan, slowest first:")
    for seconds, sql, plan in sorted(plans, reverse=True):
        print(f"\n--- {seconds * 1000:.1f} ms: {sql}\n{plan}")


def measure(database: Database, rounds: int) -> None:
    from django.core.management import call_command

    from django_idempotency.census import take_census

    report("take_census (in-process)", time_rounds(rounds, lambda: take_census("default")))

    def command() -> None:
        try:
            call_command("idempotency_health", stdout=io.StringIO())
        except SystemExit as exit:  # a threshold crossed is not a failure here
            if exit.code not in (0, 1):
                raise

    report("idempotency_health (call_command)", time_rounds(rounds, command))
    report(
        "python -m django idempotency_health",
        time_rounds(rounds, lambda: subprocess_command(database)),
    )
    # The same process start-up (interpreter, django.setup(), the command's
    # import) with no query: what a probe pays whatever the table holds.
    report(
        "  of which start-up (... --version)",
        time_rounds(rounds, lambda: subprocess_command(database, "--version")),
    )
    out = io.StringIO()
    call_command("idempotency_health", stdout=out)
    print("\n" + out.getvalue())
    census = take_census("default")
    truth = true_counts(database)
    print("state           census        true    error")
    for state, count in census.counts.items():
        true = truth.get(state, 0)
        error = f"{(count - true) / true:+.2%}" if true else "-"
        mark = "about" if state in census.estimated else "exact"
        print(f"{state:<12} {count:>10,} {true:>11,}  {error:>7}  ({mark})")
    capped = "at least " if census.purge_backlog_capped else ""
    print(
        f"purge backlog: census {capped}{census.purge_backlog:,}, true {truth['purge backlog']:,}"
    )
    explain_census(database)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the database")
    parser.add_argument("--vacuum", action="store_true", help="VACUUM (ANALYZE) after the fill")
    parser.add_argument("--database", help="time this database, filled by an earlier --keep run")
    args = parser.parse_args(argv)

    facts = machine()
    keep = args.keep or args.database is not None
    database = Database(postgres_url(), "idem_bench_health", keep=keep)
    database.name = args.database or f"idem_bench_health_{os.getpid()}"
    database.url = database_url(postgres_url(), database.name)
    if args.database is None:
        database.__enter__()
    try:
        with database.connect() as connection:
            facts.update(server_facts(connection))
        print(
            f"{facts['cpus']} x {facts['cpu']}, {facts['memory']}, PostgreSQL "
            f"{facts['server_version']} (shared_buffers {facts['shared_buffers']}), commit "
            f"{facts['commit']}; database {database.name}",
            flush=True,
        )
        if args.database is None:
            migrate(database)
            print(f"filling {args.records:,} records ...", flush=True)
            fill(database, args.records, vacuum=args.vacuum)
        setup_django(database)
        measure(database, args.rounds)
    finally:
        database.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
