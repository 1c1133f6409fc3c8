#!/usr/bin/env python3
"""The figures docs/scaling.md sizes a deployment from: bytes, WAL, purge, bloat, recovery.

    .venv/bin/python benchmarks/sizing.py [--rows 200000] [--ticks 60] [--json out.json]

On PostgreSQL databases of its own (``idem_bench_sizing_<pid>_<random>`` on
127.0.0.1:5432 or ``IDEMPOTENCY_BENCH_POSTGRES_URL``; dropped at the end,
``--keep`` keeps them), through the package's own code:

1. **WAL per request** (``pg_walinspect``, with the helpers of
   benchmarks/wal_per_request.py): ``--requests`` first executions as the
   default mode writes them (``store.claim()`` in autocommit, then
   ``store.complete()`` in a transaction of its own, where the view's
   writes would be), for a 200-byte and a 2 KB JSON response; replays
   (``store.claim()`` losing, then ``store.lookup()``); the optimistic
   mode's one ``store.record_finished()``. WAL record bytes and full-page
   image bytes apart, commits, index entries, and records per second
   written by one connection doing nothing else.
2. **Bytes per record**: ``--rows`` records per body size, written with
   the store's own claim and completion statements and parameters (in
   batches of 1,000 per transaction, so that the load takes seconds, not
   minutes: the rows are the same, only the commits are fewer), then
   VACUUM; heap, each index, TOAST and total, per record.
3. **Recovery**: ``--stale`` claims whose lease has run out, among those
   rows; the time of ``recovery.recover_stale_records()`` settling them
   (no reconciler: CLAIMED records are released), and of a sweep that
   finds nothing (what a beat pays every minute).
4. **Purge**: the rows' retention ends; ``purge.purge_expired_records()``
   deletes them all, as shipped (batches of 100, a pause of twice each
   batch's time) on the 200-byte table, with no pause (``pause_factor=0``:
   the rate its statements allow) on the 2 KB one: rows per second,
   batches, the longest batch, and WAL per row (over the first 50 batches:
   a checkpoint may recycle the WAL of a longer stretch before it is read).
5. **Bloat**: three more databases hold ``--retention`` ticks' worth of
   records (``--per-tick`` each) and, every ``--tick`` seconds of real
   time, get ``--per-tick`` new records (claim and completion) while the
   package's purge deletes those whose retention ended (real expiry times:
   retention is ``--retention`` ticks), for ``--ticks`` ticks. Autovacuum is
   **off on this shared server**, so the script runs VACUUM itself exactly
   when autovacuum's trigger would fire (dead rows > threshold + scale
   factor x rows at the last vacuum, or inserts > insert threshold +
   insert scale factor x rows), under that policy's cost delay and limit:
   "none" (never vacuumed), "default" (PostgreSQL 15's defaults: 50 + 0.2,
   1000 + 0.2, cost limit 200, delay 2 ms) and "tuned" (the per-table
   settings docs/scaling.md recommends, set with ALTER TABLE: 0.01 and
   0.01, threshold 1000, cost limit 2000). Heap, index and total size per
   live record at the start and the end, the largest seen, the vacuums run
   and how long they took, and ``pgstattuple``'s dead and free space.

Byte, WAL, row and index-entry counts are deterministic (full-page images
apart, which depend on when the last checkpoint ran); rates and durations
depend on the machine and on what else it runs: other processes share this
one. Nothing is asserted; the figures are printed (``--json FILE`` also
writes them).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    Database,
    load_average,
    machine,
    postgres_url,
    server_facts,
)
from benchmarks.scale import (  # noqa: E402
    LEASE,
    OPERATIONS,
    TABLE,
    TENANTS,
    configure_django,
    migrate_all,
)
from benchmarks.wal_per_request import counters, wal_of_this_database  # noqa: E402

LONG_TTL = timedelta(hours=24)
BATCH = 1000  # records per transaction in the bulk loads
#: The autovacuum policies of the bloat phase: the reloptions set on the
#: table (none for "default") and the trigger, cost limit and delay they mean.
POLICIES: dict[str, dict[str, Any]] = {
    "none": {"vacuum": False},
    "default": {
        "vacuum": True,
        "reloptions": {},
        "threshold": 50,
        "scale_factor": 0.2,
        "insert_threshold": 1000,
        "insert_scale_factor": 0.2,
        "cost_limit": 200,
        "cost_delay_ms": 2,
    },
    "tuned": {
        "vacuum": True,
        "reloptions": {
            "autovacuum_vacuum_threshold": 1000,
            "autovacuum_vacuum_scale_factor": 0.01,
            "autovacuum_vacuum_insert_threshold": 1000,
            "autovacuum_vacuum_insert_scale_factor": 0.01,
            "autovacuum_vacuum_cost_limit": 2000,
            "autovacuum_vacuum_cost_delay": 2,
        },
        "threshold": 1000,
        "scale_factor": 0.01,
        "insert_threshold": 1000,
        "insert_scale_factor": 0.01,
        "cost_limit": 2000,
        "cost_delay_ms": 2,
    },
}


# -- what a record holds -----------------------------------------------------


def small_body(number: int) -> bytes:
    """A payment as an API answers it: about 200 bytes of JSON."""
    noise = hashlib.sha256(str(number).encode()).hexdigest()
    return json.dumps(
        {
            "id": f"pay_{noise[:24]}",
            "object": "payment",
            "amount": 1000 + number % 9000,
            "currency": "EUR",
            "status": "succeeded",
            "customer": f"cus_{noise[24:38]}",
            "created": 1764650000 + number,
            "description": f"Order #{number}",
        },
        separators=(", ", ": "),
    ).encode()


def large_body(number: int) -> bytes:
    """An order with line items: about 2 KB of JSON, as compressible as such answers are.

    One of 1,000 (building one costs more than writing it): PostgreSQL
    compresses each value on its own, so repeats across rows change nothing.
    """
    return _large_body(number % 1000)


@functools.cache
def _large_body(number: int) -> bytes:
    chooser = random.Random(number)
    payment = json.loads(small_body(number))
    items: list[dict[str, Any]] = []
    length = len(small_body(number)) + 12
    while length < 1950:
        item = {
            "sku": f"SKU-{chooser.randrange(10**6):06d}",
            "name": chooser.choice(["Coffee beans", "Filter papers", "Grinder", "Mug", "Kettle"])
            + f" {chooser.randrange(100)}",
            "quantity": chooser.randrange(1, 5),
            "unit_amount": chooser.randrange(100, 10000),
            "tax_rate": chooser.choice([0, 550, 700, 1900, 2000]),
        }
        items.append(item)
        length += len(json.dumps(item, separators=(", ", ": "))) + 2
    payment["items"] = items
    return json.dumps(payment, separators=(", ", ": ")).encode()


BODIES = {"200 B": small_body, "2 KB": large_body}


def headers_of(body: bytes) -> list[list[str]]:
    return [["Content-Type", "application/json"], ["Location", f"/v1/payments/{body[8:36]!r}"]]


def new_scope() -> Any:
    from django_idempotency.scope import Scope

    return Scope(f"user:{random.randrange(TENANTS)}", random.choice(OPERATIONS), str(uuid.uuid4()))


def fingerprint_of(scope: Any) -> Any:
    from django_idempotency._store.digests import Fingerprint

    digest = hashlib.sha256(scope.key.encode()).hexdigest()
    return Fingerprint(stored=f"sk1a2b3c4d:{digest}", by_version=(("sk1a2b3c4d", digest),))


def response_of(body: bytes) -> Any:
    from django_idempotency.responses import StoredResponse

    return StoredResponse(201, headers_of(body), body)


# -- writing records ---------------------------------------------------------


def first_execution(alias: str, body: bytes, ttl: timedelta = LONG_TTL) -> Any:
    """What the default mode writes for a first execution: the claim, then the completion."""
    from django.db import transaction

    from django_idempotency import _store as store
    from django_idempotency.responses import Verdict

    scope = new_scope()
    held = store.claim(scope, fingerprint_of(scope), ttl=ttl, lease=LEASE, using=alias)
    assert held is not None
    with transaction.atomic(using=alias):  # the view's transaction
        store.complete(held, Verdict.COMPLETED, response_of(body), ttl=ttl)
    return scope


#: Per alias, a psycopg connection of the bulk loads' own (server-side
#: binding: each statement prepared once, where Django's cursors plan every one).
_bulk_connections: dict[str, Any] = {}


def bulk_create(alias: str, count: int, body_of: Any, ttl: timedelta, start: int = 0) -> None:
    """``count`` records, claimed then completed with the store's own statements.

    The claim's statement and parameters (``store.claims._claim_params``)
    and the completion's, as ``store.complete`` builds them, sent with
    ``executemany`` in batches of ``BATCH``: the claims of a batch commit,
    then their completions. The same rows, fewer commits than requests make.
    """
    import psycopg
    from django.db import connections

    from django_idempotency._store.claims import _claim_params
    from django_idempotency._store.statements import statements_for
    from django_idempotency.responses import Verdict

    connection = connections[alias]
    connection.ensure_connection()
    sql = statements_for(connection)
    retention_ends = sql.clock.later_params(connection, ttl)
    raw = _bulk_connections.get(alias)
    if raw is None:
        raw = _bulk_connections[alias] = psycopg.connect(
            _url_of(connection.settings_dict), autocommit=True
        )
    done = 0
    while done < count:
        size = min(BATCH, count - done)
        scopes = [new_scope() for _ in range(size)]
        claims = [
            _claim_params(connection, scope, fingerprint_of(scope), ttl=ttl, lease=LEASE)
            for scope in scopes
        ]
        with raw.transaction(), raw.cursor() as cursor:
            cursor.executemany(sql.claim, claims, returning=True)
            ids = []
            while True:
                row = cursor.fetchone()
                assert row is not None
                ids.append(row[0])
                if not cursor.nextset():
                    break
        completions = []
        for offset, record_id in enumerate(ids):
            body = body_of(start + done + offset)
            completions.append(
                [
                    Verdict.COMPLETED.value,
                    201,
                    json.dumps(headers_of(body)),
                    body,
                    False,
                    *retention_ends,
                    *retention_ends,
                    *sql.clock.now_params(connection),
                    record_id,
                    1,
                ]
            )
        with raw.transaction(), raw.cursor() as cursor:
            cursor.executemany(sql.complete, completions)
        done += size


def _url_of(settings: dict[str, Any]) -> str:
    return (
        f"postgresql://{settings['USER']}@{settings['HOST']}:{settings['PORT'] or 5432}"
        f"/{settings['NAME']}"
    )


def close_bulk_connections() -> None:
    for raw in _bulk_connections.values():
        raw.close()
    _bulk_connections.clear()


# -- 1. WAL per request ------------------------------------------------------


def wal_per_request(alias: str, admin: Any, requests: int) -> list[dict[str, Any]]:
    from django.db import connections, transaction

    from django_idempotency import _store as store
    from django_idempotency.responses import Verdict

    connection = connections[alias]
    indexes = non_partial_indexes(admin)
    replayed = first_execution(alias, small_body(0))
    body_number = iter(range(1, 10**9))

    def optimistic() -> None:
        scope = new_scope()
        body = small_body(next(body_number))
        with transaction.atomic(using=alias):
            assert store.lookup(scope, using=alias) is None
            assert store.record_finished(
                scope,
                fingerprint_of(scope),
                Verdict.COMPLETED,
                response_of(body),
                ttl=LONG_TTL,
                using=alias,
                wait=timedelta(seconds=10),
            )

    def replay() -> None:
        scope = replayed
        assert (
            store.claim(scope, fingerprint_of(scope), ttl=LONG_TTL, lease=LEASE, using=alias)
            is None
        )
        assert store.lookup(scope, using=alias) is not None

    cases: list[tuple[str, Callable[[], object]]] = [
        (
            "first execution, 200 B body",
            lambda: first_execution(alias, small_body(next(body_number))),
        ),
        (
            "first execution, 2 KB body",
            lambda: first_execution(alias, large_body(next(body_number))),
        ),
        ("replay", replay),
        ("optimistic first execution, 200 B", optimistic),
    ]
    results = []
    for name, send in cases:
        for _ in range(100):
            send()
        before = counters(admin, connection)
        started = time.perf_counter()
        for _ in range(requests):
            send()
        elapsed = time.perf_counter() - started
        after = counters(admin, connection)
        wal, images = wal_of_this_database(admin, before.lsn, after.lsn)
        was = before.tables.get(TABLE, (0, 0, 0, 0))
        now = after.tables.get(TABLE, (0, 0, 0, 0))
        inserted, updated, hot, _dead = (now[i] - was[i] for i in range(4))
        results.append(
            {
                "case": name,
                "wal_bytes": wal / requests,
                "fpi_bytes": images / requests,
                "commits": (after.commits - before.commits) / requests,
                "rows_inserted": inserted / requests,
                "rows_updated": updated / requests,
                "index_entries": (inserted + updated - hot) * indexes / requests,
                "per_second": requests / elapsed,
            }
        )
        admin.execute(f"VACUUM {TABLE}")
    return results


def non_partial_indexes(admin: Any) -> int:
    # Partial indexes (the provider ids') take no entry for these rows.
    return int(
        admin.execute(
            "SELECT count(*) FROM pg_indexes "
            "WHERE tablename = %s AND indexdef NOT LIKE '%% WHERE %%'",
            [TABLE],
        ).fetchone()[0]
    )


# -- 2. bytes per record -----------------------------------------------------


def sizes(admin: Any) -> dict[str, int]:
    """Heap (main fork), TOAST (with its index), each index, and the total, in bytes."""
    row = admin.execute(
        "SELECT pg_relation_size(c.oid), "
        "coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0), "
        "pg_indexes_size(c.oid), pg_total_relation_size(c.oid) "
        "FROM pg_class c WHERE c.oid = %s::regclass",
        [TABLE],
    ).fetchone()
    found = {"heap": row[0], "toast": row[1], "indexes": row[2], "total": row[3]}
    for name, size in admin.execute(
        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
        "WHERE indrelid = %s::regclass ORDER BY 1",
        [TABLE],
    ).fetchall():
        found[f"index {name}"] = size
    return found


def live_rows(admin: Any) -> int:
    return int(admin.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0])


def bytes_per_record(alias: str, admin: Any, rows: int, body_name: str) -> dict[str, Any]:
    admin.execute(f"TRUNCATE {TABLE} RESTART IDENTITY CASCADE")
    started = time.perf_counter()
    bulk_create(alias, rows, BODIES[body_name], ttl=timedelta(seconds=1))
    loaded = time.perf_counter() - started
    admin.execute(f"VACUUM (ANALYZE) {TABLE}")
    measured = sizes(admin)
    width = admin.execute(
        f"SELECT avg(pg_column_size(r.*)), avg(length(response_body)), "
        f"avg(pg_column_size(response_body)) FROM {TABLE} AS r"
    ).fetchone()
    return {
        "body": body_name,
        "rows": rows,
        "load_seconds": loaded,
        "sizes": measured,
        "per_record": {name: size / rows for name, size in measured.items()},
        "row_width": float(width[0]),
        "body_length": float(width[1]),
        "body_stored": float(width[2]),
    }


# -- 3. recovery -------------------------------------------------------------


def recovery_sweep(alias: str, stale: int) -> dict[str, Any]:
    from django_idempotency import _store as store
    from django_idempotency.recovery import recover_stale_records

    for _ in range(stale):
        scope = new_scope()
        # A lease already over: abandoned at once, as by a host that died.
        assert store.claim(
            scope, fingerprint_of(scope), ttl=LONG_TTL, lease=timedelta(0), using=alias
        )
    time.sleep(0.05)
    started = time.perf_counter()
    report = recover_stale_records(batch_size=stale, database=alias)
    took = time.perf_counter() - started
    empty = []
    for _ in range(20):
        started = time.perf_counter()
        recover_stale_records(batch_size=stale, database=alias)
        empty.append(time.perf_counter() - started)
    return {
        "stale": stale,
        "released": report.released,
        "seconds": took,
        "per_record_ms": took / max(stale, 1) * 1000,
        "empty_sweep_ms": statistics.median(empty) * 1000,
    }


# -- 4. purge ----------------------------------------------------------------


def purge_rate(alias: str, admin: Any, pause_factor: float) -> dict[str, Any]:
    from django.db import connections

    from django_idempotency.purge import purge_expired_records

    # WAL over the first 50 batches only: over a whole purge, a checkpoint
    # (this server's or another database's traffic) may recycle the WAL
    # segments before pg_walinspect reads them.
    lsn_before = admin.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]
    sample = purge_expired_records(pause_factor=pause_factor, max_batches=50, database=alias)
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT 1")  # nothing pending in the purge's backend
    lsn_after = admin.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]
    wal, images = wal_of_this_database(admin, lsn_before, lsn_after)
    rows = live_rows(admin)
    started = time.perf_counter()
    report = purge_expired_records(pause_factor=pause_factor, database=alias)
    took = time.perf_counter() - started
    return {
        "pause_factor": pause_factor,
        "rows_before": rows,
        "deleted": report.deleted,
        "seconds": took,
        "per_second": report.deleted / took if took else 0.0,
        "batches": report.batches,
        "longest_batch_ms": report.longest_batch * 1000,
        "wal_bytes_per_row": wal / max(sample.deleted, 1),
        "fpi_bytes_per_row": images / max(sample.deleted, 1),
    }


# -- 5. bloat ----------------------------------------------------------------


@dataclass
class Vacuumer:
    """Runs VACUUM when autovacuum's trigger would, under the policy's cost settings."""

    policy: dict[str, Any]
    rows_at_last_vacuum: int
    dead: int = 0
    inserted: int = 0
    vacuums: list[float] = field(default_factory=list)

    def wrote(self, inserted: int, dead: int) -> None:
        self.inserted += inserted
        self.dead += dead

    def maybe_vacuum(self, admin: Any, live: int) -> None:
        policy = self.policy
        if not policy["vacuum"]:
            return
        due = self.dead > policy["threshold"] + policy["scale_factor"] * self.rows_at_last_vacuum
        due = due or self.inserted > (
            policy["insert_threshold"] + policy["insert_scale_factor"] * self.rows_at_last_vacuum
        )
        if not due:
            return
        admin.execute(f"SET vacuum_cost_limit = {policy['cost_limit']}")
        admin.execute(f"SET vacuum_cost_delay = '{policy['cost_delay_ms']}ms'")
        started = time.perf_counter()
        admin.execute(f"VACUUM {TABLE}")
        self.vacuums.append(time.perf_counter() - started)
        admin.execute("RESET vacuum_cost_limit")
        admin.execute("RESET vacuum_cost_delay")
        self.dead = self.inserted = 0
        self.rows_at_last_vacuum = live


def stattuple(admin: Any) -> dict[str, float]:
    row = admin.execute(
        "SELECT tuple_percent, dead_tuple_percent, free_percent FROM pgstattuple(%s)", [TABLE]
    ).fetchone()
    return {"live_percent": row[0], "dead_percent": row[1], "free_percent": row[2]}


def bloat(
    aliases: dict[str, str], admins: dict[str, Any], args: argparse.Namespace, load_rate: float
) -> dict[str, Any]:
    from django_idempotency.purge import purge_expired_records

    per_tick, retention, tick = args.per_tick, args.retention, args.tick
    ttl = timedelta(seconds=retention * tick)
    vacuumers: dict[str, Vacuumer] = {}
    results: dict[str, Any] = {}
    # The population a steady state holds: ``retention`` ticks' worth, the
    # oldest tick's retention ending one tick after the ticks start, the
    # next after two... The ticks start once every database is filled, at a
    # time estimated from section 2's load rate (generously).
    fill = 1.5 * len(aliases) * retention * per_tick / load_rate + 1.0
    started = time.monotonic() + fill
    for policy, alias in aliases.items():
        admin = admins[policy]
        options = POLICIES[policy].get("reloptions") or {}
        if options:
            settings = ", ".join(f"{name} = {value}" for name, value in options.items())
            admin.execute(f"ALTER TABLE {TABLE} SET ({settings})")
        for age in range(retention):
            ends = started + (age + 1) * tick - time.monotonic()
            bulk_create(alias, per_tick, small_body, ttl=timedelta(seconds=ends))
        admin.execute(f"VACUUM (ANALYZE) {TABLE}")
        vacuumers[policy] = Vacuumer(POLICIES[policy], live_rows(admin))
        results[policy] = {"start": sizes(admin), "start_rows": live_rows(admin), "largest": 0}
    filled_late = time.monotonic() - started
    for number in range(1, args.ticks + 1):
        delay = started + number * tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for policy, alias in aliases.items():
            admin = admins[policy]
            bulk_create(alias, per_tick, small_body, ttl=ttl)
            deleted = purge_expired_records(database=alias).deleted
            # Each record: a claim (insert), a completion (one dead version),
            # and the purge's DELETE (another).
            vacuumers[policy].wrote(per_tick, per_tick + deleted)
            vacuumers[policy].maybe_vacuum(admin, per_tick * retention)
            total = sizes(admin)["total"]
            results[policy]["largest"] = max(results[policy]["largest"], total)
    late = time.monotonic() - started - args.ticks * tick
    for policy in aliases:
        admin = admins[policy]
        rows = live_rows(admin)
        results[policy].update(
            {
                "end": sizes(admin),
                "end_rows": rows,
                "vacuums": len(vacuumers[policy].vacuums),
                "vacuum_seconds_max": max(vacuumers[policy].vacuums, default=0.0),
                "stattuple": stattuple(admin),
            }
        )
    return {
        "policies": results,
        "late_seconds": max(late, 0.0),
        "fill_late_seconds": max(filled_late, 0.0),
    }


# -- the run -----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="per case of WAL per request")
    parser.add_argument("--rows", type=int, default=200_000, help="records per body size")
    parser.add_argument("--stale", type=int, default=1000, help="abandoned claims to recover")
    parser.add_argument("--per-tick", type=int, default=1000, help="records created per tick")
    parser.add_argument("--retention", type=int, default=40, help="ticks a record is kept")
    parser.add_argument("--ticks", type=int, default=60, help="ticks of the bloat phase")
    parser.add_argument("--tick", type=float, default=1.5, help="seconds per tick")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the databases")
    args = parser.parse_args(argv)

    facts = machine()
    results: dict[str, Any] = {"facts": facts, "arguments": vars(args) | {"json": str(args.json)}}
    prefix = f"idem_bench_sizing_{os.getpid()}"
    with ExitStack() as stack:
        main_db = stack.enter_context(Database(postgres_url(), prefix, keep=args.keep))
        bloat_dbs = {
            policy: stack.enter_context(Database(postgres_url(), prefix, keep=args.keep))
            for policy in POLICIES
        }
        admin = stack.enter_context(main_db.connect())
        facts.update(server_facts(admin))
        facts["load_before"] = load_average()
        print(
            f"{facts['cpus']} x {facts['cpu']}, {facts['memory']}, PostgreSQL "
            f"{facts['server_version']} (shared_buffers {facts['shared_buffers']}, autovacuum "
            f"{facts['autovacuum']}), commit {facts['commit']}; load {facts['load_before']}",
            flush=True,
        )
        aliases = {"default": main_db.url} | {f"bloat_{p}": db.url for p, db in bloat_dbs.items()}
        configure_django(aliases, None)  # type: ignore[arg-type]
        from django.db import connections

        try:
            migrate_all(list(aliases))
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            print("\n1. WAL per request", flush=True)
            results["wal"] = wal_per_request("default", admin, args.requests)
            print_wal(results["wal"])
            print(f"\n2. bytes per record ({args.rows:,} records per body size, after VACUUM)")
            results["bytes"] = []
            results["recovery"] = results["purge"] = None
            purges = []
            for body_name in BODIES:
                measured = bytes_per_record("default", admin, args.rows, body_name)
                results["bytes"].append(measured)
                if body_name == "200 B":
                    results["recovery"] = recovery_sweep("default", args.stale)
                time.sleep(1.1)  # the rows' retention (1 s) ends
                # As shipped on the first table; with no pause on the second:
                # the rate its statements allow (a DELETE does not read the body).
                pause = 2.0 if body_name == "200 B" else 0.0
                purges.append({"body": body_name} | purge_rate("default", admin, pause))
            print_bytes(results["bytes"])
            print(
                f"\n3. recovery sweep ({args.stale} abandoned claims among {args.rows:,} records)"
            )
            print_recovery(results["recovery"])
            results["purge"] = purges
            print("\n4. purge (purge_expired_records, batches of 100)")
            print_purge(purges, results["wal"])
            print(
                f"\n5. bloat: {args.retention} ticks of {args.per_tick:,} records kept, "
                f"{args.per_tick:,} created and purged per tick of {args.tick} s, "
                f"{args.ticks} ticks",
                flush=True,
            )
            bloat_admins = {
                policy: stack.enter_context(db.connect()) for policy, db in bloat_dbs.items()
            }
            for bloat_admin in bloat_admins.values():
                bloat_admin.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
            small = results["bytes"][0]
            results["bloat"] = bloat(
                {policy: f"bloat_{policy}" for policy in POLICIES},
                bloat_admins,
                args,
                load_rate=small["rows"] / small["load_seconds"],
            )
            print_bloat(results["bloat"])
        finally:
            close_bulk_connections()
            connections.close_all()
        facts["load_after"] = load_average()
        print(f"\nload average: {facts['load_before']} before, {facts['load_after']} after")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


def print_wal(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'case':<36}{'WAL B':>8}{'FPI B':>8}{'commits':>9}{'ins':>6}{'upd':>6}"
        f"{'index entries':>15}{'per s, 1 conn':>15}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['case']:<36}{row['wal_bytes']:>8.0f}{row['fpi_bytes']:>8.0f}"
            f"{row['commits']:>9.2f}{row['rows_inserted']:>6.2f}{row['rows_updated']:>6.2f}"
            f"{row['index_entries']:>15.2f}{row['per_second']:>15.0f}"
        )


def print_bytes(rows: list[dict[str, Any]]) -> None:
    names = [name for name in rows[0]["sizes"] if name.startswith("index ")]
    header = f"{'per record, bytes':<46}" + "".join(f"{row['body']:>12}" for row in rows)
    print(header)
    print("-" * len(header))
    for name in ["heap", "toast", *names, "indexes", "total"]:
        print(f"{name:<46}" + "".join(f"{row['per_record'][name]:>12.1f}" for row in rows))
    print(f"{'row width (pg_column_size)':<46}" + "".join(f"{r['row_width']:>12.1f}" for r in rows))
    print(f"{'body length':<46}" + "".join(f"{r['body_length']:>12.1f}" for r in rows))
    print(f"{'body as stored':<46}" + "".join(f"{r['body_stored']:>12.1f}" for r in rows))
    print(
        f"{'load, records/s (batches of 1,000)':<46}"
        + "".join(f"{r['rows'] / r['load_seconds']:>12.0f}" for r in rows)
    )
    print(f"{'total, MB':<46}" + "".join(f"{r['sizes']['total'] / 1e6:>12.1f}" for r in rows))


def print_recovery(found: dict[str, Any]) -> None:
    print(
        f"settled {found['released']} of {found['stale']} in {found['seconds']:.2f} s: "
        f"{found['per_record_ms']:.2f} ms per record; a sweep finding nothing: "
        f"{found['empty_sweep_ms']:.2f} ms (median of 20)"
    )


def print_purge(rows: list[dict[str, Any]], wal: list[dict[str, Any]]) -> None:
    header = (
        f"{'body':<8}{'pause':>6}{'deleted':>10}{'s':>8}{'rows/s':>10}{'batches':>9}"
        f"{'longest ms':>12}{'WAL B/row':>11}{'FPI B/row':>11}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['body']:<8}{row['pause_factor']:>6.1f}{row['deleted']:>10,}{row['seconds']:>8.1f}"
            f"{row['per_second']:>10,.0f}{row['batches']:>9,}{row['longest_batch_ms']:>12.1f}"
            f"{row['wal_bytes_per_row']:>11.0f}{row['fpi_bytes_per_row']:>11.0f}"
        )
    created = wal[0]["per_second"]
    shipped = rows[0]["per_second"]
    print(
        f"ratio: the shipped purge deletes {shipped / created:.1f}x the records one connection "
        f"creates per second ({created:,.0f}/s, section 1); {shipped / 1157:.1f}x the "
        "1,157/s of 100 million a day"
    )


def print_bloat(found: dict[str, Any]) -> None:
    header = (
        f"{'policy':<9}{'rows':>8}{'vacuums':>8}{'longest s':>10}"
        f"{'heap B/row start':>17}{'end':>7}{'indexes B/row start':>20}{'end':>7}"
        f"{'total MB start':>15}{'end':>7}{'largest':>8}{'growth':>8}{'dead %':>7}{'free %':>7}"
    )
    print(header)
    print("-" * len(header))
    for policy, row in found["policies"].items():
        start, end = row["start"], row["end"]
        print(
            f"{policy:<9}{row['end_rows']:>8,}{row['vacuums']:>8}{row['vacuum_seconds_max']:>10.2f}"
            f"{start['heap'] / row['start_rows']:>17.0f}{end['heap'] / row['end_rows']:>7.0f}"
            f"{start['indexes'] / row['start_rows']:>20.0f}{end['indexes'] / row['end_rows']:>7.0f}"
            f"{start['total'] / 1e6:>15.1f}{end['total'] / 1e6:>7.1f}{row['largest'] / 1e6:>8.1f}"
            f"{end['total'] / start['total']:>7.2f}x"
            f"{row['stattuple']['dead_percent']:>7.1f}{row['stattuple']['free_percent']:>7.1f}"
        )
    if found["late_seconds"] > 1 or found["fill_late_seconds"] > 0:
        print(
            f"(the fill ended {found['fill_late_seconds']:.1f} s after the first tick was due, "
            f"the last tick {found['late_seconds']:.1f} s late: the machine was busy)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
