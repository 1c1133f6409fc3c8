#!/usr/bin/env python3
"""Behaviour at scale: claims at 10,000 vs 10,000,000 rows, and purging 1,000,000 rows.

    .venv/bin/python benchmarks/scale.py [--large 10000000] [--expired 1000000] [--json out.json]

1. creates two fresh PostgreSQL databases (``idem_bench_scale_<random>``),
   migrates django_idempotency into both and bulk-loads ``--small`` (10,000)
   and ``--large`` (10,000,000) records with ``INSERT ... SELECT
   generate_series`` (indexes dropped during the load and rebuilt from
   their catalog definitions after it, then ``VACUUM ANALYZE``): random
   32-character keys over 5,000 tenants and 4 operations, 96 % COMPLETED,
   2 % FAILED, 0.3 % unresolved; in the large one the oldest ``--expired``
   (1,000,000) records are resolved and past ``expires_at``;
2. claim latency: ``store.claim()`` (the claim path of every first
   execution: one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` in
   autocommit, its commit included) with new random keys, ``--claims`` per
   database, alternating blocks of 100 between the two databases so that
   both see the same machine; and the replay lookup (``store.lookup()`` of
   existing keys); p50, p90, p99 and the ratio large / small
   (target: p50 grows by at most 1.3x);
3. purge under load: a separate process claims keys in a loop on the large
   database (one at a time, like a steady stream of first executions) for
   ``--baseline`` seconds, then keeps claiming while this process runs
   ``purge.purge_expired_records()`` (batches of ``--batch-size``, pausing
   ``--pause-factor`` times as long as each batch took) until
   the expired records are gone. Reports rows/s, batches, the longest and the
   p50/p99 batch, and the claims' p50/p99 before vs during the purge
   (targets: no batch over 200 ms; claims' p99 during within 2x of before);
4. drops both databases (``--keep`` keeps them).

Everything runs on loopback against the local server (or
``IDEMPOTENCY_BENCH_POSTGRES_URL``). Loading 10M rows takes a few minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    Database,
    load_average,
    machine,
    percentile,
    postgres_url,
    server_facts,
)

TABLE = "django_idempotency_record"
TENANTS = 5000
OPERATIONS = ["POST v1/payments", "POST v1/refunds", "POST v1/customers", "POST v1/payouts"]
TTL = timedelta(hours=24)
LEASE = timedelta(minutes=2)


def load_sql(rows: int, expired: int) -> str:
    """``rows`` records; the first ``expired`` resolved and past retention.

    Expired ones were created 75 to 72 hours ago and kept 72 hours; the rest
    over the last 71 hours. Keys are md5 of the row number: random order in
    the key indexes, like client-generated UUIDs.
    """
    fresh = max(rows - expired, 1)
    operations = ", ".join(f"'{name}'" for name in OPERATIONS)
    return f"""
INSERT INTO {TABLE} (
    tenant, operation, key, fingerprint, state, lease_owner, lease_expires_at,
    fencing_token, provider_key, provider_operation_id, response_status,
    response_headers, response_body, created_at, updated_at, expires_at
)
SELECT
    'user:' || (i % {TENANTS}),
    (ARRAY[{operations}])[1 + i % 4],
    md5(i::text),
    md5(i::text) || md5(i::text),
    s.state,
    CASE WHEN s.resolved THEN '' ELSE 'host:1:1' END,
    CASE WHEN s.resolved THEN NULL ELSE t.created + interval '2 minutes' END,
    1, '', '',
    CASE WHEN s.resolved THEN (CASE s.state WHEN 'FAILED' THEN 400 ELSE 201 END) END,
    '[["Content-Type", "application/json"], ["Location", "/v1/payments/1"]]'::jsonb,
    CASE WHEN s.resolved THEN convert_to(
        '{{"id": ' || i || ', "amount": 1250, "currency": "EUR", "status": "succeeded"}}',
        'UTF8') END,
    t.created, t.created, t.created + interval '72 hours'
FROM generate_series(1, {rows}) AS i
CROSS JOIN LATERAL (
    SELECT CASE WHEN i <= {expired}
        THEN now() - interval '75 hours' + interval '3 hours' * (i::float8 / {max(expired, 1)})
        ELSE now() - interval '71 hours' * (1 - (i - {expired})::float8 / {fresh})
    END AS created
) AS t
CROSS JOIN LATERAL (
    SELECT state, state IN ('COMPLETED', 'FAILED') AS resolved FROM (
        SELECT CASE
            WHEN i > {expired} AND i % 1000 = 0 THEN 'CLAIMED'
            WHEN i > {expired} AND i % 1000 = 1 THEN 'IN_PROGRESS'
            WHEN i > {expired} AND i % 1000 = 2 THEN 'UNCERTAIN'
            WHEN i % 50 = 3 THEN 'FAILED'
            ELSE 'COMPLETED'
        END AS state
    ) AS picked
) AS s
"""


@contextlib.contextmanager
def indexes_dropped(connection: Any) -> Iterator[None]:
    """The record table's indexes and unique constraints dropped, rebuilt after the block.

    A bulk load into an indexed table takes several times as long.
    """
    indexes = connection.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s "
        "AND indexname NOT IN (SELECT conname FROM pg_constraint)",
        [TABLE],
    ).fetchall()
    constraints = connection.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype = 'u'",
        [TABLE],
    ).fetchall()
    for name, _ in indexes:
        connection.execute(f'DROP INDEX "{name}"')
    for name, _ in constraints:
        connection.execute(f'ALTER TABLE {TABLE} DROP CONSTRAINT "{name}"')
    connection.execute("SET maintenance_work_mem = '1GB'")
    yield
    for name, definition in constraints:
        connection.execute(f'ALTER TABLE {TABLE} ADD CONSTRAINT "{name}" {definition}')
    for _, definition in indexes:
        connection.execute(definition)


def bulk_load(database: Database, rows: int, expired: int) -> dict[str, Any]:
    """Load the rows with the indexes dropped, rebuild them, vacuum; report sizes."""
    started = time.monotonic()
    with database.connect() as connection:
        with indexes_dropped(connection):
            connection.execute(load_sql(rows, expired))
            loaded = time.monotonic() - started
        connection.execute(f"VACUUM (ANALYZE) {TABLE}")
        connection.execute("CHECKPOINT")
        sizes = connection.execute(
            "SELECT pg_size_pretty(pg_table_size(%s)), pg_size_pretty(pg_indexes_size(%s))",
            [TABLE, TABLE],
        ).fetchone()
    return {
        "rows": rows,
        "expired": expired,
        "insert_s": round(loaded, 1),
        "total_s": round(time.monotonic() - started, 1),
        "table_size": sizes[0],
        "indexes_size": sizes[1],
    }


def configure_django(databases: dict[str, str], records_alias: str) -> None:
    import dj_database_url
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "django_idempotency",
        ],
        DATABASES={
            alias: dj_database_url.parse(url, conn_max_age=600) for alias, url in databases.items()
        },
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        IDEMPOTENCY={"DATABASE": records_alias},
        LOGGING_CONFIG=None,
    )
    django.setup()


def new_scope() -> Any:
    from django_idempotency.scope import Scope

    return Scope(f"user:{random.randrange(TENANTS)}", random.choice(OPERATIONS), uuid.uuid4().hex)


def timed_claim(alias: str) -> float:
    from django_idempotency import _store as store
    from django_idempotency._store.digests import Fingerprint

    scope = new_scope()
    started = time.perf_counter()
    fingerprint = Fingerprint(stored="v1:" + "f" * 64, by_version=(("v1", "f" * 64),))
    held = store.claim(scope, fingerprint, ttl=TTL, lease=LEASE, using=alias)
    elapsed = time.perf_counter() - started
    assert held is not None
    return elapsed


def latency_summary(samples: list[float]) -> dict[str, float]:
    return {
        "count": len(samples),
        "p50_ms": percentile(samples, 0.50) * 1000,
        "p90_ms": percentile(samples, 0.90) * 1000,
        "p99_ms": percentile(samples, 0.99) * 1000,
        "max_ms": max(samples) * 1000,
    }


def claim_latency(claims: int, small_rows: int, large_rows: int) -> dict[str, Any]:
    """Alternating blocks of claims (and lookups) on the small and the large database."""
    from django_idempotency import _store as store
    from django_idempotency.scope import Scope

    block = 100
    claimed: dict[str, list[float]] = {"small": [], "large": []}
    looked_up: dict[str, list[float]] = {"small": [], "large": []}
    rows = {"small": small_rows, "large": large_rows}

    for alias in claimed:  # warm-up: connections, plans, caches
        for _ in range(200):
            timed_claim(alias)
    while len(claimed["large"]) < claims:
        for alias in claimed:
            for _ in range(block):
                claimed[alias].append(timed_claim(alias))
                # An existing record, as a replay finds it.
                i = random.randrange(1, rows[alias] + 1)
                scope = Scope(
                    f"user:{i % TENANTS}",
                    OPERATIONS[i % 4],
                    hashlib.md5(str(i).encode()).hexdigest(),
                )
                started = time.perf_counter()
                record = store.lookup(scope, using=alias)
                looked_up[alias].append(time.perf_counter() - started)
                assert record is not None
    result: dict[str, Any] = {}
    for alias in claimed:
        result[alias] = {
            "claim": latency_summary(claimed[alias]),
            "lookup": latency_summary(looked_up[alias]),
        }
    for kind in ("claim", "lookup"):
        result[f"{kind}_p50_ratio"] = (
            result["large"][kind]["p50_ms"] / result["small"][kind]["p50_ms"]
        )
        result[f"{kind}_p99_ratio"] = (
            result["large"][kind]["p99_ms"] / result["small"][kind]["p99_ms"]
        )
    return result


def claimer(url: str, stop: Any, ready: Any, out: str) -> None:
    """Child process: claim new keys one at a time until told to stop."""
    configure_django({"default": url}, "default")
    samples: list[tuple[float, float]] = []
    for _ in range(100):
        timed_claim("default")
    ready.set()
    while not stop.is_set():
        at = time.time()
        samples.append((at, timed_claim("default")))
    Path(out).write_text(json.dumps(samples))


def purge_under_load(
    database: Database, baseline: float, batch_size: int, pause_factor: float
) -> dict[str, Any]:
    from django.db import connections

    from django_idempotency import _store as store
    from django_idempotency import purge

    context = multiprocessing.get_context("spawn")
    stop, ready = context.Event(), context.Event()
    out = Path(f"/tmp/idem-bench-claims-{uuid.uuid4().hex[:8]}.json")
    child = context.Process(target=claimer, args=(database.url, stop, ready, str(out)))
    child.start()
    batches: list[float] = []
    original = store.purge_expired_batch

    def timed_batch(**arguments: Any) -> tuple[int, Any]:
        started = time.perf_counter()
        try:
            return original(**arguments)
        finally:
            batches.append(time.perf_counter() - started)

    try:
        if not ready.wait(120):
            raise RuntimeError("the claiming process did not start")
        baseline_from = time.time()
        time.sleep(baseline)
        purge_from = time.time()
        store.purge_expired_batch = timed_batch  # the purge calls it through the module
        try:
            report = purge.purge_expired_records(batch_size=batch_size, pause_factor=pause_factor)
        finally:
            store.purge_expired_batch = original
        purge_to = time.time()
    finally:
        stop.set()
        child.join(60)
        if child.is_alive():
            child.terminate()
    samples = json.loads(out.read_text())
    out.unlink()
    before = [latency for at, latency in samples if baseline_from <= at < purge_from]
    during = [latency for at, latency in samples if purge_from <= at < purge_to]
    with connections["large"].cursor() as cursor:
        cursor.execute(
            f"SELECT count(*) FROM {TABLE} "
            "WHERE state IN ('COMPLETED', 'FAILED') AND expires_at <= now()"
        )
        left = cursor.fetchone()[0]
    seconds = purge_to - purge_from
    return {
        "deleted": report.deleted,
        "left_expired": left,
        "seconds": seconds,
        "rows_per_s": report.deleted / seconds,
        "batches": report.batches,
        "batch_size": batch_size,
        "pause_factor": pause_factor,
        "longest_batch_ms": report.longest_batch * 1000,
        "batch_p50_ms": percentile(batches, 0.5) * 1000,
        "batch_p99_ms": percentile(batches, 0.99) * 1000,
        "batches_over_200ms": sum(1 for b in batches if b > 0.2),
        "claims_before": latency_summary(before),
        "claims_during": latency_summary(during),
        "p99_ratio": percentile(during, 0.99) / percentile(before, 0.99),
        "p50_ratio": percentile(during, 0.5) / percentile(before, 0.5),
        "first_batches_ms": [round(b * 1000, 1) for b in batches[:5]],
        "last_batches_ms": [round(b * 1000, 1) for b in batches[-5:]],
    }


def migrate_all(aliases: list[str]) -> None:
    from django.core.management import call_command

    for alias in aliases:
        call_command("migrate", database=alias, verbosity=0, interactive=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=10_000_000)
    parser.add_argument("--expired", type=int, default=1_000_000)
    parser.add_argument("--claims", type=int, default=5000, help="per database")
    parser.add_argument("--baseline", type=float, default=30.0, help="seconds of claims alone")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument(
        "--pause-factor",
        type=float,
        default=2.0,
        help="the purge pauses this many times as long as each batch took",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the databases")
    args = parser.parse_args(argv)

    facts = machine()
    results: dict[str, Any] = {"facts": facts, "arguments": vars(args) | {"json": str(args.json)}}
    with ExitStack() as stack:
        small = stack.enter_context(Database(postgres_url(), "idem_bench_scale", keep=args.keep))
        large = stack.enter_context(Database(postgres_url(), "idem_bench_scale", keep=args.keep))
        with small.connect() as connection:
            facts.update(server_facts(connection))
        facts["load_before"] = load_average()
        print(
            f"{facts['cpus']} x {facts['cpu']}, {facts['memory']}, PostgreSQL "
            f"{facts['server_version']} (shared_buffers {facts['shared_buffers']}, autovacuum "
            f"{facts['autovacuum']}), commit {facts['commit']}; load {facts['load_before']}",
            flush=True,
        )
        configure_django({"default": small.url, "small": small.url, "large": large.url}, "large")
        try:
            migrate_all(["small", "large"])
            for name, database, rows, expired in (
                ("small", small, args.small, 0),
                ("large", large, args.large, args.expired),
            ):
                print(f"loading {rows:,} rows into the {name} database ...", flush=True)
                loaded = bulk_load(database, rows, expired)
                results[f"load_{name}"] = loaded
                print(f"  {loaded}", flush=True)

            print(f"claims: {args.claims} per database, alternating blocks ...", flush=True)
            latency = claim_latency(args.claims, args.small, args.large)
            results["claims"] = latency
            print_claims(latency, args)

            print(
                f"\npurge: {args.expired:,} expired rows, batches of {args.batch_size}, "
                f"claims continuing in another process ({args.baseline:g} s baseline first) ...",
                flush=True,
            )
            purge = purge_under_load(large, args.baseline, args.batch_size, args.pause_factor)
            results["purge"] = purge
            print_purge(purge)
        finally:
            from django.db import connections

            connections.close_all()
        facts["load_after"] = load_average()
    print(f"\nload average before {facts['load_before']}, after {facts['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


def print_claims(latency: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"{'':<28}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for kind in ("claim", "lookup"):
        for alias, rows in (("small", args.small), ("large", args.large)):
            row = latency[alias][kind]
            print(
                f"{kind + ' at ' + f'{rows:,}' + ' rows':<28}{row['p50_ms']:9.3f}"
                f"{row['p90_ms']:9.3f}{row['p99_ms']:9.3f}{row['max_ms']:9.3f}"
            )
    ratio = latency["claim_p50_ratio"]
    print(
        f"claim p50 large/small: {ratio:.2f}x (target <= 1.30x: "
        f"{'met' if ratio <= 1.3 else 'MISSED'}); p99 {latency['claim_p99_ratio']:.2f}x; "
        f"lookup p50 {latency['lookup_p50_ratio']:.2f}x"
    )


def print_purge(purge: dict[str, Any]) -> None:
    print(
        f"deleted {purge['deleted']:,} rows in {purge['seconds']:.1f} s: "
        f"{purge['rows_per_s']:,.0f} rows/s, {purge['batches']} batches; expired left: "
        f"{purge['left_expired']}"
    )
    print(
        f"batch: p50 {purge['batch_p50_ms']:.1f} ms, p99 {purge['batch_p99_ms']:.1f} ms, longest "
        f"{purge['longest_batch_ms']:.1f} ms, {purge['batches_over_200ms']} over 200 ms "
        f"(target: none: {'met' if purge['longest_batch_ms'] <= 200 else 'MISSED'}); first "
        f"{purge['first_batches_ms']}, last {purge['last_batches_ms']}"
    )
    before, during = purge["claims_before"], purge["claims_during"]
    print(
        f"claims before: {before['count']} p50 {before['p50_ms']:.3f} ms p99 "
        f"{before['p99_ms']:.3f} ms; during: {during['count']} p50 {during['p50_ms']:.3f} ms "
        f"p99 {during['p99_ms']:.3f} ms"
    )
    ratio = purge["p99_ratio"]
    print(
        f"claims p99 during/before: {ratio:.2f}x (target <= 2.00x: "
        f"{'met' if ratio <= 2 else 'MISSED'}); p50 {purge['p50_ratio']:.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
