#!/usr/bin/env python3
"""What each design writes per request: WAL bytes, commits, row versions, index entries.

    .venv/bin/python benchmarks/wal_per_request.py [--requests 2000]

Runs the benchmark project (benchmarks/benchproject) in this process on a
fresh PostgreSQL database, through Django's WSGI handler, one request at a
time, and for each endpoint of benchmarks/http.py measures over
``--requests`` requests (after a warm-up):

* WAL bytes per request, records and full-page images apart, of this
  database's transactions only (``pg_walinspect`` between the WAL
  positions before and after; full-page images depend on when the last
  checkpoint ran, the records do not);
* commits per request (``xact_commit`` of ``pg_stat_database``);
* per table (the business table, the records table, the floors' table):
  rows inserted, updated (and how many of those were HOT: no index
  entries), dead row versions left for VACUUM, from
  ``pg_stat_user_tables``;
* index entries added, read from the same WAL: every B-tree leaf insertion
  (a new tuple, one into a posting list, or the new tuple a leaf page split
  carries) is one entry, per index. So a partial index counts only the row
  versions its predicate takes, and a BRIN index (whose summary a row
  version rarely changes) counts apart, as summary updates. With
  ``--per-index`` the entries of each index of the records table follow
  the table;
* statements per request, round trips counted by Django's query log
  (BEGIN and COMMIT included).

The backend under test is asked to flush its statistics
(``pg_stat_force_next_flush()``, PostgreSQL 15+) before the counters are
read from a second connection.
Deterministic enough to compare designs, not a throughput figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import BENCH_SETTINGS, Database, migrate, postgres_url  # noqa: E402

BODY = b'{"amount": 1250, "currency": "EUR"}'
TABLES = ("benchapp_payment", "django_idempotency_record", "benchapp_floorrecord")
SHORT = {
    "benchapp_payment": "payment",
    "django_idempotency_record": "record",
    "benchapp_floorrecord": "floor",
}


@dataclass
class Counters:
    lsn: str
    commits: int
    tables: dict[str, tuple[int, int, int, int]]  # inserted, updated, hot, dead


def counters(admin: Any, tested: Any) -> Counters:
    """The server's counters, once the backend under test has flushed its own."""
    with tested.cursor() as cursor:  # flushed when that backend next goes idle
        cursor.execute("SELECT pg_stat_force_next_flush()")
    time.sleep(0.2)
    lsn = admin.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]
    commits = admin.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()[0]
    rows = admin.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_dead_tup "
        "FROM pg_stat_user_tables WHERE relname = ANY(%s)",
        [list(TABLES)],
    ).fetchall()
    return Counters(str(lsn), int(commits), {row[0]: tuple(row[1:]) for row in rows})


def wal_of_this_database(admin: Any, start: str, end: str) -> tuple[int, int]:
    """(record bytes, full-page image bytes) of the transactions that touched this database.

    Read with pg_walinspect, so that another database's activity on the same
    server (a test suite, say) is not counted: the records whose blocks
    belong to this database give the transactions' ids, and every record of
    those transactions (their commit records included) is summed.
    """
    if start == end:
        return 0, 0  # nothing written (pg_walinspect refuses an empty range)
    oid = admin.execute(
        "SELECT oid FROM pg_database WHERE datname = current_database()"
    ).fetchone()[0]
    row = admin.execute(
        "WITH records AS (SELECT xid, record_length, fpi_length, block_ref "
        "FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)), "
        "ours AS (SELECT DISTINCT xid FROM records WHERE block_ref LIKE %s AND xid <> '0') "
        "SELECT coalesce(sum(record_length - fpi_length), 0), coalesce(sum(fpi_length), 0) "
        "FROM records WHERE xid IN (SELECT xid FROM ours)",
        [start, end, f"%/{oid}/%"],
    ).fetchone()
    return int(row[0]), int(row[1])


#: B-tree WAL records that add an entry to a leaf page: a plain insertion,
#: one into a posting list (deduplicated duplicates), and a page split,
#: which carries the tuple being inserted (an internal page's split carries
#: a downlink, not an entry: told apart by its level).
_LEAF_INSERTS = ("INSERT_LEAF", "INSERT_POST")
_SPLITS = ("SPLIT_L", "SPLIT_R")
#: BRIN records that change a range's summary.
_BRIN_UPDATES = ("INSERT", "UPDATE", "SAMEPAGE_UPDATE")


@dataclass
class IndexWrites:
    #: B-tree entries added, per index name.
    entries: dict[str, int]
    #: BRIN summaries changed, per index name.
    summaries: dict[str, int]
    #: WAL bytes of every record on the index (entries, splits, summaries), per index name.
    wal: dict[str, int]


def index_writes(admin: Any, start: str, end: str) -> IndexWrites:
    """The index entries this database's transactions added between two WAL positions.

    Read from the WAL records themselves, not computed from row counts: a
    partial index takes an entry only for the row versions its predicate
    holds for, which no statistics view tells.
    """
    found = IndexWrites({}, {}, {})
    if start == end:
        return found
    oid = admin.execute(
        "SELECT oid FROM pg_database WHERE datname = current_database()"
    ).fetchone()[0]
    rows = admin.execute(
        "WITH records AS (SELECT resource_manager, record_type, description, block_ref, "
        "record_length "
        "FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn) "
        "WHERE resource_manager IN ('Btree', 'BRIN') AND block_ref LIKE %s) "
        "SELECT c.relname, r.resource_manager, r.record_type, r.description, r.record_length "
        "FROM records r JOIN pg_class c ON c.relfilenode = "
        "substring(r.block_ref from 'rel [0-9]+/[0-9]+/([0-9]+)')::oid",
        [start, end, f"%/{oid}/%"],
    ).fetchall()
    for name, manager, kind, description, length in rows:
        found.wal[name] = found.wal.get(name, 0) + length
        if manager == "Btree" and (
            kind in _LEAF_INSERTS or (kind in _SPLITS and description.startswith("level: 0,"))
        ):
            found.entries[name] = found.entries.get(name, 0) + 1
        elif manager == "BRIN" and kind in _BRIN_UPDATES:
            found.summaries[name] = found.summaries.get(name, 0) + 1
    return found


def index_counts(admin: Any) -> dict[str, str]:
    """Per table: how many indexes, and how many of those are partial."""
    rows = admin.execute(
        "SELECT tablename, count(*), count(*) FILTER (WHERE indexdef LIKE '%% WHERE %%') "
        "FROM pg_indexes WHERE tablename = ANY(%s) GROUP BY 1",
        [list(TABLES)],
    ).fetchall()
    return {row[0]: f"{row[1]}" + (f" ({row[2]} partial)" if row[2] else "") for row in rows}


def index_names(admin: Any, table: str) -> list[str]:
    rows = admin.execute(
        "SELECT indexname FROM pg_indexes WHERE tablename = %s ORDER BY indexname", [table]
    ).fetchall()
    return [row[0] for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--per-index",
        action="store_true",
        help="also print the entries each index of the records table took per request",
    )
    args = parser.parse_args(argv)
    with Database(postgres_url(), "idem_bench_wal") as database:
        migrate(database)
        os.environ["DATABASE_URL"] = database.url
        os.environ["DJANGO_SETTINGS_MODULE"] = BENCH_SETTINGS
        try:
            with database.connect() as admin:
                run(args, admin)
        finally:
            from django.db import connections

            connections.close_all()
    return 0


def run(args: argparse.Namespace, admin: Any) -> None:
    import django

    django.setup()
    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connection
    from django.test.client import RequestFactory
    from django.test.utils import CaptureQueriesContext

    handler = WSGIHandler()
    factory = RequestFactory()
    run_id = uuid.uuid4().hex[:8]
    counter = iter(range(10**9))

    def call(path: str, key: str | None) -> int:
        extra = {} if key is None else {"HTTP_IDEMPOTENCY_KEY": key}
        environ = dict(factory.post(path, BODY, content_type="application/json", **extra).environ)
        statuses: list[str] = []
        result = handler(environ, lambda status, headers, exc_info=None: statuses.append(status))
        b"".join(result)
        result.close()
        return int(statuses[0].split()[0])

    def first(path: str) -> Callable[[], int]:
        return lambda: call(path, f"{run_id}-{path.strip('/')}-{next(counter)}")

    def replay(path: str) -> Callable[[], int]:
        return lambda: call(path, f"{run_id}-replay")

    endpoints: list[tuple[str, Callable[[], int]]] = [
        ("unprotected", lambda: call("/unprotected", None)),
        ("protected (two commits)", first("/protected")),
        ("protected replay", replay("/protected")),
        ("optimistic", first("/protected-optimistic")),
        ("optimistic replay", replay("/protected-optimistic")),
        ("floor (two commits)", first("/floor")),
        ("floor replay", replay("/floor")),
        ("floor optimistic", first("/floor-optimistic")),
        ("floor single", first("/floor-single")),
    ]
    admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    indexes = index_counts(admin)
    print(
        f"per request: totals over {args.requests} requests, divided; indexes per table: "
        + ", ".join(f"{SHORT[table]} {count}" for table, count in sorted(indexes.items()))
        + "\n"
    )
    record_indexes = index_names(admin, "django_idempotency_record")
    per_index: list[tuple[str, IndexWrites]] = []
    header = (
        f"{'endpoint':<26}{'WAL bytes':>10}{'FPI bytes':>10}{'commits':>8}"
        f"{'round trips':>12}{'statements':>11}"
        f"{'rows ins':>9}{'rows upd':>9}{'HOT':>5}{'dead':>6}{'index entries':>14}{'BRIN':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, send in endpoints:
        for _ in range(50):
            assert send() == 201, name
        before = counters(admin, connection)
        with CaptureQueriesContext(connection) as captured:
            for _ in range(args.requests):
                assert send() == 201, name
        after = counters(admin, connection)
        sql = [query["sql"] for query in captured.captured_queries]
        n = args.requests
        inserted = updated = hot = dead = 0
        for table in TABLES:
            was = before.tables.get(table, (0, 0, 0, 0))
            now = after.tables.get(table, (0, 0, 0, 0))
            ins, upd, hot_upd, dead_now = (now[i] - was[i] for i in range(4))
            inserted, updated, hot, dead = (
                inserted + ins,
                updated + upd,
                hot + hot_upd,
                dead + dead_now,
            )
        statements = sum(1 for s in sql if s not in ("BEGIN", "COMMIT", "ROLLBACK"))
        wal, images = wal_of_this_database(admin, before.lsn, after.lsn)
        writes = index_writes(admin, before.lsn, after.lsn)
        per_index.append((name, writes))
        print(
            f"{name:<26}{wal / n:>10.0f}{images / n:>10.0f}"
            f"{(after.commits - before.commits) / n:>8.2f}{len(sql) / n:>12.2f}"
            f"{statements / n:>11.2f}{inserted / n:>9.2f}{updated / n:>9.2f}{hot / n:>5.2f}"
            f"{dead / n:>6.2f}{sum(writes.entries.values()) / n:>14.2f}"
            f"{sum(writes.summaries.values()) / n:>6.2f}"
        )
        admin.execute("VACUUM ANALYZE benchapp_payment, django_idempotency_record")
    if args.per_index:
        print_per_index(per_index, record_indexes, args.requests)


def print_per_index(
    per_index: list[tuple[str, IndexWrites]], names: list[str], requests: int
) -> None:
    """Per request and index of the records table: entries (or BRIN summary updates), WAL bytes."""
    print("\nrecords table, per request, by index: entries (BRIN: summary updates) / WAL bytes")
    for endpoint, writes in per_index:
        if not writes.wal:
            continue
        print(f"  {endpoint}")
        for name in names:
            entries = writes.entries.get(name, 0) + writes.summaries.get(name, 0)
            print(
                f"    {name:<34}{entries / requests:>6.2f}"
                f"{writes.wal.get(name, 0) / requests:>8.0f}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
