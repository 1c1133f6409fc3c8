#!/usr/bin/env python3
"""What a tombstone (``TOMBSTONE_TTL``) costs on PostgreSQL, in bytes per record.

    .venv/bin/python benchmarks/tombstone_size.py [--records 10000] [--steps 0] [--keep]

1. creates a PostgreSQL database of its own, ``idem_bench_tombstones_<random>``
   (on 127.0.0.1:5432 or ``IDEMPOTENCY_BENCH_POSTGRES_URL``), migrates the
   benchmark project (benchmarks/benchproject) into it, and measures the
   records' tables empty (``pg_total_relation_size``: heap, TOAST and
   every index, of ``django_idempotency_record`` and ``django_idempotency_step``);
2. makes ``--records`` records through the real request path, with
   Django's test client: a payment view under ``@idempotent`` that calls
   ``begin_external()`` and ``set_provider_operation()`` (or, with
   ``--steps N``, N steps, each with its provider id), answering 201 with a
   JSON body of about 360 bytes and a ``Location``, as a payments API does.
   Keys are UUIDs, tenants ``user:<n>`` over 5,000 users: every value the
   indexes hold is the package's own (fingerprints, provider keys);
3. measures them again: the cost of a live COMPLETED record. Each
   measure copies the live rows into fresh tables created like the
   records' (their columns, storage and indexes), as compact as a table
   whose freed space is reused in a steady state; ``VACUUM FULL`` in place
   would keep the dead row versions other sessions' snapshots may see;
4. moves every record's ``expires_at`` into the past and runs the real
   purge, ``purge_expired_records()``, with ``TOMBSTONE_TTL`` set: each
   record becomes a tombstone (the stored headers and body dropped); then
   the size again: the cost of a tombstone.

Prints bytes per record (the difference with the empty tables, divided by
``--records``), split into heap (with TOAST) and indexes. Nothing is
asserted: the figure goes into docs/ttl-and-lease.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This directory holds an http.py: off the path, or it shadows the standard library's.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import secrets  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    Database,
    django_env,
    load_average,
    machine,
    migrate,
    postgres_url,
    server_facts,
)

TABLES = ("django_idempotency_record", "django_idempotency_step")
USERS = 5_000
STEP_NAMES = ("authorize", "capture", "refund", "payout")


@dataclass(frozen=True)
class Size:
    """The records' tables, in bytes: heap with TOAST, and indexes."""

    heap: int
    indexes: int

    @property
    def total(self) -> int:
        return self.heap + self.indexes


def measure(database: Database) -> Size:
    """What the records' live rows take, copied into fresh tables like theirs.

    Copied (``CREATE TABLE ... (LIKE ... INCLUDING ALL)``, the same columns,
    storage and indexes, then ``INSERT ... SELECT``), not compacted in place:
    ``VACUUM FULL`` keeps every dead row version some other session's
    snapshot may still see, and the server is shared with other work.
    """
    heap = indexes = 0
    with database.connect() as connection:
        for table in TABLES:
            copy = f"{table}_measured"
            connection.execute(f"CREATE TABLE {copy} (LIKE {table} INCLUDING ALL)")
            try:
                connection.execute(f"INSERT INTO {copy} SELECT * FROM {table}")
                row = connection.execute(
                    "SELECT pg_table_size(%s), pg_indexes_size(%s)", [copy, copy]
                ).fetchone()
            finally:
                connection.execute(f"DROP TABLE {copy}")
            assert row is not None
            heap += int(row[0])
            indexes += int(row[1])
    return Size(heap, indexes)


# -- the payments view whose records are measured -------------------------------------


def tenant_of(request: Any) -> str:
    return f"user:{request.data['customer'] % USERS}"


def make_urls(steps: int) -> list[Any]:
    from django.urls import path
    from rest_framework.decorators import api_view
    from rest_framework.request import Request
    from rest_framework.response import Response

    from django_idempotency import idempotent

    @api_view(["POST"])
    @idempotent(operation="POST v1/payments")
    def pay(request: Request) -> Response:
        claim = request.idempotency  # type: ignore[attr-defined]
        if steps:
            for name in STEP_NAMES[:steps]:
                claim.begin_external(step=name)
                claim.set_provider_operation(f"ch_{secrets.token_hex(12)}", step=name)
        else:
            claim.begin_external()
            # 27 characters, as Stripe's charge ids.
            claim.set_provider_operation(f"ch_{secrets.token_hex(12)}")
        number = int(request.data["order"])
        body = {
            "id": number,
            "order_id": f"ORD-{number:08d}",
            "amount": request.data["amount"],
            "currency": "EUR",
            "status": "succeeded",
            "charge_id": claim.provider_operation_id or "",
            "customer": request.data["customer"],
            "created": "2026-12-01T09:30:00.123456Z",
            "description": "Order of three items, shipped to the customer's default address",
            "receipt_url": f"https://pay.example.com/receipts/{uuid.uuid4()}",
        }
        return Response(body, status=201, headers={"Location": f"/v1/payments/{number}"})

    return [path("v1/payments", pay)]


def make_records(records: int) -> None:
    from django.test import Client

    client = Client(SERVER_NAME="localhost")
    started = time.monotonic()
    for number in range(1, records + 1):
        answer = client.post(
            "/v1/payments",
            {"order": number, "amount": 1000 + number % 9000, "customer": number * 7919},
            content_type="application/json",
            HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()),
        )
        if answer.status_code != 201:
            raise RuntimeError(f"request {number}: {answer.status_code} {answer.content!r}")
        if number % 2_000 == 0:
            print(f"  {number:,} records ({time.monotonic() - started:.0f} s)", flush=True)


def tombstone_everything(database: Database, records: int) -> None:
    from django_idempotency.purge import purge_expired_records

    with database.connect() as connection:
        connection.execute(
            "UPDATE django_idempotency_record SET expires_at = now() - interval '1 second'"
        )
    report = purge_expired_records(batch_size=1_000, pause_factor=0)
    if report.tombstoned != records or report.deleted:
        raise RuntimeError(f"the purge made {report.tombstoned} tombstones of {records}: {report}")


def per_record(size: Size, empty: Size, records: int) -> str:
    heap, indexes = (size.heap - empty.heap) / records, (size.indexes - empty.indexes) / records
    return f"{heap + indexes:7.0f} B  (heap and TOAST {heap:5.0f} B, indexes {indexes:5.0f} B)"


def run(database: Database, records: int, steps: int) -> None:
    os.environ.update(django_env(database))
    import django

    django.setup()
    from django.test.utils import override_settings

    urls = type("urls", (), {"urlpatterns": make_urls(steps)})
    settings = {"TENANT": tenant_of, "TOMBSTONE_TTL": timedelta(days=30)}
    empty = measure(database)
    with override_settings(ROOT_URLCONF=urls, IDEMPOTENCY=settings):
        make_records(records)
        live = measure(database)
        tombstone_everything(database, records)
        tombstones = measure(database)
    with database.connect() as connection:
        facts = server_facts(connection)
    version = facts["server_version"]
    print(f"\n{records:,} records, {steps or 'no'} steps each; PostgreSQL {version}")
    print(f"machine: {machine()}; load average {load_average()}")
    print(f"a live COMPLETED record: {per_record(live, empty, records)}")
    print(f"a tombstone:             {per_record(tombstones, empty, records)}")
    per_day = (tombstones.total - empty.total) / records * 100_000 * 30 / 1024**3
    print(f"100,000 operations a day, TOMBSTONE_TTL 30 days: {per_day:.2f} GiB of tombstones")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=0, choices=range(len(STEP_NAMES) + 1))
    parser.add_argument("--keep", action="store_true", help="keep the database")
    options = parser.parse_args(argv)
    with Database(postgres_url(), "idem_bench_tombstones", keep=options.keep) as database:
        print(f"database {database.name}", flush=True)
        migrate(database)
        run(database, options.records, options.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
