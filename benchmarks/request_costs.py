#!/usr/bin/env python3
"""What one request costs, counted: round trips, statements, writes, WAL, instructions.

    .venv/bin/python benchmarks/request_costs.py [--write-docs] [--json FILE]
        [--requests 200] [--loops 50,150] [--runs 2] [--only DESIGNS]
        [--baseline FILE | --baseline none] [--no-instructions] [--keep-dumps DIR]
        [--server own|shared]

For the unprotected view (and the same view without its INSERT, the
framework's own cost), the hand-written floors (claim first, lookup first,
optimistic) and the package's two modes (benchmarks/benchapp/views.py), and
for each a first execution, a replay and a 409 (a duplicate while the first
request with its key is in flight), on fresh PostgreSQL databases:

1. the counting pass (this process, Django's test client, ``--requests``
   requests per cell after a warm-up): round trips on the wire (a relay
   between Django and PostgreSQL counts the client's Query and Sync
   messages), statements (Django's query log, BEGIN/COMMIT/ROLLBACK left
   out), rows inserted, updated (HOT or not) and deleted and index entries
   added per table and per index (the WAL's heap and B-tree records, read
   with pg_walinspect; the indexes and their predicates from the catalog),
   and WAL bytes (this database's records, full-page images apart);
2. the instruction pass (``--runs`` runs, each a process of its own under
   ``valgrind --tool=callgrind`` with ``PYTHONHASHSEED=0`` on a fresh
   database): per cell a loop of ``short`` then of ``long`` requests after
   the same warm-up; (instructions of the long loop - the short one's) /
   (long - short) is what one request costs in the Python process. The
   runs' spread is printed: the figure repeats from run to run;
3. prints the table, each figure as "before → now" against ``--baseline``
   (default: benchmarks/figures/request_costs_1.0.0rc1.json, measured at
   the release candidate's code), the index entries by index, and the
   release's deterministic targets with a verdict each; ``--write-docs``
   replaces the block between the markers of docs/performance.md ("Per
   request, counted"), ``--json`` writes every figure (the SQL of each cell
   too).

Needs valgrind (Debian: ``apt-get install valgrind``) unless
``--no-instructions``; about 10 minutes with the defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from importlib.metadata import version  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.benchlib import (  # noqa: E402
    REPO_ROOT,
    Database,
    machine,
    migrate,
    postgres_url,
    server_facts,
)
from benchmarks.costs import counting, instructions, report, targets  # noqa: E402
from benchmarks.costs.cells import VARIANTS, Cell, Variant, cells, variants_named  # noqa: E402
from benchmarks.costs.counting import Counted  # noqa: E402
from benchmarks.costs.own_server import OwnServer  # noqa: E402
from benchmarks.costs.writes import Catalog, short  # noqa: E402

BASELINE = _HERE / "figures" / "request_costs_1.0.0rc1.json"
DOCS = REPO_ROOT / "docs" / "performance.md"


def package_tree() -> str:
    """The git tree of django_idempotency/ measured (with ``+changes`` when it differs)."""
    tree = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD:django_idempotency"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    changes = subprocess.run(
        ["git", "status", "--porcelain", "--", "django_idempotency"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"{tree}+changes" if changes else tree


def cell_figures(cell: Cell, counted: Counted) -> dict[str, Any]:
    n = counted.requests
    writes = counted.writes
    rows = {
        short(table): {
            "inserted": rows.inserted / n,
            "updated": rows.updated / n,
            "hot": rows.hot / n,
            "deleted": rows.deleted / n,
        }
        for table, rows in sorted(writes.rows.items())
    }
    return {
        "design": cell.variant.name,
        "case": cell.case,
        "requests": n,
        "round_trips": statistics.fmean(counted.round_trips),
        "round_trips_range": [min(counted.round_trips), max(counted.round_trips)],
        "logged_round_trips": statistics.fmean(counted.logged),
        "statements": statistics.fmean(counted.statements),
        "statements_range": [min(counted.statements), max(counted.statements)],
        "rows": rows,
        "rows_inserted": sum(table["inserted"] for table in rows.values()),
        "rows_updated": sum(table["updated"] for table in rows.values()),
        "rows_hot": sum(table["hot"] for table in rows.values()),
        "rows_deleted": sum(table["deleted"] for table in rows.values()),
        "index_entries": sum(writes.entries.values()) / n,
        "index_entries_by_index": {
            name: entries / n for name, entries in sorted(writes.entries.items())
        },
        "other_index_records": {
            name: records / n for name, records in sorted(writes.other_index_records.items())
        },
        "wal_bytes": writes.record_bytes / n,
        "wal_full_page_image_bytes": writes.full_page_image_bytes / n,
        "wal_records": {
            f"{manager}/{kind}": count / n
            for (manager, kind), count in sorted(writes.records.items())
        },
        "sql": counted.sql,
        "warnings": counted.warnings,
    }


def catalog_indexes(catalog: Catalog) -> list[dict[str, Any]]:
    return [
        {
            "table": index.table,
            "name": index.name,
            "definition": index.definition,
            "predicate": index.predicate,
        }
        for index in catalog.indexes
        if not index.table.startswith(("django_migrations", "django_content_type"))
    ]


def measure_instructions(
    args: argparse.Namespace, server_url: str, figures: dict[str, Any], variants: list[str]
) -> None:
    short_loop, long_loop = args.loops
    runs: list[dict[str, float]] = []
    for number in range(1, args.runs + 1):
        started = time.monotonic()
        keep = args.keep_dumps / f"run{number}" if args.keep_dumps else None
        loops = instructions.run(
            server_url, variants, args.warmup, short_loop, long_loop, keep, shift=number - 1
        )
        runs.append(
            {
                cell: instructions.per_request(found, short_loop, long_loop)
                for cell, found in loops.items()
            }
        )
        print(f"callgrind run {number}/{args.runs}: {time.monotonic() - started:.0f} s", flush=True)
    worst: tuple[float, float, str] = (0.0, 0.0, "")  # relative, absolute, cell
    for name, cell in figures["cells"].items():
        values = [run[name] for run in runs]
        cell["instructions_runs"] = [round(value) for value in values]
        cell["instructions"] = statistics.fmean(values)
        spread = max(values) - min(values)
        relative = spread / cell["instructions"] if cell["instructions"] else 0.0
        if relative >= worst[0]:
            worst = (relative, spread, name)
    if args.runs > 1:
        figures["repeatability"] = {
            "runs": args.runs,
            "max_relative": worst[0],
            "max_absolute": worst[1],
            "cell": worst[2],
        }


def load_baseline(argument: str) -> dict[str, Any] | None:
    if argument == "none":
        return None
    path = Path(argument)
    if not path.exists():
        print(f"no baseline at {path}: figures shown without before", file=sys.stderr)
        return None
    baseline: dict[str, Any] = json.loads(path.read_text())
    try:
        baseline["path"] = str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        baseline["path"] = str(path)
    return baseline


def print_instructions(figures: dict[str, Any]) -> None:
    if "repeatability" not in figures:
        return
    print("\ninstructions per request, each run (callgrind):")
    for name in report.cell_order(figures):
        cell = figures["cells"][name]
        runs = "  ".join(f"{value:>11,}" for value in cell["instructions_runs"])
        spread = max(cell["instructions_runs"]) - min(cell["instructions_runs"])
        print(f"  {name:<42}{runs}   spread {spread:,} ({spread / cell['instructions']:.4%})")


def measure(
    args: argparse.Namespace, server_url: str, chosen: list[Cell], variants: tuple[Variant, ...]
) -> dict[str, Any]:
    """The counting pass, then the callgrind runs, on fresh databases of ``server_url``."""
    import psycopg

    facts = machine()
    started = time.monotonic()
    with Database(server_url, "idem_bench_costs") as database:
        with database.connect() as admin:
            facts.update(server_facts(admin))
        migrate(database)
        counted = counting.count(database, chosen, args.requests, args.warmup)
    print(f"counting pass: {time.monotonic() - started:.0f} s", flush=True)
    figures: dict[str, Any] = {
        "label": args.label or facts["commit"],
        "measured": {
            **{key: facts[key] for key in ("cpus", "cpu", "memory", "python", "commit")},
            "package_tree": package_tree(),
            "django": version("django"),
            "drf": version("djangorestframework"),
            "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
            "server_version": facts["server_version"],
            "server": args.server,
            "valgrind": instructions.valgrind_version() if not args.no_instructions else "",
            "requests": args.requests,
            "warmup": args.warmup,
            "loops": list(args.loops),
            "runs": 0 if args.no_instructions else args.runs,
        },
        "indexes": catalog_indexes(counted["catalog"]),
        "cells": {cell.name: cell_figures(cell, counted["cells"][cell.name]) for cell in chosen},
        "no_409": {variant.name: variant.in_flight for variant in variants if variant.in_flight},
    }
    if not args.no_instructions:
        measure_instructions(args, server_url, figures, [variant.name for variant in variants])
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="counted per cell")
    parser.add_argument("--warmup", type=int, default=20, help="requests per cell, first")
    parser.add_argument(
        "--loops",
        type=lambda text: tuple(int(part) for part in text.split(",")),
        default=(50, 150),
        help="the two loop lengths under callgrind, SHORT,LONG (default 50,150)",
    )
    parser.add_argument("--runs", type=int, default=2, help="callgrind runs (default 2)")
    parser.add_argument("--no-instructions", action="store_true", help="skip callgrind")
    parser.add_argument(
        "--keep-dumps",
        type=Path,
        help="copy each loop's callgrind dump here (DIR/runN/CELL.LOOP.callgrind), for "
        "callgrind_annotate",
    )
    parser.add_argument("--only", help="comma-separated designs, e.g. 'floor,package default'")
    parser.add_argument(
        "--server",
        choices=("own", "shared"),
        default="own",
        help="own (default): a PostgreSQL server of its own, started for the run; shared: "
        "IDEMPOTENCY_BENCH_POSTGRES_URL or the local server, where other databases' "
        "transactions change which updates are HOT and what reads prune",
    )
    parser.add_argument("--baseline", default=str(BASELINE), help="'none' for no before")
    parser.add_argument("--label", help="what this measurement is (kept in --json)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite the block of {DOCS}")
    args = parser.parse_args(argv)
    # A SIGTERM unwinds like an exception: the server of its own is stopped, the databases
    # dropped.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    if len(args.loops) != 2 or not 0 < args.loops[0] < args.loops[1]:
        parser.error("--loops: SHORT,LONG with 0 < SHORT < LONG")
    variants = (
        variants_named([name.strip() for name in args.only.split(",")]) if args.only else VARIANTS
    )
    chosen = cells(variants)
    before = load_baseline(args.baseline)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.server == "own":
            server_url = stack.enter_context(OwnServer()).url
        else:
            server_url = postgres_url()
        figures = measure(args, server_url, chosen, variants)
    figures["targets"] = targets.evaluate(figures, before)
    text = report.block(figures, before)
    print()
    print(text)
    print_instructions(figures)
    warnings = [line for cell in figures["cells"].values() for line in cell["warnings"]]
    if warnings:
        print("\ncross-checks that disagree:")
        print("\n".join(f"  {line}" for line in warnings))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if args.write_docs:
        report.write_docs(DOCS, text)
        print(f"\nrewrote the block of {DOCS.relative_to(REPO_ROOT)}")
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
