"""What was written, read from the catalog and the WAL (pg_walinspect, PostgreSQL 15+).

Rows: the heap records of each table (INSERT, UPDATE, HOT_UPDATE, DELETE).
Index entries: the B-tree records that add a leaf entry to each index:
INSERT_LEAF, INSERT_POST (into a posting list), and a leaf-level split
(SPLIT_L or SPLIT_R at level 0, which carries the new entry). Counting the
index's own records rather than multiplying rows by indexes is what makes a
partial index exact: whether a row version satisfied the index's predicate
when it was written (a claimed version its update no longer has, say) can
no longer be read from the table, but an entry it got is in the WAL. The
tables and indexes (with their predicates, ``pg_index.indpred``) are read
from the catalog, so an index added, dropped or made partial is counted as
it is. Other kinds of index (BRIN) take no entry per row; their records
are counted apart.

Bytes: the records of this database (those touching its relations, and the
commit records of its transactions), apart from full-page images: those
depend on when the last checkpoint ran, the records do not.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: Short names of the benchmark project's tables, in the table.
SHORT_NAMES = {
    "benchapp_payment": "payment",
    "django_idempotency_record": "record",
    "benchapp_floorrecord": "floor",
}
_RELATION = re.compile(r"rel (\d+)/(\d+)/(\d+)")
_LEVEL = re.compile(r"level:? (\d+)")
_SLOTS = itertools.count()


def short(table: str) -> str:
    return SHORT_NAMES.get(table, table)


@dataclass(frozen=True)
class Index:
    table: str
    name: str
    definition: str
    predicate: str | None

    @property
    def btree(self) -> bool:
        return " USING btree " in self.definition


@dataclass
class Catalog:
    database_oid: int
    #: relfilenode -> (table, index name or None for the table itself)
    relations: dict[int, tuple[str, str | None]]
    indexes: list[Index]


def read_catalog(admin: Any) -> Catalog:
    """This database's tables (with their TOAST tables) and indexes."""
    oid = admin.execute(
        "SELECT oid FROM pg_database WHERE datname = current_database()"
    ).fetchone()[0]
    rows = admin.execute(
        """
        SELECT pg_relation_filenode(c.oid), c.relkind, c.relname,
               coalesce(owner.relname, base.relname),
               pg_get_indexdef(c.oid), pg_get_expr(i.indpred, i.indrelid)
        FROM pg_class c
        LEFT JOIN pg_index i ON i.indexrelid = c.oid
        JOIN pg_class base ON base.oid = coalesce(i.indrelid, c.oid)
        LEFT JOIN pg_class owner ON owner.reltoastrelid = base.oid
        JOIN pg_namespace home ON home.oid = coalesce(owner.relnamespace, base.relnamespace)
        WHERE home.nspname = 'public' AND c.relkind IN ('r', 't', 'i')
        """
    ).fetchall()
    relations: dict[int, tuple[str, str | None]] = {}
    indexes = []
    for filenode, kind, name, table, definition, predicate in rows:
        if filenode is None:
            continue
        if kind == "i":
            relations[int(filenode)] = (table, name)
            if not name.startswith("pg_toast"):
                indexes.append(Index(table, name, definition, predicate))
        elif kind in ("r", "t"):
            relations[int(filenode)] = (table, None)
    indexes.sort(key=lambda index: (index.table, index.name))
    return Catalog(int(oid), relations, indexes)


@dataclass
class Rows:
    inserted: int = 0
    updated: int = 0
    hot: int = 0
    deleted: int = 0


@dataclass
class Writes:
    record_bytes: int = 0
    full_page_image_bytes: int = 0
    rows: dict[str, Rows] = field(default_factory=dict)
    #: B-tree index name -> leaf entries added
    entries: Counter[str] = field(default_factory=Counter)
    #: other index (BRIN, say) name -> records written to it (a BRIN index takes no entry
    #: per row: it widens its range's summary when a new value falls outside)
    other_index_records: Counter[str] = field(default_factory=Counter)
    #: (resource manager, record type) -> records, all of this database's
    records: Counter[tuple[str, str]] = field(default_factory=Counter)


@contextlib.contextmanager
def wal_kept(admin: Any) -> Iterator[None]:
    """Keep the WAL written from now on until it has been read.

    Other databases on the server may write enough WAL for a checkpoint to
    recycle a segment before pg_walinspect reads it: a temporary physical
    replication slot, reserving WAL at once, holds it back (and goes away
    with the session if the script dies).
    """
    name = f"idem_bench_costs_{os.getpid()}_{next(_SLOTS)}"
    admin.execute("SELECT pg_create_physical_replication_slot(%s, true, true)", [name])
    try:
        yield
    finally:
        admin.execute("SELECT pg_drop_replication_slot(%s)", [name])


def insert_position(admin: Any) -> str:
    return str(admin.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def wait_until_flushed(admin: Any, position: str, limit: float = 10.0) -> None:
    """pg_walinspect reads flushed WAL only; the WAL writer flushes the rest soon."""
    deadline = time.monotonic() + limit
    while not admin.execute(
        "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", [position]
    ).fetchone()[0]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"WAL not flushed up to {position} after {limit:g} s")
        time.sleep(0.05)


def wal_writes(admin: Any, catalog: Catalog, start: str, end: str) -> Writes:
    """What this database's WAL records between ``start`` and ``end`` wrote."""
    writes = Writes()
    if start == end:
        return writes
    wait_until_flushed(admin, end)
    pattern = f"% rel %/{catalog.database_oid}/%"
    rows = admin.execute(
        """
        WITH records AS (
            SELECT xid, resource_manager, record_type, record_length, fpi_length,
                   description, block_ref
            FROM pg_get_wal_records_info(%(start)s::pg_lsn, %(end)s::pg_lsn)
        ), ours AS (
            SELECT DISTINCT xid FROM records WHERE block_ref LIKE %(pattern)s AND xid <> '0'
        )
        SELECT resource_manager, record_type, record_length, fpi_length, description,
               block_ref
        FROM records
        WHERE block_ref LIKE %(pattern)s OR xid IN (SELECT xid FROM ours)
        """,
        {"start": start, "end": end, "pattern": pattern},
    ).fetchall()
    for manager, kind, length, image, description, block_ref in rows:
        writes.record_bytes += int(length) - int(image)
        writes.full_page_image_bytes += int(image)
        writes.records[(manager, kind)] += 1
        found = _RELATION.search(block_ref or "")
        if found is None or int(found[2]) != catalog.database_oid:
            continue
        relation = catalog.relations.get(int(found[3]))
        if relation is None:
            continue
        table, index = relation
        base = kind.split("+")[0]  # INSERT+INIT: the first row of a new page
        if manager == "Heap" and index is None:
            rows_of = writes.rows.setdefault(table, Rows())
            if base == "INSERT":
                rows_of.inserted += 1
            elif base == "UPDATE":
                rows_of.updated += 1
            elif base == "HOT_UPDATE":
                rows_of.updated += 1
                rows_of.hot += 1
            elif base == "DELETE":
                rows_of.deleted += 1
        elif manager == "Btree" and index is not None:
            if base in ("INSERT_LEAF", "INSERT_POST"):
                writes.entries[index] += 1
            elif base in ("SPLIT_L", "SPLIT_R"):
                level = _LEVEL.search(description or "")
                if level is not None and level[1] == "0":
                    writes.entries[index] += 1
        elif index is not None and manager != "Btree":
            writes.other_index_records[index] += 1
    return writes


def statistics_rows(admin: Any) -> dict[str, Rows]:
    """pg_stat_user_tables' counters (the backends under test must have flushed theirs)."""
    found = admin.execute(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del FROM pg_stat_user_tables"
    ).fetchall()
    return {
        name: Rows(int(ins), int(upd), int(hot), int(deleted))
        for name, ins, upd, hot, deleted in found
    }
