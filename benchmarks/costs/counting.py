"""The counting pass: round trips, statements, rows, index entries and WAL bytes per request.

In this process, Django set up on a fresh database reached through a
``RoundTripRelay``; for each cell a warm-up loop, a VACUUM ANALYZE of every
table (as autovacuum would, between bursts), then ``requests`` requests
measured one by one (round trips on the wire, statements in Django's query
log) and as a whole (the WAL between the loop's first and last position,
and ``pg_stat_user_tables`` as a cross-check of the rows).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from benchmarks.benchlib import BENCH_SETTINGS, Database
from benchmarks.costs.cells import BUSINESS_TABLE, Cell, Driver
from benchmarks.costs.wire import RoundTripRelay
from benchmarks.costs.writes import (
    Catalog,
    Rows,
    Writes,
    insert_position,
    read_catalog,
    statistics_rows,
    wal_kept,
    wal_writes,
)

#: What Django logs for transaction control: round trips, not statements.
TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK")


@dataclass
class Counted:
    """One cell's figures over ``requests`` requests (totals; per request is total / requests)."""

    requests: int
    round_trips: list[int]  # per request, on the wire
    logged: list[int]  # per request, Django's query log (BEGIN and COMMIT included)
    statements: list[int]  # per request, Django's query log without transaction control
    sql: list[str]  # the last request's, as logged
    writes: Writes
    warnings: list[str] = field(default_factory=list)


def relayed_url(database: Database, relay: RoundTripRelay) -> str:
    parts = urlsplit(database.url)
    netloc = f"{parts.username or 'postgres'}@127.0.0.1:{relay.port}"
    query = urlencode({"sslmode": "disable", "gssencmode": "disable"})
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def count(database: Database, cells: list[Cell], requests: int, warmup: int) -> dict[str, Any]:
    """Set Django up on ``database`` (migrated) through a relay and count every cell."""
    target = urlsplit(database.url)
    relay = RoundTripRelay(target.hostname or "127.0.0.1", target.port or 5432)
    os.environ["DATABASE_URL"] = relayed_url(database, relay)
    os.environ["DJANGO_SETTINGS_MODULE"] = BENCH_SETTINGS
    import django

    django.setup()
    from django.db import connections

    try:
        with database.connect() as admin:
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            catalog = read_catalog(admin)
            driver = Driver(locker_url=database.url)
            counted = {
                cell.name: count_cell(driver, relay, admin, catalog, cell, requests, warmup)
                for cell in cells
            }
            return {"catalog": catalog, "cells": counted}
    finally:
        connections.close_all()
        relay.close()


def flush_statistics(admin: Any) -> dict[str, Rows]:
    """pg_stat_user_tables once the benchmark's backend has flushed its counters."""
    from django.db import connection

    with connection.cursor() as cursor:  # flushed when that backend next goes idle
        cursor.execute("SELECT pg_stat_force_next_flush()")
    time.sleep(0.2)
    return statistics_rows(admin)


def vacuum(admin: Any) -> None:
    tables = admin.execute(
        "SELECT quote_ident(relname) FROM pg_stat_user_tables ORDER BY relname"
    ).fetchall()
    for (table,) in tables:
        admin.execute(f"VACUUM (ANALYZE) {table}")


def count_cell(
    driver: Driver,
    relay: RoundTripRelay,
    admin: Any,
    catalog: Catalog,
    cell: Cell,
    requests: int,
    warmup: int,
) -> Counted:
    from django.db import connection

    with driver.ready(cell, "w", first_loop=True):
        driver.run(cell, "w", warmup)
    vacuum(admin)
    round_trips: list[int] = []
    logged: list[int] = []
    statements: list[int] = []
    sql: list[str] = []
    with driver.ready(cell, "m", first_loop=False), wal_kept(admin):
        before = flush_statistics(admin)
        start = insert_position(admin)
        debug_cursor, connection.force_debug_cursor = connection.force_debug_cursor, True
        try:
            for index in range(requests):
                connection.queries_log.clear()
                wire = relay.round_trips
                driver.send(cell, "m", index)
                round_trips.append(relay.round_trips - wire)
                sql = [str(query["sql"]) for query in connection.queries_log]
                logged.append(len(sql))
                statements.append(
                    sum(1 for text in sql if text.strip().upper() not in TRANSACTION_CONTROL)
                )
        finally:
            connection.force_debug_cursor = debug_cursor
        end = insert_position(admin)
        after = flush_statistics(admin)
        writes = wal_writes(admin, catalog, start, end)
    counted = Counted(requests, round_trips, logged, statements, sql, writes)
    check(counted, cell, catalog, before, after)
    return counted


def check(
    counted: Counted, cell: Cell, catalog: Catalog, before: dict[str, Rows], after: dict[str, Rows]
) -> None:
    """Fail on a wrong measurement; note what the cross-checks disagree on."""
    business = counted.writes.rows.get(BUSINESS_TABLE, Rows()).inserted
    expected = counted.requests if cell.writes_business_row else 0
    if business != expected:
        raise AssertionError(f"{cell.name}: {business} business rows written, expected {expected}")
    for table, rows in counted.writes.rows.items():
        was, now = before.get(table, Rows()), after.get(table, Rows())
        stated = Rows(
            now.inserted - was.inserted,
            now.updated - was.updated,
            now.hot - was.hot,
            now.deleted - was.deleted,
        )
        if stated != rows:
            counted.warnings.append(
                f"{cell.name}: {table}: the WAL says {rows}, pg_stat_user_tables {stated}"
            )
    for index in catalog.indexes:
        if index.predicate is not None or not index.btree:
            continue
        rows = counted.writes.rows.get(index.table, Rows())
        versions = rows.inserted + rows.updated - rows.hot
        if counted.writes.entries.get(index.name, 0) != versions:
            counted.warnings.append(
                f"{cell.name}: {index.name}: {counted.writes.entries.get(index.name, 0)} "
                f"entries for {versions} new row versions of {index.table}"
            )
